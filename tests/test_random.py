"""`pallas_loop.random`: Threefry bits, keys, samplers, statistics, lowering.

Statistical checks draw from fixed keys (deterministic, no flakes) and use
critical values at p ~ 1e-4 or tighter, so a broken generator (a constant, a
stuck bit, correlated neighbours) fails while a good one passes with margin.
"""

from __future__ import annotations

import functools
import warnings

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import pallas_loop
from pallas_loop import random as prand
from pallas_loop import _reference as reference
from tests import lowering

R, D, T = 64, 128, 32  # rows, columns, steps of the statistical draws


def _rows(n: int) -> jax.Array:
  return jnp.arange(n, dtype=jnp.int32)[:, None]


def _keys(key, rows, t: int) -> jax.Array:
  return prand.step_keys(prand.key_data(key), rows, jnp.full(rows.shape, t, jnp.int32))


@functools.partial(jax.jit, static_argnames=("sampler", "rows", "cols", "steps"))
def _draws(key, sampler, rows=R, cols=D, steps=T):
  """[steps, rows, cols]: sampler(step key of (row, t), (rows, cols)) for every t."""
  data = prand.key_data(key)

  def one(t):
    k = prand.step_keys(data, _rows(rows), jnp.full((rows, 1), t, jnp.int32))
    return sampler(k, (rows, cols))

  return jax.vmap(one)(jnp.arange(steps, dtype=jnp.int32))


def _uniform(k, shape):
  return prand.uniform(k, shape)


def _normal(k, shape):
  return prand.normal(k, shape)


# ---------------------------------------------------------------------------
# Threefry itself.


@pytest.mark.parametrize("key, counter, expected", [
    # Random123 known-answer vectors for threefry2x32_20 (kat_vectors).
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
])
def test_threefry_known_answers(key, counter, expected):
  out = prand.threefry2x32(*key, *counter)
  assert tuple(int(v) for v in out) == expected


def test_threefry_matches_jax_bit_for_bit():
  from jax.extend import random as jex_random
  rng = np.random.default_rng(0)
  for _ in range(4):
    key = rng.integers(0, 2**32, size=2, dtype=np.uint32)
    counter = rng.integers(0, 2**32, size=(2, 256), dtype=np.uint32)
    x0, x1 = prand.threefry2x32(key[0], key[1], counter[0], counter[1])
    # jax's counter array holds all first words, then all second words.
    want = jex_random.threefry_2x32(jnp.asarray(key), jnp.asarray(counter.reshape(-1)))
    np.testing.assert_array_equal(np.concatenate([x0, x1]), want)


def test_threefry_broadcasts_and_is_uint32():
  x0, x1 = prand.threefry2x32(jnp.uint32(1), 2, jnp.arange(6, dtype=jnp.uint32).reshape(2, 3), 0)
  assert x0.shape == x1.shape == (2, 3) and x0.dtype == x1.dtype == jnp.uint32


# ---------------------------------------------------------------------------
# key_data.


def test_key_data_new_and_legacy_keys_agree():
  for seed in (0, 7, 2**31 + 5):
    typed = prand.key_data(jax.random.key(seed))
    legacy = prand.key_data(jax.random.PRNGKey(seed))
    assert typed.shape == (2,) and typed.dtype == jnp.uint32
    np.testing.assert_array_equal(typed, legacy)
    np.testing.assert_array_equal(typed, jax.random.key_data(jax.random.key(seed)))


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_key_data_folds_wide_keys_to_two_words(impl):
  words = [prand.key_data(jax.random.key(s, impl=impl)) for s in range(8)]
  assert all(w.shape == (2,) and w.dtype == jnp.uint32 for w in words)
  assert len({tuple(int(v) for v in w) for w in words}) == 8  # distinct seeds, distinct keys
  # Deterministic, and the same under jit.
  k = jax.random.key(3, impl=impl)
  np.testing.assert_array_equal(prand.key_data(k), jax.jit(prand.key_data)(k))


def test_key_data_under_jit_and_split_keys():
  k1, k2 = jax.random.split(jax.random.key(0))
  a, b = jax.jit(prand.key_data)(k1), jax.jit(prand.key_data)(k2)
  assert not np.array_equal(a, b)
  np.testing.assert_array_equal(a, prand.key_data(k1))


