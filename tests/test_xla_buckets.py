"""The bucketed XLA loop (`pallas_loop/_src/xla/xla_forward.py`) against `reference.iterate`.

The XLA implementation runs the step only on the running rows (a prefix of
rows ordered by count, padded to a ladder size, compacted under halting), so
these tests aim at what that could break: a row stepped once too often or too
rarely at a stage change, rows reordered and not restored, a halted row left
running after compaction, a finished row's NaN reaching another row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from benchmarks import harness
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.xla import xla_forward
from tests import oracle

T = 12


def _counts(pattern: str, batch: int, seed: int = 0) -> jnp.ndarray:
  rng = np.random.default_rng(seed)
  if pattern == "zeros":
    n = np.zeros(batch)
  elif pattern == "all_max":
    n = np.full(batch, T)
  elif pattern == "uniform":
    n = rng.integers(1, T + 1, batch)
  elif pattern == "ragged_with_zeros":
    n = rng.integers(0, T + 1, batch)
  elif pattern == "one_long_row":
    n = np.zeros(batch).astype(int)
    n[batch // 3] = T
  elif pattern == "bimodal":
    n = np.where(rng.random(batch) < 0.8, 1, T)
  else:
    raise ValueError(pattern)
  return jnp.asarray(n, jnp.int32)


def _xla(step, params, h0, x, n, **kw):
  # Jitted: one compilation of the stages instead of op-by-op dispatch.
  return jax.jit(lambda p, h, x_, n_: pallas_loop.iterate(
      step, p, h, x_, iters=n_, max_iters=T, **kw,
      options=pallas_loop.Options(implementation="xla")))(params, h0, x, n)


def _check(step, params, h0, x, n, **kw):
  got, info = _xla(step, params, h0, x, n, return_info=True, **kw)
  want, want_info = jax.jit(lambda p, h, x_, n_: reference.iterate(
      step, p, h, x_, iters=n_, max_iters=T, return_info=True, **kw))(params, h0, x, n)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, want_info.steps)
  np.testing.assert_array_equal(info.halted, want_info.halted)
  np.testing.assert_allclose(info.residual, want_info.residual, rtol=1e-5, atol=1e-7)
  return got, info


def test_bucket_ladder():
  assert xla_forward.bucket_sizes(0) == ()
  assert xla_forward.bucket_sizes(1) == (1,)
  assert xla_forward.bucket_sizes(7) == (7,)
  # Up to ONE_STAGE_ROWS rows: one stage; above, the ladder.
  assert xla_forward.bucket_sizes(xla_forward.ONE_STAGE_ROWS) == (xla_forward.ONE_STAGE_ROWS,)
  assert xla_forward.bucket_sizes(128) == (128, 96, 64, 32, 16)
  assert xla_forward.bucket_sizes(1024) == (1024, 768, 512, 256, 128, 64, 32, 16)
  for b in (1, 9, 100, 300, 1024, 4096, 1000):
    sizes = xla_forward.bucket_sizes(b)
    assert sizes[0] == b and list(sizes) == sorted(set(sizes), reverse=True)
    assert min(sizes) >= min(b, xla_forward.MIN_ROWS)
    assert len(sizes) <= xla_forward.LINEAR_STEPS + 12
  assert harness.bucket_for(0, (16,)) == 0
  assert harness.bucket_for(5, (64, 32, 16)) == 16
  assert harness.bucket_for(17, (64, 32, 16)) == 32


@pytest.mark.parametrize("pattern,batch", [
    ("zeros", 100), ("all_max", 100), ("uniform", 100), ("ragged_with_zeros", 100),
    ("one_long_row", 100), ("bimodal", 100), ("uniform", 7)])  # 7 rows: a single bucket
def test_counts_patterns(pattern, batch):
  step, params, h0, x = blocks.make("tanh_rnn", batch, 16)
  _check(step, params, h0, x, _counts(pattern, batch))


@pytest.mark.parametrize("block", ["residual_mlp", "lstm"])
def test_other_blocks_and_pytree_state(block):
  step, params, h0, x = blocks.make(block, 70, 16)
  _check(step, params, h0, x, _counts("ragged_with_zeros", 70, seed=1))


def test_bfloat16():
  step, params, h0, x = blocks.make("tanh_rnn", 50, 16, jnp.bfloat16)
  n = _counts("uniform", 50, seed=2)
  got = _xla(step, params, h0, x, n)
  want, want_f32 = oracle.reference_pair(step, params, h0, x, iters=n, max_iters=T)
  oracle.assert_trees_close(got, want, want_f32)


def test_traced_counts_under_jit_one_compilation():
  step, params, h0, x = blocks.make("tanh_rnn", 40, 16)
  traces = []

  @jax.jit
  def run(n):
    traces.append(1)
    return pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=T,
                               options=pallas_loop.Options(implementation="xla"))

  for seed, pattern in enumerate(["uniform", "one_long_row", "zeros", "bimodal"]):
    n = _counts(pattern, 40, seed)
    oracle.assert_trees_close(run(n), reference.iterate(step, params, h0, x, iters=n,
                                                        max_iters=T))
  assert len(traces) == 1


def test_rows_in_caller_order_and_independent_of_order():
  step, params, h0, x = blocks.make("tanh_rnn", 64, 16)
  n = _counts("ragged_with_zeros", 64, seed=3)
  got, _ = _check(step, params, h0, x, n)
  perm = np.random.default_rng(0).permutation(64)
  permuted = _xla(step, params, h0[perm], x[perm], n[perm])
  np.testing.assert_array_equal(permuted, got[perm])


def test_nan_in_finished_rows_stays_there():
  """Rows with count 0 are NaN; rows with count 1 get NaN after their step.

  Both ride along in buckets after they finish (computed, then discarded), so
  a NaN leaking into another row, or into a finished row's kept state, shows.
  """
  batch = 64
  step, params, h0, x = blocks.make("tanh_rnn", batch, 16)
  n = _counts("ragged_with_zeros", batch, seed=4)
  zero = np.asarray(n) == 0
  n = n.at[5].set(1)
  assert zero.any()
  h0 = jnp.where(zero[:, None], jnp.nan, h0)
  # A step that turns a row NaN from its second application on: a row with
  # count 1 stays finite only if it is never stepped again.
  poison = jnp.where(np.arange(batch)[:, None] == 5, jnp.nan, 0.0).astype(jnp.float32)

  def counting_step(params, h, x):
    state, calls = h
    new = step(params, state, x[0])
    new = new + jnp.where(calls >= 1, x[1], 0.0)
    return new, calls + 1

  h0c = (h0, jnp.zeros((batch, 1), jnp.float32))
  xc = (x, poison)
  got, info = _xla(counting_step, params, h0c, xc, n, return_info=True)
  want = reference.iterate(counting_step, params, h0c, xc, iters=n, max_iters=T)
  assert np.all(np.isnan(np.asarray(got[0])[zero]))
  assert np.all(np.isfinite(np.asarray(got[0])[~zero]))
  np.testing.assert_array_equal(got[1][:, 0], np.clip(n, 0, T))
  oracle.assert_trees_close(jax.tree.map(lambda a: a[~zero], got),
                            jax.tree.map(lambda a: a[~zero], want))
  np.testing.assert_array_equal(info.steps, np.clip(n, 0, T))


def test_rows_computed_matches_what_runs():
  """`harness.bucketed_rows_computed` (used by the benchmarks) counts the rows stepped."""
  batch = 100
  step, params, h0, x = blocks.make("tanh_rnn", batch, 16)
  n = _counts("uniform", batch, seed=5)
  seen = []

  def logging_step(params, h, x):
    rows = h.shape[0]
    jax.debug.callback(lambda: seen.append(rows))
    return step(params, h, x)

  out = pallas_loop.iterate(logging_step, params, h0, x, iters=n, max_iters=T,
                            options=pallas_loop.Options(implementation="xla"))
  jax.block_until_ready(out)
  assert sum(seen) == harness.bucketed_rows_computed(np.asarray(n))
  assert int(n.sum()) <= sum(seen) < batch * T
  assert max(seen) == batch and min(seen) < batch  # it did shrink


def _deq(batch):
  step, params, h0, x = blocks.make("deq", batch, 16)
  return step, params, h0, x


@pytest.mark.parametrize("min_iters", [0, 5])
def test_halting_tol(min_iters):
  step, params, h0, x = _deq(90)
  n = _counts("uniform", 90, seed=6)
  _, info = _check(step, params, h0, x, n, tol=1e-3, min_iters=min_iters)
  assert info.halted.any() and not info.halted.all()  # rows halt at different steps
  assert len(set(np.asarray(info.steps).tolist())) > 3


def test_halting_custom_criterion_and_tol():
  step, params, h0, x = _deq(90)
  halt = pallas_loop.halting.relative_change(2e-3)
  n = jnp.full((90,), T, jnp.int32)
  _, info = _check(step, params, h0, x, n, halt=halt)
  assert info.halted.any()
  _check(step, params, h0, x, n, halt=halt, tol=1e-3)


def test_halting_traced_tol_under_jit():
  step, params, h0, x = _deq(60)
  n = _counts("ragged_with_zeros", 60, seed=7)
  run = jax.jit(lambda tol: pallas_loop.iterate(
      step, params, h0, x, iters=n, max_iters=T, tol=tol,
      return_info=True, options=pallas_loop.Options(implementation="xla")))
  for tol in (1e-2, 1e-3, 0.0):
    got, info = run(jnp.float32(tol))
    want, want_info = reference.iterate(step, params, h0, x, iters=n, max_iters=T,
                                        tol=jnp.float32(tol), return_info=True)
    oracle.assert_trees_close(got, want)
    np.testing.assert_array_equal(info.steps, want_info.steps)


def test_halting_with_nan_rows_compacted_away():
  """Halted rows are compacted behind running ones; NaN rows never halt."""
  step, params, h0, x = _deq(80)
  x = x.at[3].set(jnp.nan)
  n = jnp.full((80,), T, jnp.int32)
  got, info = _check(step, params, h0, x, n, tol=1e-3)
  assert np.isnan(np.asarray(got[3])).all() and int(info.steps[3]) == T
  assert np.isfinite(np.asarray(got)[np.arange(80) != 3]).all()


def test_gradients_still_match():
  step, params, h0, x = blocks.make("tanh_rnn", 40, 16)
  n = _counts("ragged_with_zeros", 40, seed=8)
  loss = lambda run, p: jnp.sum(run(step, p, h0, x, iters=n, max_iters=T) ** 2)
  xla = pallas_loop.Options(implementation="xla")
  got = jax.grad(lambda p: loss(lambda *a, **k: pallas_loop.iterate(*a, **k, options=xla), p))(
      params)
  want = jax.grad(lambda p: loss(reference.iterate, p))(params)
  oracle.assert_trees_close(got, want, what="grad")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_residual_computed_only_when_returned(implementation):
  """Without `return_info` (and no tolerance) the per-step rms is skipped.

  It is a reduction over the state on every step (~15% of a light step on
  CPU); with `return_info=True` or a `tol` it is there, and the residual is
  the reference's (checked above and in test_forward).
  """
  step, params, h0, x = blocks.make("tanh_rnn", 32, 16)
  n = _counts("uniform", 32)

  def primitives(**kw):
    jaxpr = jax.make_jaxpr(lambda h: pallas_loop.iterate(
        step, params, h, x, iters=n, max_iters=T, **kw,
        options=pallas_loop.Options(implementation=implementation,
                                    interpret=True if implementation == "pallas" else None)))(h0)
    return {e.primitive.name for e in backend_lib.iter_eqns(jaxpr.jaxpr)}

  assert "sqrt" not in primitives()
  assert "sqrt" in primitives(return_info=True)
  assert "sqrt" in primitives(tol=1e-3)
  run = lambda **kw: jax.jit(lambda h: pallas_loop.iterate(
      step, params, h, x, iters=n, max_iters=T, **kw,
      options=pallas_loop.Options(implementation=implementation)))(h0)
  got, info = run(return_info=True)
  np.testing.assert_array_equal(got, run())  # the same loop, one output fewer
  want = reference.iterate(step, params, h0, x, iters=n, max_iters=T, return_info=True)[1]
  np.testing.assert_allclose(info.residual, want.residual, rtol=1e-5, atol=1e-7)
