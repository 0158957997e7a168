"""Per-(row, step) random numbers that work inside Pallas kernels and in XLA.

With `iterate(..., key=k)`, `step(params, h, x, key=...)` receives `key`: uint32
[R, 2], one Threefry key per row of the tile, derived by `step_keys` from
(`k`, the row's index in the caller's batch, the step index). The samplers
here turn such a per-row key into values of any shape with the row axis first:

    def step(params, h, x, key):
      h = jnp.tanh(h @ params["w"] + x)
      return pallas_loop.random.dropout(key, h, 0.1)

Construction. Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011; the Random123 library), the generator
behind `jax.random`'s default implementation. It is a keyed bijection of a
64-bit counter that passes BigCrush with margin at 20 rounds, and it is
counter-based: any element's bits are a pure function of (key, counter), with
no state to carry through a loop and no dependence on which other elements are
computed. That is what makes the same bits come out of a Triton kernel, a
Mosaic kernel, interpret mode, XLA and the reference, whatever the tiling. It
is written here with elementwise uint32 add, xor and shifts, `iota` and
`where` only, because inside kernels `jax.random` does not lower on Triton,
Triton has only power-of-2 shapes and no concatenate, and Mosaic has no
gathers; the result is bit-identical to `jax.random`'s `threefry_2x32`
(tested).

Keys and counters.

  * `key_data(k)`: the user's key as uint32 [2] (a key implementation with more
    than two words, e.g. "rbg", is folded to two by chaining Threefry over it).
  * `step_keys(data, rows, t)`: row r's key at step t is
    `threefry2x32(data, counter=(row_r, t_r))`, both words.
  * A sampler called with per-row key K gives element j of row r (j the flat
    index of the element within the row, row-major) the pair of words
    `threefry2x32(K[r], counter=(j, 0))`.
  * `fold_in(K, d)` is `threefry2x32(K[r], counter=(d, 1))`: the second counter
    word keeps it apart from every element counter, so draws made with K and
    with `fold_in(K, d)` are independent.

Floats from bits. `uniform` keeps the top m bits of word 0 (m = the dtype's
significand width: 24 for float32, 11 for float16, 8 for bfloat16) and
returns (bits >> (32 - m)) * `2**-m`: every value is exact in the dtype, so the
result is in [0, 1) even after the cast (rounding 32 random bits to bfloat16
could give 1.0). `bernoulli(p)` is `uniform_float32 < p`. `normal` is
Box-Muller on both words: u1 = (top 24 bits of word 0 + 1) * `2**-24` in (0, 1],
u2 = top 24 bits of word 1 * `2**-24`, z = sqrt(-2 log u1) * cos(2 pi u2),
computed in float32 (log, sqrt and cos lower on Triton and Mosaic, no erf_inv
needed); |z| <= 5.77 (the tail beyond has probability 8e-9). `dropout` keeps
an element with probability 1 - rate and scales it by 1 / (1 - rate),
computed in float32 and cast back.

Reusing a key gives the same bits: `uniform(k, s)` and `bernoulli(k, p, s)`
are correlated by design (as in `jax.random`). Use `fold_in(k, i)` for each
independent draw within one step.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import jax
from jax import lax
from jax.typing import ArrayLike, DTypeLike
import jax.numpy as jnp
import numpy as np

from pallas_loop._src import validation

__all__ = ["bernoulli", "dropout", "fold_in", "key_data", "normal", "step_keys",
           "threefry2x32", "uniform"]

# Threefry-2x32 rotation constants (Random123 `threefry.h`, R_32x2_*), applied
# as two alternating groups of four rounds, and the key-schedule parity.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA

# Float dtypes the samplers produce, with the bits kept for [0, 1) values
# (the significand width, implicit bit included: exact in the dtype).
_UNIT_BITS = {
    jnp.dtype(jnp.float32): 24,
    jnp.dtype(jnp.float16): 11,
    jnp.dtype(jnp.bfloat16): 8,
}


# ---------------------------------------------------------------------------
# Threefry-2x32, elementwise.


def _u32(v: ArrayLike) -> jax.Array:
  if isinstance(v, (int, np.integer)):
    return jnp.uint32(int(v))
  return jnp.asarray(v).astype(jnp.uint32)


def _rotate_left(x: jax.Array, r: int) -> jax.Array:
  return lax.shift_left(x, jnp.full_like(x, r)) | lax.shift_right_logical(
      x, jnp.full_like(x, 32 - r))


def threefry2x32(k0: ArrayLike, k1: ArrayLike, c0: ArrayLike,
                 c1: ArrayLike) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 (20 rounds): the keyed bijection of a 64-bit counter.

  Elementwise and broadcasting: every argument is a uint32 array (or Python
  int), and the outputs have their broadcast shape. Uses only uint32 add,
  xor and shifts, so it lowers inside Pallas kernels (Triton and Mosaic),
  in interpret mode and in XLA.

  Args:
    k0: the first key word.
    k1: the second key word.
    c0: the first counter word.
    c1: the second counter word.

  Returns:
    The two output words `(x0, x1)`, uint32, equal bit-for-bit to
    `jax.extend.random.threefry_2x32(jnp.stack([k0, k1]), jnp.stack([c0, c1]))`
    (whose counter array holds all first words, then all second words).

  Examples:
    >>> from pallas_loop.random import threefry2x32
    >>> # Random123's known-answer test
    >>> threefry2x32(0x13198A2E, 0x03707344, 0x243F6A88, 0x85A308D3)
    (Array(3297917596, dtype=uint32), Array(1212020640, dtype=uint32))
  """
  k0, k1, c0, c1 = (_u32(v) for v in (k0, k1, c0, c1))
  k2 = k0 ^ k1 ^ jnp.uint32(_PARITY)
  keys = (k0, k1, k2)
  x0 = c0 + k0
  x1 = c1 + k1
  # Five groups of four rounds; after group g (1-based) inject key words
  # (g % 3, (g + 1) % 3) and the group number, as in Random123.
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, r)
      x1 = x1 ^ x0
    g = group + 1
    x0 = x0 + keys[g % 3]
    x1 = x1 + keys[(g + 1) % 3] + jnp.uint32(g)
  return x0, x1