@pytest.mark.parametrize("bad, error, match", [
    (0, TypeError, r"jax.random.key\(seed\)"),
    (3.5, TypeError, r"jax.random.key\(seed\)"),
    ("key", TypeError, r"jax.random.key\(seed\)"),
    (np.array([0, 1], np.int32), TypeError, r"key.dtype=dtype\('int32'\).*PRNGKey"),
    (jnp.zeros((2,), jnp.float32), TypeError, r"key.dtype=dtype\('float32'\)"),
    (jnp.zeros((4,), jnp.uint32), ValueError, r"shape \(2,\).*key.shape=\(4,\)"),
    (jnp.zeros((3, 2), jnp.uint32), ValueError, r"key.shape=\(3, 2\).*single key"),
])
def test_key_data_errors(bad, error, match):
  with pytest.raises(error, match=match):
    prand.key_data(bad)


def test_key_data_rejects_batched_typed_keys():
  with pytest.raises(ValueError, match=r"batch of keys with key.shape=\(4,\).*pass one key"):
    prand.key_data(jax.random.split(jax.random.key(0), 4))


# ---------------------------------------------------------------------------
# step_keys: a pure function of (key, row, t).


def test_step_keys_shape_and_data_layouts():
  data = prand.key_data(jax.random.key(5))
  rows, t = _rows(8), jnp.arange(8, dtype=jnp.int32)[:, None] % 3
  a = prand.step_keys(data, rows, t)
  assert a.shape == (8, 2) and a.dtype == jnp.uint32
  np.testing.assert_array_equal(a, prand.step_keys(data.reshape(1, 2), rows, t))
  # Row r's key is threefry(data, counter=(row, t)).
  x0, x1 = prand.threefry2x32(data[0], data[1], jnp.arange(8, dtype=jnp.uint32),
                              (jnp.arange(8) % 3).astype(jnp.uint32))
  np.testing.assert_array_equal(a, np.stack([x0, x1], axis=1))


def test_step_keys_do_not_depend_on_which_rows_are_present():
  data = prand.key_data(jax.random.key(1))
  rows = jnp.arange(32, dtype=jnp.int32)[:, None]
  t = (rows * 7) % 5
  full = prand.step_keys(data, rows, t)
  perm = np.random.default_rng(0).permutation(32)[:12]
  sub = prand.step_keys(data, rows[perm], t[perm])
  np.testing.assert_array_equal(sub, full[perm])
  # One row alone, as a tile of 1.
  np.testing.assert_array_equal(prand.step_keys(data, rows[5:6], t[5:6]), full[5:6])


def test_step_keys_are_distinct_over_rows_and_steps():
  data = prand.key_data(jax.random.key(0))
  rows = jnp.repeat(jnp.arange(64, dtype=jnp.int32), 64)[:, None]
  t = jnp.tile(jnp.arange(64, dtype=jnp.int32), 64)[:, None]
  k = np.asarray(prand.step_keys(data, rows, t)).astype(np.uint64)
  assert len(np.unique(k[:, 0] << np.uint64(32) | k[:, 1])) == 64 * 64


@pytest.mark.parametrize("data, rows, t, error, match", [
    (np.zeros((3,), np.uint32), _rows(4), _rows(4), ValueError, r"data must have shape \(2,\)"),
    (np.zeros((2,), np.int32), _rows(4), _rows(4), TypeError, r"data must be uint32"),
    (np.zeros((2,), np.uint32), jnp.arange(4, dtype=jnp.int32), _rows(4), ValueError,
     r"rows must have shape \(R, 1\).*got \(4,\)"),
    (np.zeros((2,), np.uint32), _rows(4), _rows(3), ValueError, r"t must have shape \(4, 1\).*got \(3, 1\)"),
    (np.zeros((2,), np.uint32), _rows(4).astype(jnp.float32), _rows(4), TypeError, r"rows must be int32"),
])
def test_step_keys_errors(data, rows, t, error, match):
  with pytest.raises(error, match=match):
    prand.step_keys(jnp.asarray(data), rows, t)


