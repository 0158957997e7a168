"""Forward results of every implementation against `reference.iterate`."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from tests import cases
from tests import oracle

QUICK_IMPLS = ("xla", "pallas")
ALL_IMPLS = tuple(cases.IMPLEMENTATIONS)


def _sweep(impls, batches, dtypes=("float32", "bfloat16"), patterns=cases.PATTERNS):
  return list(itertools.product(impls, dtypes, batches, patterns))


QUICK = _sweep(QUICK_IMPLS, (7, 64))
FULL = [c for c in _sweep(ALL_IMPLS, (1, 7, 64, 300)) if c not in QUICK]


def _check_forward(impl, dtype, batch, pattern, block="tanh_rnn", d=16, **extra):
  step, params, h0, x = blocks.make(block, batch, d, jnp.dtype(dtype))
  n = cases.counts(pattern, batch)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  got, info = pallas_loop.iterate(step, params, h0, x, return_info=True,
                                  **kw, **extra, options=cases.IMPLEMENTATIONS[impl])
  want, want_f32 = oracle.reference_pair(step, params, h0, x, **kw)
  oracle.assert_trees_close(got, want, want_f32)
  ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)[1]
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.steps, np.clip(n, 0, cases.MAX_ITERS))
  # The residual is an rms of the last update: by the triangle inequality
  # it moves at most by the states' own deviation (both ends of the update),
  # which in bf16 is an ulp here and there (the GPU's tanh, the dots' order).
  state_err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)),
                           initial=0.0))
  np.testing.assert_allclose(info.residual, ref_info.residual, rtol=1e-2,
                             atol=1e-3 + 2 * state_err)
  assert info.residual.dtype == jnp.float32 and not np.any(info.halted)


@pytest.mark.parametrize("impl,dtype,batch,pattern", QUICK)
def test_forward_matches_reference(impl, dtype, batch, pattern):
  _check_forward(impl, dtype, batch, pattern)


@pytest.mark.slow
@pytest.mark.parametrize("impl,dtype,batch,pattern", FULL)
def test_forward_matches_reference_full(impl, dtype, batch, pattern):
  _check_forward(impl, dtype, batch, pattern)


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("block", ["residual_mlp", "lstm"])
def test_other_blocks(impl, block):
  _check_forward(impl, "float32", 37, "ragged", block=block)


@pytest.mark.parametrize("block_rows", [8, 16, 32, 64])
@pytest.mark.parametrize("sort_rows", [True, False])
def test_independent_of_tiling_and_order(block_rows, sort_rows):
  step, params, h0, x = blocks.make("tanh_rnn", 45, 16)
  n = cases.counts("ragged", 45, seed=3)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  want = reference.iterate(step, params, h0, x, **kw)
  got = pallas_loop.iterate(step, params, h0, x, **kw,
                            options=pallas_loop.Options(implementation="pallas", interpret=True,
                                                        block_rows=block_rows, sort_rows=sort_rows))
  oracle.assert_trees_close(got, want)
  # Results do not depend on the order of rows either.
  perm = np.random.default_rng(0).permutation(45)
  permuted = pallas_loop.iterate(step, params, h0[perm], x[perm], iters=n[perm],
                                 max_iters=cases.MAX_ITERS,
                                 options=pallas_loop.Options(implementation="pallas",
                                                             interpret=True, block_rows=block_rows,
                                                             sort_rows=sort_rows))
  np.testing.assert_allclose(permuted, got[perm], rtol=1e-6, atol=1e-6)


def test_motivating_vmap_doubling():
  """The user's question: per-example counts [1, 2, 3] under vmap give 2, 4, 8."""
  init = jnp.ones((5,))
  double = lambda params, h, x: h * 2

  for impl in QUICK_IMPLS:
    def iterate_for_steps(n):
      return pallas_loop.iterate(double, None, init[None], iters=n, max_iters=3,
                                 options=cases.IMPLEMENTATIONS[impl])[0]
    out = jax.jit(jax.vmap(iterate_for_steps))(jnp.array([1, 2, 3]))
    np.testing.assert_array_equal(out, jnp.array([[2.0] * 5, [4.0] * 5, [8.0] * 5]))


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_padding_never_leaks(impl):
  """Padded rows poisoned with NaN must not reach any real row."""
  step, params, h0, x = blocks.make("tanh_rnn", 13, 16)
  n = cases.counts("ragged", 13)
  with pallas_loop.testing.poisoned_padding():
    got = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                              options=cases.IMPLEMENTATIONS[impl].replace(block_rows=8))
  assert np.all(np.isfinite(got))
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, iters=n,
                                                   max_iters=cases.MAX_ITERS))


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_rows_with_zero_count_are_not_read(impl):
  """Rows of count 0 holding NaN pass through; the other rows are unaffected."""
  step, params, h0, x = blocks.make("tanh_rnn", 16, 16)
  dead = np.arange(16) % 3 == 0
  n = jnp.where(dead, 0, jnp.maximum(cases.counts("ragged", 16, seed=5), 1))
  h0 = jnp.where(dead[:, None], jnp.nan, h0)
  x = jnp.where(dead[:, None], jnp.nan, x)
  got = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                            options=cases.IMPLEMENTATIONS[impl].replace(block_rows=8))
  want = reference.iterate(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  assert np.all(np.isnan(got[dead]))
  oracle.assert_trees_close(got[~dead], want[~dead])


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_mixed_rank_leaves_scalar_param_no_x(impl):
  batch = 21
  k = jax.random.split(jax.random.key(2), 4)
  params = (jnp.float32(0.8), jax.random.normal(k[0], (16, 16)) * 0.2)
  state = (jax.random.normal(k[1], (batch,)), jax.random.normal(k[2], (batch, 16)),
           jax.random.normal(k[3], (batch, 4, 16)))
  n = cases.counts("ragged", batch)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  got = pallas_loop.iterate(cases.mixed_rank_step, params, state, **kw,
                            options=cases.IMPLEMENTATIONS[impl].replace(block_rows=8))
  oracle.assert_trees_close(got, reference.iterate(cases.mixed_rank_step, params, state, **kw))


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_params_none_and_closed_over_arrays(impl):
  """params=None, and a step closing over a global and over a jit-traced array."""
  w_global = jax.random.normal(jax.random.key(7), (16, 16)) * 0.2
  h0 = jax.random.normal(jax.random.key(8), (10, 16))
  n = cases.counts("ragged", 10)

  @jax.jit
  def run(bias):
    step = lambda params, h, x: jnp.tanh(h @ w_global + bias)
    got = pallas_loop.iterate(step, None, h0, iters=n, max_iters=cases.MAX_ITERS,
                              options=cases.IMPLEMENTATIONS[impl])
    want = reference.iterate(step, None, h0, iters=n, max_iters=cases.MAX_ITERS)
    return got, want

  got, want = run(jnp.full((16,), 0.1))
  oracle.assert_trees_close(got, want)


@pytest.mark.parametrize("impl", QUICK_IMPLS)
def test_traced_counts_compile_once(impl):
  traces = []
  step, params, h0, x = blocks.make("tanh_rnn", 9, 16)

  def counted(p, h, x_):
    traces.append(1)
    return step(p, h, x_)

  run = jax.jit(lambda n: pallas_loop.iterate(counted, params, h0, x, iters=n,
                                              max_iters=cases.MAX_ITERS,
                                              options=cases.IMPLEMENTATIONS[impl]))
  for seed in range(3):
    n = cases.counts("ragged", 9, seed=seed)
    oracle.assert_trees_close(run(n), reference.iterate(step, params, h0, x, iters=n,
                                                        max_iters=cases.MAX_ITERS))
  n_traces = len(traces)
  run(cases.counts("max", 9))
  run(jnp.int32(2) * jnp.ones((9,), jnp.int32))
  assert len(traces) == n_traces, "a new count value must not retrace"


@pytest.mark.parametrize("impl", QUICK_IMPLS)
@pytest.mark.parametrize("iters", [0, 3, 100, -2, np.int32(4)])
def test_scalar_iters_and_zero_max(impl, iters):
  step, params, h0, x = blocks.make("tanh_rnn", 5, 16)
  for max_iters in (0, 4):
    got, info = pallas_loop.iterate(step, params, h0, x, iters=iters, max_iters=max_iters,
                                    return_info=True, options=cases.IMPLEMENTATIONS[impl])
    want = reference.iterate(step, params, h0, x, iters=iters, max_iters=max_iters)
    oracle.assert_trees_close(got, want)
    np.testing.assert_array_equal(info.steps, np.full(5, np.clip(int(iters), 0, max_iters)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_per_example_step_is_vmapped_over_rows(impl):
  step, params, h0, x = blocks.make("gru", 19, 16)
  one_row = lambda p, h, x_: step(p, h[None], x_[None])[0]   # written for one row
  n = cases.counts("ragged", 19)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, options=cases.IMPLEMENTATIONS[impl])
  got = pallas_loop.iterate(one_row, params, h0, x, per_example=True, **kw)
  want = pallas_loop.iterate(step, params, h0, x, **kw)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  ref = reference.iterate(one_row, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                          per_example=True)
  oracle.assert_trees_close(got, ref)
  g = jax.grad(lambda p: cases.tree_sum(pallas_loop.iterate(
      one_row, p, h0, x, per_example=True, **kw)))(params)
  g_ref = jax.grad(lambda p: cases.tree_sum(reference.iterate(
      one_row, p, h0, x, iters=n, max_iters=cases.MAX_ITERS, per_example=True)))(params)
  oracle.assert_trees_close(g, g_ref, what="gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_per_example_step_gets_its_row_key(impl):
  h0 = jnp.zeros((6, 16))
  one_row = lambda p, h, x_, key: h + pallas_loop.random.uniform(key, h.shape)
  kw = dict(iters=3, max_iters=3, key=jax.random.key(1))
  got = pallas_loop.iterate(one_row, None, h0, per_example=True, **kw,
                            options=cases.IMPLEMENTATIONS[impl])
  ref = reference.iterate(one_row, None, h0, per_example=True, **kw)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  # A row's draws depend only on its key: the same as the batched step's.
  batched = pallas_loop.iterate(one_row, None, h0, **kw)  # the samplers take [R, 2] too
  np.testing.assert_allclose(got, batched, rtol=1e-6)
  assert np.unique(np.asarray(got), axis=0).shape[0] == 6   # rows drew differently