# ---------------------------------------------------------------------------
# [*, 2] columns without slicing or concatenate (neither lowers on Triton).


def _column(a: jax.Array, c: int) -> jax.Array:
  """a[..., c:c+1] for a [..., 2] uint32 array, via where + sum."""
  # The sum runs in int32 (same bits: one non-zero term): Mosaic has no
  # reductions over unsigned integers.
  iota = lax.broadcasted_iota(jnp.int32, a.shape, a.ndim - 1)
  a = lax.bitcast_convert_type(a, jnp.int32)
  picked = jnp.sum(jnp.where(iota == c, a, jnp.int32(0)), axis=-1, keepdims=True,
                   dtype=jnp.int32)
  return lax.bitcast_convert_type(picked, jnp.uint32)


def _pair(a: jax.Array, b: jax.Array) -> jax.Array:
  """[R, 1], [R, 1] -> [R, 2] (a in column 0, b in column 1), via where."""
  shape = (a.shape[0], 2)
  iota = lax.broadcasted_iota(jnp.int32, shape, 1)
  return jnp.where(iota == 0, jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape))


# ---------------------------------------------------------------------------
# Keys.


def _is_typed_key(key: Any) -> bool:
  dtype = getattr(key, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_data(key: jax.Array) -> jax.Array:
  """The user's PRNG key as two uint32 words, the input of `step_keys`.

  Args:
    key: one JAX PRNG key: a typed key (`jax.random.key(seed)`, any
      implementation; one with more than two words of key data, such as
      "rbg", is folded to two words by chaining Threefry over its words),
      or a legacy raw key (`jax.random.PRNGKey(seed)`: uint32 [2]).

  Returns:
    uint32 [2]. A pure function of the key; traceable (works under jit).

  Raises:
    TypeError: `key` is not a key (e.g. an int seed, or an array of another
      dtype).
    ValueError: `key` is a batch of keys, or a raw uint32 array of a shape
      other than (2,).

  Examples:
    >>> import jax, pallas_loop
    >>> pallas_loop.random.key_data(jax.random.key(0))
    Array([0, 0], dtype=uint32)
  """
  if _is_typed_key(key):
    if key.shape != ():
      raise ValueError(
          f"key must be a single PRNG key, got a batch of keys with {key.shape=}: "
          "pass one key (e.g. jax.random.key(0)); per-row, per-step keys are "
          "derived from it (pallas_loop.random.step_keys). To give each example "
          "its own key under jax.vmap, map over the batch of keys (in_axes=0): "
          "inside, iterate sees one key per example.")
    words = jnp.ravel(jax.random.key_data(key)).astype(jnp.uint32)
  else:
    if isinstance(key, (bool, int, float, np.number)) or not hasattr(key, "dtype"):
      raise TypeError(
          f"key must be a JAX PRNG key, got {key!r} of type {type(key).__name__}: "
          "pass jax.random.key(seed) (or a legacy jax.random.PRNGKey(seed)).")
    if jnp.dtype(key.dtype) != jnp.uint32:
      raise TypeError(
          f"key must be a JAX PRNG key; got an array with {key.dtype=} and "
          f"{key.shape=}: pass jax.random.key(seed), or a legacy "
          "jax.random.PRNGKey(seed) (uint32 [2]).")
    if tuple(key.shape) != (2,):
      raise ValueError(
          f"a raw (legacy) key must be uint32 with shape (2,), got {key.shape=}: "
          "pass a single key, e.g. jax.random.PRNGKey(0) or jax.random.key(0); "
          "for a batch of keys, pass one key instead (per-row keys are derived "
          "from it).")
    words = jnp.asarray(key)
  n = words.shape[0]
  if n == 0:
    raise ValueError(f"key has no key data ({words.shape=}); use jax.random.key(seed).")
  if n == 1:
    return jnp.stack([words[0], jnp.uint32(0)])
  if n % 2:
    words = jnp.concatenate([words, jnp.zeros((1,), jnp.uint32)])
  # Fold [w0, w1, w2, w3, ...] to two words: h <- threefry(h, counter=(w2i, w2i+1)).
  h0, h1 = words[0], words[1]
  for i in range(2, words.shape[0], 2):
    h0, h1 = threefry2x32(h0, h1, words[i], words[i + 1])
  return jnp.stack([h0, h1])


def _check_column(name: str, a: ArrayLike, rows: int | None) -> jax.Array:
  shape = tuple(np.shape(a))
  if len(shape) != 2 or shape[1] != 1 or (rows is not None and shape[0] != rows):
    want = f"({rows}, 1)" if rows is not None else "(R, 1)"
    raise ValueError(f"{name} must have shape {want} (one value per row), got {shape}.")
  dtype = jnp.result_type(a)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be int32 (one index per row), got {dtype=}.")
  return jnp.asarray(a).astype(jnp.uint32)


def step_keys(data: jax.Array, rows: jax.Array, t: jax.Array) -> jax.Array:
  """Per-row keys for one step: row r gets `threefry2x32(data, (rows[r], t[r]))`.

  The key `iterate(..., key=k)` hands to `step` at step `t` (0-based) for the
  row with index `i` in the caller's batch is
  `step_keys(key_data(k), i, t)`: a pure function of (k, i, t), so it does
  not depend on the implementation, tiling, row order or padding. Lowers
  inside Pallas kernels (Triton and Mosaic).

  Args:
    data: uint32 [2] (from `key_data`), or [1, 2] (as loaded in a kernel).
    rows: int32 [R, 1]: each row's index in the caller's batch (>= 0).
    t: int32 [R, 1]: each row's step index (>= 0).

  Returns:
    uint32 [R, 2]: one key per row, the `key` argument of the samplers.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> data = pallas_loop.random.key_data(jax.random.key(0))
    >>> rows = jnp.arange(4, dtype=jnp.int32)[:, None]     # rows 0..3
    >>> t = jnp.zeros((4, 1), jnp.int32)                    # their step 0
    >>> keys = pallas_loop.random.step_keys(data, rows, t)
    >>> keys.shape, keys.dtype
    ((4, 2), dtype('uint32'))
  """
  data_shape = tuple(np.shape(data))
  if data_shape not in ((2,), (1, 2)):
    raise ValueError(
        f"data must have shape (2,) or (1, 2) (from pallas_loop.random.key_data), "
        f"got {data_shape}.")
  if jnp.result_type(data) != jnp.uint32:
    raise TypeError(f"data must be uint32 (from pallas_loop.random.key_data), got "
                    f"dtype={jnp.result_type(data)}.")
  data = jnp.reshape(data, (1, 2)) if data_shape == (2,) else data
  c0 = _check_column("rows", rows, None)
  c1 = _check_column("t", t, c0.shape[0])
  x0, x1 = threefry2x32(_column(data, 0), _column(data, 1), c0, c1)
  return _pair(x0, x1)


def _one_row(key: jax.Array) -> bool:
  """A single row's key (uint32 [2]): what a per-example step receives
  (`iterate(..., per_example=True)`); its draws have no row axis."""
  return tuple(np.shape(key)) == (2,)


def _check_key(key: jax.Array, shape: Sequence[int]) -> tuple[int, ...]:
  """Validates a per-row key against `shape`; returns shape as a tuple."""
  key_shape = tuple(np.shape(key))
  if len(key_shape) != 2 or key_shape[1] != 2:
    raise ValueError(
        f"key must be a per-row key of shape (R, 2) (the key `step` receives "
        f"with iterate(..., key=...)), got {key_shape}.")
  if jnp.result_type(key) != jnp.uint32:
    raise TypeError(f"key must be uint32 (R, 2) (the key `step` receives), got "
                    f"dtype={jnp.result_type(key)}; a jax.random key goes to "
                    "iterate(..., key=...), not to the samplers.")
  try:
    shape = tuple(operator.index(d) for d in shape)
  except TypeError:
    raise TypeError(f"shape must be a tuple of ints, got {shape!r}.") from None
  if not shape or shape[0] != key_shape[0]:
    raise ValueError(
        f"shape must start with the row axis: {shape=} but key has "
        f"{key_shape[0]} rows (key.shape={key_shape}); pass e.g. h.shape.")
  if any(d < 0 for d in shape):
    raise ValueError(f"{shape=} has a negative dimension.")
  if int(np.prod(shape[1:])) > 2**32:
    raise ValueError(f"{shape=}: at most 2**32 elements per row.")
  return shape


def fold_in(key: jax.Array, data: ArrayLike) -> jax.Array:
  """A new per-row key from `key` and an integer, for another independent draw.

  Draws with `key` and with `fold_in(key, d)` (and with different `d`) are
  independent, e.g. two dropout masks in one step:
  `dropout(fold_in(key, 0), a, r)`, `dropout(fold_in(key, 1), b, r)`.

  Args:
    key: uint32 [R, 2] per-row key (or uint32 [2]: one row's, in a per-example step).
    data: a Python int in [0, 2**32), or an int32/uint32 array of shape () or
      [R, 1].

  Returns:
    uint32 [R, 2]: row r is `threefry2x32(key[r], counter=(data, 1))`.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> key = jnp.zeros((8, 2), jnp.uint32)  # a keyed step's per-row keys
    >>> pallas_loop.random.fold_in(key, 1).shape
    (8, 2)
  """
  if _one_row(key):  # a per-example step's key
    return fold_in(key[None], data)[0]
  _check_key(key, (np.shape(key)[0] if np.ndim(key) else 0,))
  if isinstance(data, (bool, float)) or not (
      isinstance(data, (int, np.integer)) or jnp.issubdtype(jnp.result_type(data), jnp.integer)):
    raise TypeError(f"data must be an int or an integer array, got {data!r}.")
  if isinstance(data, (int, np.integer)):
    if not 0 <= int(data) < 2**32:
      raise ValueError(f"{data=} must be in [0, 2**32).")
    d = jnp.uint32(int(data))
  else:
    if tuple(np.shape(data)) not in ((), (np.shape(key)[0], 1)):
      raise ValueError(f"data must have shape () or ({np.shape(key)[0]}, 1), got "
                       f"{np.shape(data)}.")
    d = jnp.asarray(data).astype(jnp.uint32)
  x0, x1 = threefry2x32(_column(key, 0), _column(key, 1), d, 1)
  return _pair(x0, x1)


# ---------------------------------------------------------------------------
# Samplers.


def _bits(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """Both Threefry words for every element of `shape`: counter (j, 0)."""
  rows = shape[0]
  # [R, 1] key columns, reshaped to broadcast against `shape`.
  k0 = jnp.reshape(_column(key, 0), (rows,) + (1,) * (len(shape) - 1))
  k1 = jnp.reshape(_column(key, 1), (rows,) + (1,) * (len(shape) - 1))
  # j: flat row-major index of the element within its row.
  j = jnp.zeros(shape, jnp.int32)
  stride = 1
  for axis in range(len(shape) - 1, 0, -1):
    j = j + lax.broadcasted_iota(jnp.int32, shape, axis) * stride
    stride *= shape[axis]
  return threefry2x32(k0, k1, j.astype(jnp.uint32), 0)


def _unit_float32(bits: jax.Array, m: int) -> jax.Array:
  """k * `2**-m` in float32 from the top m bits (k < 2**m <= 2**24: exact)."""
  top = lax.shift_right_logical(bits, jnp.full_like(bits, 32 - m))
  return lax.bitcast_convert_type(top, jnp.int32).astype(jnp.float32) * np.float32(2.0**-m)


def _check_float_dtype(dtype: DTypeLike) -> jnp.dtype:
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be a float dtype, got {dtype!r}.") from None
  if dt not in _UNIT_BITS:
    raise TypeError(f"{dtype=} is not supported: use float32, bfloat16 or float16.")
  return dt


def uniform(key: jax.Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> jax.Array:
  """Uniform floats in [0, 1), one per element, per-row keys.

  Args:
    key: uint32 [R, 2], the per-row key `step` receives (or uint32 [2], one row's
      key in a per-example step: then `shape` has no row axis).
    shape: the output shape, row axis first (shape[0] == R), e.g. h.shape.
    dtype: float32 (24 random bits), bfloat16 (8) or float16 (11).

  Returns:
    `dtype` array of `shape`, values k * `2**-m` for uniform k in [0, 2**m).

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> key = jnp.zeros((8, 2), jnp.uint32)  # a keyed step's per-row keys
    >>> h = jnp.ones((8, 4))
    >>> noise = pallas_loop.random.uniform(key, h.shape)
    >>> noise.shape, bool(((noise >= 0) & (noise < 1)).all())
    ((8, 4), True)
  """
  if _one_row(key):
    return uniform(key[None], (1, *shape), dtype)[0]
  shape = _check_key(key, shape)
  dt = _check_float_dtype(dtype)
  word0, _ = _bits(key, shape)
  return _unit_float32(word0, _UNIT_BITS[dt]).astype(dt)


def bernoulli(key: jax.Array, p: ArrayLike, shape: Sequence[int]) -> jax.Array:
  """Booleans that are True with probability p, per-row keys.

  Args:
    key: uint32 [R, 2], the per-row key `step` receives (or uint32 [2], one row's
      key in a per-example step: then `shape` has no row axis).
    p: probability in [0, 1]: a Python float or a float array broadcastable
      to `shape` (e.g. [R, 1] for a per-row rate). Checked when concrete; a
      traced p outside [0, 1] acts as clipped (p < 0: never, p >= 1: always).
    shape: the output shape, row axis first (shape[0] == R).

  Returns:
    bool array of `shape`: `uniform(key, shape) < p` (float32 uniform, so
    the probability is p rounded up to a multiple of `2**-24`).

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> key = jnp.zeros((8, 2), jnp.uint32)  # a keyed step's per-row keys
    >>> h = jnp.ones((8, 4))
    >>> keep = pallas_loop.random.bernoulli(key, 0.9, h.shape)
    >>> keep.shape, keep.dtype
    ((8, 4), dtype('bool'))
  """
  if _one_row(key):
    return bernoulli(key[None], p, (1, *shape))[0]
  shape = _check_key(key, shape)
  concrete = validation.concrete(p)
  if concrete is not None:
    if not jnp.issubdtype(concrete.dtype, jnp.number) or jnp.issubdtype(
        concrete.dtype, jnp.complexfloating):
      raise TypeError(f"p must be a real probability, got {p!r}.")
    if not np.all((concrete >= 0) & (concrete <= 1)):
      raise ValueError(f"p must be in [0, 1], got {p!r}.")
  p = jnp.asarray(p)
  try:
    jnp.broadcast_shapes(p.shape, shape)
  except ValueError:
    raise ValueError(f"p with {p.shape=} does not broadcast to {shape=}.") from None
  word0, _ = _bits(key, shape)
  return _unit_float32(word0, 24) < p.astype(jnp.float32)


def normal(key: jax.Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> jax.Array:
  """Standard normal floats (Box-Muller in float32), per-row keys.

  Args:
    key: uint32 [R, 2], the per-row key `step` receives (or uint32 [2], one row's
      key in a per-example step: then `shape` has no row axis).
    shape: the output shape, row axis first (shape[0] == R).
    dtype: float32, bfloat16 or float16 (computed in float32, then cast).

  Returns:
    `dtype` array of `shape`; |values| <= 5.77 (24-bit uniforms).

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> key = jnp.zeros((8, 2), jnp.uint32)  # a keyed step's per-row keys
    >>> h = jnp.ones((8, 4))
    >>> h = h + 0.01 * pallas_loop.random.normal(key, h.shape, h.dtype)
    >>> h.shape
    (8, 4)
  """
  if _one_row(key):
    return normal(key[None], (1, *shape), dtype)[0]
  shape = _check_key(key, shape)
  dt = _check_float_dtype(dtype)
  word0, word1 = _bits(key, shape)
  u1 = _unit_float32(word0, 24) + np.float32(2.0**-24)  # (0, 1]: log is finite
  u2 = _unit_float32(word1, 24)
  radius = jnp.sqrt(np.float32(-2.0) * jnp.log(u1))
  return (radius * jnp.cos(np.float32(2 * np.pi) * u2)).astype(dt)


def dropout(key: jax.Array, x: jax.Array, rate: float) -> jax.Array:
  """Inverted dropout: zero each element with probability `rate`, scale the rest.

  Args:
    key: uint32 [R, 2], the per-row key `step` receives (or uint32 [2], one row's
      key in a per-example step: then `x` has no row axis).
    x: float array [R, ...].
    rate: the drop probability, a concrete number in [0, 1) (a Python float,
      or a NumPy/JAX scalar known at trace time). A traced rate is rejected:
      its range could not be checked, and 1 / (1 - rate) would silently blow
      up; for a rate that varies under jit, write
      `jnp.where(bernoulli(key, 1 - rate, x.shape), x / (1 - rate), 0)`.

  Returns:
    Array like `x`: `x / (1 - rate)` where kept (probability 1 - rate), else 0
    (the product computed in float32, then cast to x.dtype). rate == 0
    returns `x` itself.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> key = jnp.zeros((8, 2), jnp.uint32)  # a keyed step's per-row keys
    >>> h, w = jnp.ones((8, 4)), jnp.eye(4)
    >>> h = pallas_loop.random.dropout(key, jnp.tanh(h @ w), 0.1)
    >>> h.shape
    (8, 4)
  """
  if _one_row(key):
    return dropout(key[None], jnp.asarray(x)[None], rate)[0]
  x_dtype = jnp.result_type(x)
  if not jnp.issubdtype(x_dtype, jnp.floating):
    raise TypeError(f"dropout needs a float x, got {x_dtype=}.")
  concrete = validation.concrete(rate)
  if concrete is None:
    raise TypeError(
        "dropout's rate must be known at trace time (a Python float), got a traced "
        "value; for a traced rate write jnp.where(pallas_loop.random.bernoulli("
        "key, 1 - rate, x.shape), x / (1 - rate), 0).")
  if concrete.shape != () or not jnp.issubdtype(concrete.dtype, jnp.number) or \
      jnp.issubdtype(concrete.dtype, jnp.complexfloating):
    raise TypeError(f"dropout's rate must be a real scalar, got {rate!r}.")
  r = float(concrete)
  if not 0.0 <= r < 1.0:
    raise ValueError(f"dropout's rate must be in [0, 1) (the drop probability), got {rate=}.")
  shape = _check_key(key, np.shape(x))
  if r == 0.0:
    return x
  keep = bernoulli(key, 1.0 - r, shape)
  scaled = (jnp.asarray(x).astype(jnp.float32) * np.float32(1.0 / (1.0 - r))).astype(x_dtype)
  return jnp.where(keep, scaled, jnp.zeros((), x_dtype))
