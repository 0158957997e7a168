"""`pallas_loop.sampling`: per-row depth samplers (means, ranges, caps, errors)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import pallas_loop
from pallas_loop import sampling

N = 1 << 15  # rows per statistical draw
KEY = jax.random.key(0)


def _int32_in(n, lo, hi):
  assert n.dtype == jnp.int32 and n.ndim == 1
  n = np.asarray(n)
  assert n.min() >= lo and n.max() <= hi, (n.min(), n.max())
  return n


def test_public_submodule():
  assert pallas_loop.sampling is sampling


# ---------------------------------------------------------------------------
# uniform


def test_uniform_is_inclusive_and_flat():
  n = _int32_in(sampling.uniform(KEY, N, 3, 10), 3, 10)
  counts = np.bincount(n - 3, minlength=8)
  assert np.all(counts > 0)  # both ends included
  chi2 = np.sum((counts - N / 8) ** 2 / (N / 8))
  assert chi2 < stats.chi2.ppf(1 - 1e-4, 7), chi2
  assert abs(n.mean() - 6.5) < 5 * np.sqrt((8**2 - 1) / 12 / N)


def test_uniform_degenerate_per_row_and_jit():
  np.testing.assert_array_equal(sampling.uniform(KEY, 5, 4, 4), np.full(5, 4))
  lo = jnp.array([0, 10, 20], jnp.int32)
  n = jax.jit(sampling.uniform, static_argnums=1)(KEY, 3, lo, lo + 2)
  assert n.dtype == jnp.int32 and np.all((n >= lo) & (n <= lo + 2))
  assert sampling.uniform(jax.random.PRNGKey(0), 0, 1, 2).shape == (0,)  # legacy key, empty batch


# ---------------------------------------------------------------------------
# geometric


@pytest.mark.parametrize("p", [0.5, 0.125])
def test_geometric_mean_and_pmf(p):
  n = _int32_in(sampling.geometric(KEY, N, p=p, cap=1000), 1, 1000)
  var = (1 - p) / p**2
  assert abs(n.mean() - 1 / p) < 5 * np.sqrt(var / N)
  # P(n = 1) = p, P(n = 2) = (1 - p) p.
  for j, pj in ((1, p), (2, (1 - p) * p)):
    assert abs(np.mean(n == j) - pj) < 5 * np.sqrt(pj * (1 - pj) / N)


def test_geometric_mean_argument_and_cap():
  a = sampling.geometric(KEY, N, mean=4.0, cap=6)
  np.testing.assert_array_equal(a, sampling.geometric(KEY, N, p=0.25, cap=6))
  n = _int32_in(a, 1, 6)
  p, cap = 0.25, 6
  capped_mean = (1 - (1 - p) ** cap) / p
  assert abs(n.mean() - capped_mean) < 5 * np.sqrt(((1 - p) / p**2) / N)
  tail = (1 - p) ** (cap - 1)  # the mass of j >= cap lands on cap
  assert abs(np.mean(n == cap) - tail) < 5 * np.sqrt(tail * (1 - tail) / N)


def test_geometric_p_one_is_always_one():
  np.testing.assert_array_equal(sampling.geometric(KEY, 64, p=1.0, cap=10), np.ones(64))


# ---------------------------------------------------------------------------
# lognormal_poisson


@pytest.mark.parametrize("mean, sigma", [(8.0, 0.5), (32.0, 0.0)])
def test_lognormal_poisson_moments(mean, sigma):
  n = _int32_in(sampling.lognormal_poisson(KEY, N, mean=mean, sigma=sigma, cap=10_000), 1, 10_000)
  var = mean + mean**2 * (np.exp(sigma**2) - 1)
  assert abs(n.mean() - (1 + mean)) < 5 * np.sqrt(var / N)
  # Sample variance within 10% (its spread is far smaller than that at N = 2**15).
  assert abs(n.var() / var - 1) < 0.1, (n.var(), var)


def test_lognormal_poisson_cap_and_heavy_tail():
  n = _int32_in(sampling.lognormal_poisson(KEY, N, mean=16.0, sigma=1.0, cap=48), 1, 48)
  assert np.mean(n == 48) > 0.01  # the right tail reaches the cap
  assert np.median(n) < 17  # while most rows sit below the mean
  # A huge rate saturates at the cap (no int32 overflow).
  big = sampling.lognormal_poisson(KEY, 8, mean=1e12, sigma=0.0, cap=100)
  np.testing.assert_array_equal(big, np.full(8, 100))


# ---------------------------------------------------------------------------
# truncated_split


def test_truncated_split_sums_to_total_and_keeps_its_distribution():
  s = sampling.truncated_split(KEY, N, 8, mean=16.0, sigma=0.5, cap=64)
  total, grad = s  # unpacks as a pair
  assert total.dtype == grad.dtype == s.no_grad.dtype == jnp.int32
  np.testing.assert_array_equal(s.no_grad + grad, total)
  np.testing.assert_array_equal(grad, np.minimum(8, total))
  assert np.all(np.asarray(s.no_grad) >= 0)
  # The total is exactly the sampler's draw with the same key.
  np.testing.assert_array_equal(total, sampling.lognormal_poisson(KEY, N, mean=16.0, sigma=0.5, cap=64))
  assert np.any(np.asarray(total) < 8)  # short rows get all their steps with gradient
  np.testing.assert_array_equal(np.asarray(grad)[np.asarray(total) < 8], np.asarray(total)[np.asarray(total) < 8])


def test_truncated_split_other_samplers_and_per_row_k():
  s = sampling.truncated_split(KEY, 16, 0, sampler=sampling.uniform, lo=1, hi=4)
  np.testing.assert_array_equal(s.grad, np.zeros(16))
  k = jnp.arange(16, dtype=jnp.int32) % 3
  s = sampling.truncated_split(KEY, 16, k, sampler=sampling.geometric, p=0.5, cap=8)
  np.testing.assert_array_equal(s.grad, np.minimum(k, s.total))
  s = jax.jit(lambda key: sampling.truncated_split(key, 16, 2, mean=4.0, sigma=0.3, cap=8))(KEY)
  np.testing.assert_array_equal(s.no_grad + s.grad, s.total)


# ---------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("call, error, match", [
    (lambda: sampling.uniform(0, 4, 1, 2), TypeError, r"jax.random.key\(seed\)"),
    (lambda: sampling.uniform(KEY, 4.0, 1, 2), TypeError, "batch must be a static Python int"),
    (lambda: sampling.uniform(KEY, -1, 1, 2), ValueError, "batch=-1 must be >= 0"),
    (lambda: sampling.uniform(KEY, 4, 3, 2), ValueError, "lo must be <= hi"),
    (lambda: sampling.uniform(KEY, 4, -1, 2), ValueError, "lo must be >= 0"),
    (lambda: sampling.uniform(KEY, 4, 1.5, 2), TypeError, "lo must be an int"),
    (lambda: sampling.uniform(KEY, 4, 1, jnp.ones((3,), jnp.int32)), ValueError,
     r"hi must be a scalar or have shape \(4,\)"),
    (lambda: sampling.geometric(KEY, 4, cap=8), TypeError, "exactly one of p= .* or mean="),
    (lambda: sampling.geometric(KEY, 4, p=0.5, mean=2.0, cap=8), TypeError, "exactly one"),
    (lambda: sampling.geometric(KEY, 4, p=0.0, cap=8), ValueError, r"p must be in \(0, 1\]"),
    (lambda: sampling.geometric(KEY, 4, p=1.5, cap=8), ValueError, r"p must be in \(0, 1\]"),
    (lambda: sampling.geometric(KEY, 4, mean=0.5, cap=8), ValueError, "mean must be >= 1"),
    (lambda: sampling.geometric(KEY, 4, p=0.5, cap=0), ValueError, "cap=0 must be >= 1"),
    (lambda: jax.jit(lambda c: sampling.geometric(KEY, 4, p=0.5, cap=c))(8), TypeError,
     "cap must be a static Python int"),
    (lambda: sampling.lognormal_poisson(KEY, 4, mean=0.0, sigma=0.5, cap=8), ValueError, "mean must be > 0"),
    (lambda: sampling.lognormal_poisson(KEY, 4, mean=4.0, sigma=-1.0, cap=8), ValueError,
     "sigma must be >= 0"),
    (lambda: sampling.lognormal_poisson(KEY, 4, mean="4", sigma=0.5, cap=8), TypeError,
     "mean must be a real number"),
    (lambda: sampling.truncated_split(KEY, 4, -1, mean=4.0, sigma=0.5, cap=8), ValueError,
     "k must be >= 0"),
    (lambda: sampling.truncated_split(KEY, 4, 2, sampler="lognormal", mean=4.0), TypeError,
     "sampler must be a callable"),
    (lambda: sampling.truncated_split(KEY, 4, 2, sampler=lambda k, b: jnp.ones((b, 2), jnp.int32)),
     ValueError, r"sampler must return int counts of shape \(4,\)"),
    (lambda: sampling.lognormal_poisson(jax.random.split(KEY, 2), 4, mean=4.0, sigma=0.5, cap=8),
     ValueError, "single PRNG key"),
])
def test_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()