# ---------------------------------------------------------------------------
# Samplers: determinism, layout.


@pytest.mark.parametrize("sampler", [
    lambda k, s: prand.uniform(k, s),
    lambda k, s: prand.normal(k, s, jnp.bfloat16),
    lambda k, s: prand.bernoulli(k, 0.3, s),
    lambda k, s: prand.dropout(k, jnp.ones(s), 0.5),
])
def test_samplers_depend_only_on_key_row_and_element(sampler):
  key = jax.random.key(2)
  rows = _rows(16)
  full = sampler(_keys(key, rows, 3), (16, 4, 8))
  perm = np.array([9, 2, 15])
  sub = sampler(_keys(key, rows[perm], 3), (3, 4, 8))
  np.testing.assert_array_equal(sub, full[perm])
  # Element j of a row is counter j, whatever the trailing shape.
  flat = sampler(_keys(key, rows, 3), (16, 32))
  np.testing.assert_array_equal(full.reshape(16, 32), flat)
  # One element per row: counter 0.
  np.testing.assert_array_equal(sampler(_keys(key, rows, 3), (16,)), flat[:, 0])


def test_same_key_same_bits_different_key_different_stream():
  a = _draws(jax.random.key(0), _uniform, steps=4)
  np.testing.assert_array_equal(a, _draws(jax.random.key(0), _uniform, steps=4))
  b = _draws(jax.random.key(1), _uniform, steps=4)
  assert np.mean(np.asarray(a) == np.asarray(b)) < 1e-3
  assert abs(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1]) < 5 / np.sqrt(a.size)


def test_fold_in_gives_independent_streams():
  k = _keys(jax.random.key(0), _rows(R), 0)
  shape = (R, 4 * D)
  base = prand.uniform(k, shape)
  folded = [prand.uniform(prand.fold_in(k, d), shape) for d in (0, 1)]
  folded.append(prand.uniform(prand.fold_in(k, jnp.full((R, 1), 1, jnp.int32)), shape))
  np.testing.assert_array_equal(folded[1], folded[2])  # int and array data agree
  for x, y in ((base, folded[0]), (base, folded[1]), (folded[0], folded[1])):
    assert abs(np.corrcoef(np.ravel(x), np.ravel(y))[0, 1]) < 5 / np.sqrt(x.size)
  with pytest.raises(ValueError, match=r"data=-1 must be in \[0, 2\*\*32\)"):
    prand.fold_in(k, -1)
  with pytest.raises(TypeError, match="data must be an int"):
    prand.fold_in(k, 1.5)
  with pytest.raises(ValueError, match=r"data must have shape \(\) or \(64, 1\)"):
    prand.fold_in(k, jnp.zeros((R,), jnp.int32))


# ---------------------------------------------------------------------------
# Statistics.


def test_uniform_histogram_chi_square():
  u = np.ravel(_draws(jax.random.key(0), _uniform))  # 2**18 draws
  assert u.min() >= 0.0 and u.max() < 1.0
  bins = 128
  counts = np.bincount((u * bins).astype(int), minlength=bins)
  chi2 = np.sum((counts - u.size / bins) ** 2 / (u.size / bins))
  assert chi2 < stats.chi2.ppf(1 - 1e-4, bins - 1), chi2
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
  assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / u.size)  # var of (u - 1/2)**2 is 1/180


def test_uniform_bits_are_balanced():
  """Each of the 32 bits of the per-row keys and of element words is set half the time."""
  k = np.asarray(_keys(jax.random.key(0), _rows(4096), 0))
  x0, x1 = prand.threefry2x32(k[:, :1], k[:, 1:], jnp.arange(64, dtype=jnp.uint32)[None], 0)
  for words in (k.reshape(-1), np.ravel(x0), np.ravel(x1)):
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    frac = bits.mean(axis=0)
    assert np.all(np.abs(frac - 0.5) < 5 * 0.5 / np.sqrt(words.size)), frac


