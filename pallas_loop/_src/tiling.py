"""Row bookkeeping around the kernel: ordering by count, padding to whole tiles.

A tile of the kernel runs until its slowest row is done, so rows are ordered by
descending count before tiling (tiles then hold rows of similar counts) and put
back in the caller's order afterwards. The batch is padded to whole tiles with
rows of count 0 that copy a real row: the step still sees them (a tile is
computed whole) but their results are dropped, and copying a real row keeps
them finite, so even in a backward pass where they get a zero cotangent they
cannot turn a parameter gradient into NaN (0 * NaN = NaN).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import tree_util

_POISON_PADDING = False


@contextlib.contextmanager
def poisoned_padding():
  """Testing aid: pad with NaN (floats) / -1 (ints) instead of a copied row.

  Used by the tests to prove that no padded row ever reaches the output.
  """
  global _POISON_PADDING
  old, _POISON_PADDING = _POISON_PADDING, True
  try:
    yield
  finally:
    _POISON_PADDING = old


def descending_order(counts: jax.Array) -> jax.Array:
  """Stable permutation putting rows with the largest counts first."""
  return jnp.argsort(-counts, stable=True).astype(jnp.int32)


def inverse_permutation(order: jax.Array) -> jax.Array:
  """`inv` with `take(take(a, order), inv) == a`."""
  return jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype))


def take_rows(tree, index: jax.Array):
  """Gathers rows `index` (in bounds: a permutation or a subset) of every leaf.

  mode="clip": the indices are in bounds by construction, and XLA:CPU gathers
  without the out-of-bounds fill mask about twice as fast (1024 x 64 float32:
  45 us instead of 80-85 us, measured on the 2-core CPU).
  """
  return tree_util.tree_map(lambda a: jnp.take(a, index, axis=0, mode="clip"), tree)


def pad_rows(tree, rows: int, *, poison_ok: bool = True):
  """Pads every leaf of `tree` along axis 0 to `rows` rows (see module doc).

  `poison_ok=False` always copies a real row, even under `poisoned_padding`:
  for the backward kernel, whose masked steps run the VJP with a zero
  cotangent, where a NaN row would make the parameter gradients NaN.
  """

  def pad(a):
    extra = rows - a.shape[0]
    if extra == 0:
      return a
    if _POISON_PADDING and poison_ok:
      fill = jnp.nan if jnp.issubdtype(a.dtype, jnp.inexact) else -1
      block = jnp.full((extra,) + a.shape[1:], fill, a.dtype)
    else:
      block = jnp.broadcast_to(a[-1:], (extra,) + a.shape[1:])
    return jnp.concatenate([a, block], axis=0)

  return tree_util.tree_map(pad, tree)


def pad_counts(counts: jax.Array, rows: int) -> jax.Array:
  """Pads the counts with zeros: padded rows never apply a step."""
  return jnp.pad(counts, (0, rows - counts.shape[0]))
