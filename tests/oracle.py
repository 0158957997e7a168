"""Comparison against `reference.iterate`, with tolerances that have a reason.

float32: the implementations run the same operations as the reference in the
same order, so they agree to a few ulps (2e-5 relative).
bfloat16: rounding the state every step can legitimately differ by an ulp,
which a recurrence may amplify; the rule (as in flash-attention's tests) is
that an implementation may be at most 2x further from the float32 reference
run on the same inputs than the bf16 reference is, plus one bf16 ulp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_loop import _reference as reference

F32_RTOL = 2e-5
F32_ATOL = 2e-5
BF16_ULP = 2.0 ** -7


def to_f32(tree):
  return jax.tree.map(
      lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def assert_trees_close(got, want, want_f32=None, *, what="output"):
  """`got` vs the reference `want` (and its float32 twin for low precision)."""
  got_leaves, got_tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert got_tree == want_tree, f"{what}: structure {got_tree} != {want_tree}"
  f32_leaves = jax.tree.leaves(want_f32) if want_f32 is not None else [None] * len(want_leaves)
  for i, (g, w, w32) in enumerate(zip(got_leaves, want_leaves, f32_leaves)):
    assert g.shape == w.shape and g.dtype == w.dtype, (
        f"{what} leaf {i}: {g.dtype}{g.shape} != {w.dtype}{w.shape}")
    g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if g.dtype == jnp.bfloat16 and w32 is not None:
      w32 = np.asarray(w32, np.float64)
      allowed = 2 * np.max(np.abs(w64 - w32)) + BF16_ULP * (1 + np.max(np.abs(w32)))
      err = np.max(np.abs(g64 - w32)) if g64.size else 0.0
      assert err <= allowed, f"{what} leaf {i}: |got - f32 ref| = {err} > {allowed}"
    else:
      np.testing.assert_allclose(g64, w64, rtol=F32_RTOL, atol=F32_ATOL,
                                 err_msg=f"{what} leaf {i}")


def reference_pair(step, params, h0, x, **kw):
  """(reference at the inputs' precision, reference in float32)."""
  low = reference.iterate(step, params, h0, x, **kw)
  f32 = reference.iterate(step, to_f32(params), to_f32(h0), to_f32(x), **kw)
  return low, f32