@pytest.mark.parametrize("dtype, m", [(jnp.float32, 24), (jnp.bfloat16, 8), (jnp.float16, 11)])
def test_uniform_dtypes_are_in_unit_interval(dtype, m):
  u = _draws(jax.random.key(4), lambda k, s: prand.uniform(k, s, dtype), steps=8)
  assert u.dtype == dtype
  v = np.asarray(u, np.float64)
  assert v.min() >= 0.0 and v.max() < 1.0
  # Values are k * 2**-m (exact in the dtype) and all m-bit values appear in bf16.
  np.testing.assert_array_equal(v * 2**m, np.floor(v * 2**m))
  if m == 8:
    assert len(np.unique(v)) == 256
  np.testing.assert_array_equal(  # the float32 draw truncated to m bits
      v, np.floor(np.asarray(_draws(jax.random.key(4), _uniform, steps=8), np.float64) * 2**m) / 2**m)


def test_bernoulli_counts_over_steps():
  p = 0.3
  b = np.asarray(_draws(jax.random.key(3), lambda k, s: prand.bernoulli(k, p, s)))
  assert b.dtype == bool
  counts = b.sum(axis=0)  # [R, D]: Binomial(T, p) per element
  n = counts.size
  mean, var = T * p, T * p * (1 - p)
  assert abs(counts.mean() - mean) < 5 * np.sqrt(var / n)
  # Variance of a sample variance of a binomial: (mu4 - var**2) / n.
  mu4 = var * (1 + 3 * (T - 2) * p * (1 - p))
  assert abs(counts.var() - var) < 5 * np.sqrt((mu4 - var**2) / n), counts.var()


def test_bernoulli_edges_and_per_row_probability():
  k = _keys(jax.random.key(0), _rows(8), 0)
  assert not np.any(prand.bernoulli(k, 0.0, (8, 512)))
  assert np.all(prand.bernoulli(k, 1.0, (8, 512)))
  p = jnp.linspace(0, 1, 8, dtype=jnp.float32)[:, None]
  frac = np.asarray(prand.bernoulli(k, p, (8, 4096))).mean(axis=1)
  np.testing.assert_allclose(frac, np.asarray(p[:, 0]), atol=5 * 0.5 / np.sqrt(4096))
  assert prand.bernoulli(k, jnp.bfloat16(0.5), (8, 4)).dtype == bool


def test_normal_moments_and_ks():
  z = np.ravel(_draws(jax.random.key(0), _normal)).astype(np.float64)
  n = z.size
  assert abs(z.mean()) < 5 / np.sqrt(n)
  assert abs(z.var() - 1) < 5 * np.sqrt(2 / n)
  assert abs(stats.skew(z)) < 5 * np.sqrt(6 / n)
  assert abs(stats.kurtosis(z)) < 5 * np.sqrt(24 / n)
  assert stats.kstest(z, "norm").pvalue > 1e-4
  assert np.max(np.abs(z)) <= 5.8


def test_normal_bfloat16():
  z = _draws(jax.random.key(1), lambda k, s: prand.normal(k, s, jnp.bfloat16), steps=4)
  assert z.dtype == jnp.bfloat16
  ref = _draws(jax.random.key(1), _normal, steps=4).astype(jnp.bfloat16)
  np.testing.assert_array_equal(z, ref)  # float32 Box-Muller, then one rounding


@pytest.mark.parametrize("name, pick", [
    ("rows", lambda u: (u[:, :-1, :], u[:, 1:, :])),
    ("columns", lambda u: (u[:, :, :-1], u[:, :, 1:])),
    ("steps", lambda u: (u[:-1], u[1:])),
])
@pytest.mark.parametrize("sampler", [_uniform, _normal])
def test_no_correlation_between_neighbours(name, pick, sampler):
  u = np.asarray(_draws(jax.random.key(0), sampler), np.float64)
  a, b = pick(u)
  r = np.corrcoef(np.ravel(a), np.ravel(b))[0, 1]
  assert abs(r) < 5 / np.sqrt(a.size), (name, r)
  # Also per position: the 2x2 table of (a < 1/2, b < 1/2) is independent.
  if sampler is _uniform:
    both = np.mean((a < 0.5) & (b < 0.5))
    assert abs(both - 0.25) < 5 * np.sqrt(0.25 * 0.75 / a.size), (name, both)


def test_dropout_statistics_and_scaling():
  rate = 0.25
  x = jnp.linspace(1, 2, R * D, dtype=jnp.float32).reshape(R, D)
  out = np.asarray(jnp.stack([prand.dropout(_keys(jax.random.key(0), _rows(R), t), x, rate)
                              for t in range(8)]))
  dropped = out == 0
  n = dropped.size
  assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
  kept = np.broadcast_to(np.asarray(x) * np.float32(1 / (1 - rate)), out.shape)
  np.testing.assert_array_equal(out[~dropped], kept[~dropped])
  assert abs(out.mean() / np.asarray(x).mean() - 1) < 0.01  # inverted scaling keeps the mean


def test_dropout_bfloat16_and_rate_zero():
  k = _keys(jax.random.key(0), _rows(8), 0)
  x = jnp.full((8, 64), 1.5, jnp.bfloat16)
  out = prand.dropout(k, x, 0.1)
  assert out.dtype == jnp.bfloat16
  kept = np.unique(np.asarray(out, np.float32))
  np.testing.assert_array_equal(kept, [0.0, float(jnp.bfloat16(1.5 / 0.9))])  # scaled in f32, rounded once
  assert prand.dropout(k, x, 0.0) is x
  assert prand.dropout(k, x, np.float32(0.0)) is x


@pytest.mark.parametrize("rate, error, match", [
    (1.0, ValueError, r"\[0, 1\)"),
    (-0.1, ValueError, r"\[0, 1\)"),
    (float("nan"), ValueError, r"\[0, 1\)"),
    (np.array([0.1, 0.2]), TypeError, "real scalar"),
    (0.5 + 1j, TypeError, "real scalar"),
])
def test_dropout_rate_errors(rate, error, match):
  k = _keys(jax.random.key(0), _rows(4), 0)
  with pytest.raises(error, match=match):
    prand.dropout(k, jnp.ones((4, 8)), rate)


def test_dropout_rejects_traced_rate_and_int_x():
  k = _keys(jax.random.key(0), _rows(4), 0)
  with pytest.raises(TypeError, match="known at trace time.*bernoulli"):
    jax.jit(lambda r: prand.dropout(k, jnp.ones((4, 8)), r))(0.1)
  with pytest.raises(TypeError, match="float x"):
    prand.dropout(k, jnp.ones((4, 8), jnp.int32), 0.1)


@pytest.mark.parametrize("fn", [
    lambda k, s: prand.uniform(k, s),
    lambda k, s: prand.normal(k, s),
    lambda k, s: prand.bernoulli(k, 0.5, s),
    lambda k, s: prand.dropout(k, jnp.ones(s), 0.5),
])
def test_sampler_key_and_shape_errors(fn):
  k = _keys(jax.random.key(0), _rows(4), 0)
  with pytest.raises(ValueError, match=r"shape must start with the row axis.*4 rows"):
    fn(k, (8, 16))
  with pytest.raises(ValueError, match=r"per-row key of shape \(R, 2\).*got \(4,\)"):
    fn(k[:, 0], (4, 16))
  with pytest.raises(ValueError, match=r"per-row key of shape \(R, 2\).*got \(4, 3\)"):
    fn(jnp.zeros((4, 3), jnp.uint32), (4, 16))
  with pytest.raises(TypeError, match=r"key must be uint32.*iterate\(..., key=...\)"):
    fn(k.astype(jnp.int32), (4, 16))


def test_sampler_argument_errors():
  k = _keys(jax.random.key(0), _rows(4), 0)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    prand.uniform(k, (4, 8), jnp.int32)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    prand.normal(k, (4, 8), jnp.float64)
  with pytest.raises(TypeError, match="tuple of ints"):
    prand.uniform(k, (4, 8.5))
  with pytest.raises(ValueError, match="shape must start with the row axis"):
    prand.uniform(k, ())
  with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
    prand.bernoulli(k, 1.5, (4, 8))
  with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
    prand.bernoulli(k, jnp.array([[0.5], [-1.0], [0.1], [0.2]]), (4, 8))
  with pytest.raises(TypeError, match="real probability"):
    prand.bernoulli(k, "half", (4, 8))
  with pytest.raises(ValueError, match=r"does not broadcast to shape=\(4, 8\)"):
    prand.bernoulli(k, jnp.full((3,), 0.5), (4, 8))


def test_public_submodule():
  assert pallas_loop.random is prand


# ---------------------------------------------------------------------------
# Inside a Pallas kernel: interpret mode == XLA bit for bit; lowers for cuda/tpu.

_TB, _B, _D = 16, 32, 128
_KERNEL_NAME = "pallas_loop_random_test"


def _sample_all(data, rows, t, x, dtype):
  """The computation under test, written once for the kernel and for XLA."""
  keys = prand.step_keys(data, rows, t)
  shape = x.shape
  return (keys,
          prand.uniform(keys, shape, dtype),
          prand.normal(keys, shape, dtype),
          prand.bernoulli(keys, 0.3, shape).astype(jnp.int32),
          prand.dropout(keys, x, 0.25),
          prand.uniform(prand.fold_in(keys, 7), shape))


def _kernel_call(data, rows, t, x, *, interpret, compiler_params=None):
  dtype = x.dtype

  def kernel(data_ref, rows_ref, t_ref, x_ref, keys_ref, u_ref, n_ref, b_ref, d_ref, f_ref):
    # data_ref: uint32 [1, 2]   rows_ref, t_ref: int32 [TB, 1]   x_ref: [TB, D]
    outs = _sample_all(data_ref[...], rows_ref[...], t_ref[...], x_ref[...], dtype)
    for ref, value in zip((keys_ref, u_ref, n_ref, b_ref, d_ref, f_ref), outs):
      ref[...] = value

  row = lambda i: (i, 0)
  dtypes = (jnp.uint32, dtype, dtype, jnp.int32, dtype, jnp.float32)
  return pl.pallas_call(
      kernel, grid=(_B // _TB,),
      in_specs=[pl.BlockSpec((1, 2), lambda i: (0, 0)), pl.BlockSpec((_TB, 1), row),
                pl.BlockSpec((_TB, 1), row), pl.BlockSpec((_TB, _D), row)],
      out_specs=[pl.BlockSpec((_TB, 2), row)] + [pl.BlockSpec((_TB, _D), row)] * 5,
      out_shape=[jax.ShapeDtypeStruct((_B, 2 if i == 0 else _D), dt) for i, dt in enumerate(dtypes)],
      interpret=interpret, compiler_params=compiler_params, name=_KERNEL_NAME)(data, rows, t, x)


def _kernel_inputs(dtype):
  data = prand.key_data(jax.random.key(11)).reshape(1, 2)
  rows = jnp.arange(_B, dtype=jnp.int32)[:, None]
  t = (rows * 5) % 9
  x = jnp.linspace(-1, 1, _B * _D, dtype=jnp.float32).reshape(_B, _D).astype(dtype)
  return data, rows, t, x


@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams()], ids=["interpret", "tpu_interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_in_interpret_mode_matches_xla_bit_for_bit(interpret, dtype):
  args = _kernel_inputs(dtype)
  got = _kernel_call(*args, interpret=interpret)
  want = jax.jit(_sample_all, static_argnums=4)(*args, dtype)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers(platform, dtype):
  args = _kernel_inputs(dtype)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
    # Triton's parameters, as the library's GPU kernels pass: without any, a
    # pallas_call lowers for cuda through Mosaic GPU on JAX 0.10.2 (the
    # jax_pallas_use_mosaic_gpu default), which rejects this kernel.
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
    params = pl_triton.CompilerParams() if platform == "cuda" else None
    text = lowering.export_text(
        functools.partial(_kernel_call, interpret=False, compiler_params=params), *args,
        platform=platform)
  assert lowering.kernel_marker(platform) in text
  assert _KERNEL_NAME in text


# ---------------------------------------------------------------------------
# reference.iterate with key=: step(params, h, x, key=k), k = step_keys(key, row, t).


def _ref_dropout(rate):
  def step(params, h, x, *, key):
    del params, x
    return pallas_loop.random.dropout(key, h, rate) + 1.0
  return step


def test_reference_with_key_is_deterministic_and_key_dependent():
  h0 = jnp.ones((8, 64))
  n = jnp.array([0, 1, 2, 3, 4, 5, 6, 6], jnp.int32)
  run = jax.jit(lambda key: reference.iterate(_ref_dropout(0.5), None, h0, iters=n, max_iters=6,
                                              key=key))
  a = run(jax.random.key(0))
  np.testing.assert_array_equal(a, run(jax.random.key(0)))
  np.testing.assert_array_equal(a, run(jax.random.PRNGKey(0)))  # legacy key: same words
  b = run(jax.random.key(1))
  assert not np.array_equal(a[1:], b[1:])
  np.testing.assert_array_equal(a[0], h0[0])  # zero steps: untouched


def test_reference_dropout_rate_zero_equals_no_key():
  h0 = jnp.linspace(-1, 1, 8 * 32, dtype=jnp.float32).reshape(8, 32)
  n = jnp.arange(8, dtype=jnp.int32) % 5
  with_key = reference.iterate(_ref_dropout(0.0), None, h0, iters=n, max_iters=4,
                               key=jax.random.key(3), return_info=True)
  no_key = reference.iterate(lambda p, h, x: h + 1.0, None, h0, iters=n, max_iters=4,
                             return_info=True)
  np.testing.assert_array_equal(with_key[0], no_key[0])
  np.testing.assert_array_equal(with_key[1].steps, no_key[1].steps)


def test_reference_row_gets_key_of_its_row_and_step():
  """Row i's j-th applied step uses step_keys(key, i, j): rebuilt by hand."""
  rate, batch, cols, max_iters = 0.5, 6, 32, 5
  key = jax.random.key(9)
  n = jnp.array([0, 5, 2, 3, 9, 1], jnp.int32)
  h0 = jnp.full((batch, cols), 0.5, jnp.float32)

  def step(params, h, x, *, key):
    del params, x
    return pallas_loop.random.dropout(key, h, rate) + pallas_loop.random.uniform(
        pallas_loop.random.fold_in(key, 1), h.shape)

  got, g_h0 = jax.value_and_grad(
      lambda h: jnp.sum(reference.iterate(step, None, h, iters=n, max_iters=max_iters, key=key)))(h0)
  data = prand.key_data(key)
  want, want_grad = [], []
  for i in range(batch):
    h, grad = h0[i:i + 1], jnp.ones((1, cols))
    for j in range(min(int(n[i]), max_iters)):
      k = prand.step_keys(data, jnp.full((1, 1), i, jnp.int32), jnp.full((1, 1), j, jnp.int32))
      keep = prand.bernoulli(k, 1 - rate, h.shape)
      h = prand.dropout(k, h, rate) + prand.uniform(prand.fold_in(k, 1), h.shape)
      grad = jnp.where(keep, grad * np.float32(1 / (1 - rate)), 0.0)
    want.append(h)
    want_grad.append(grad)
  np.testing.assert_allclose(got, jnp.sum(jnp.concatenate(want)), rtol=1e-6)
  np.testing.assert_array_equal(g_h0, jnp.concatenate(want_grad))  # autodiff through the masks


def test_reference_rejects_a_bad_key():
  with pytest.raises(TypeError, match=r"jax.random.key\(seed\)"):
    reference.iterate(_ref_dropout(0.1), None, jnp.ones((4, 8)), iters=2, max_iters=2, key=0)


# ---------------------------------------------------------------------------
# Random bits over the rows from a key shared by every row: refused at trace
# time (a row's bits would be those of its position in the tile or group).

_SHARED = jax.random.PRNGKey(7)


def _closed_over_dropout(p, h, x):       # deq-jax's block, hk.dropout's draw
  out = jnp.tanh(h @ p + x)
  return jnp.where(jax.random.bernoulli(_SHARED, 0.9, out.shape), out / 0.9, 0.0)


def _key_in_params(p, h, x):
  return jnp.tanh(h @ p["w"] + x) + 0.1 * jax.random.normal(p["key"], h.shape)


def _noise_as_state(p, h, x):
  return jax.random.uniform(_SHARED, h.shape)


# The bits are as wide as the default float (uint64 under jax_enable_x64).
_SHARED_KEY_MESSAGE = (r"^step draws random bits over the row axis from a key shared by every "
                       r"row \(random_bits at .*test_random.py:\d+.*uint(32|64)\[16, 8\]; (combined "
                       r"with the state by (select_n|add) at .*test_random.py:\d+.*|returned as a "
                       r"state leaf)\): draw from per-row keys instead: pass key= to iterate "
                       r"\(or to deq.fixed_point\) and draw with pallas_loop.random")


@pytest.mark.parametrize("h0_value", [0.0, 1.0])
@pytest.mark.parametrize("step,params", [
    (_closed_over_dropout, jnp.eye(8)),
    (_key_in_params, {"w": jnp.eye(8), "key": jax.random.key(3)}),
    (_noise_as_state, None),
])
def test_shared_key_draws_over_rows_are_refused(step, params, h0_value):
  h0 = jnp.full((16, 8), h0_value)
  for implementation in ("xla", "pallas"):
    with pytest.raises(ValueError, match=_SHARED_KEY_MESSAGE):
      pallas_loop.iterate(step, params, h0, jnp.ones((16, 8)), max_iters=3,
                          options=pallas_loop.Options(implementation=implementation))


def test_flax_dropout_with_a_module_rng_is_refused():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, x):
      return nn.Dropout(0.1, deterministic=False)(jnp.tanh(nn.Dense(8)(h) + x))

  # float32 like Flax's parameters, also under jax_enable_x64 (the suite's strict
  # promotion refuses a float64 input to a float32 Dense).
  block, h0, x = Block(), jnp.zeros((16, 8), jnp.float32), jnp.ones((16, 8), jnp.float32)
  params = block.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, h0, x)
  rng = jax.random.key(2)
  step = lambda p, h, x_: block.apply(p, h, x_, rngs={"dropout": rng})
  with pytest.raises(ValueError, match=r"^step draws random bits over the row axis .*called "
                     r"from .*test_random.py:\d+"):
    pallas_loop.iterate(step, params, h0, x, max_iters=2)
  # The legal spelling: per-example, the row's own key as the module's rng.
  per_row = lambda p, h, x_, key: block.apply(p, h, x_, rngs={"dropout": jax.random.wrap_key_data(key)})
  out = pallas_loop.iterate(per_row, params, h0, x, max_iters=2, key=rng, per_example=True)
  assert out.shape == h0.shape


def test_draws_that_do_not_run_over_rows_pass():
  # Shared noise over the features (the same for every row, whatever the tile),
  # and jax.random on each row's own key in a per-example step.
  shared = lambda p, h, x: h * 0.5 + 0.01 * jax.random.normal(_SHARED, h.shape[1:])
  out = pallas_loop.iterate(shared, None, jnp.ones((8, 8)), max_iters=2)   # D == B
  assert out.shape == (8, 8)
  from pallas_loop._src.step import row_checks
  step = jax.vmap(lambda h, k: h + jax.random.normal(jax.random.wrap_key_data(k), h.shape))
  closed = jax.make_jaxpr(lambda p, h, x, k: step(h, k))(None, jnp.ones((16, 8)), None,
                                                         jnp.ones((16, 2), jnp.uint32))
  analysis = row_checks.check_step_jaxpr(closed, None, jnp.ones((16, 8)), None)
  assert analysis.outputs == [row_checks.Row(0)] and not analysis.unknown_primitives


def test_check_row_independence_sees_a_shared_key_mask_at_h_zero():
  """The numerical checks see nothing at h = 0 (the mask multiplies zeros); the
  jaxpr check does, and says what to do."""
  step = lambda p, h, x: jnp.where(jax.random.bernoulli(_SHARED, 0.9, h.shape), h / 0.9, 0.0)
  with pytest.raises(AssertionError, match=r"^step draws random bits over the row axis from a "
                     r"key shared by every row"):
    pallas_loop.testing.check_row_independence(step, None, jnp.zeros((16, 8)))
