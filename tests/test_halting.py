"""Convergence halting (`tol`, `halt`, `min_iters`) against the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from pallas_loop import halting
from tests import cases
from tests import lowering
from tests import oracle

IMPLS = tuple(cases.IMPLEMENTATIONS)
D = 16


def contraction(params, h, x):
  """h <- tanh(rate * h W + bias): row i contracts at its own rate."""
  z = x["rate"] * jnp.dot(h, params, preferred_element_type=jnp.float32)
  return jnp.tanh(z + x["bias"].astype(jnp.float32)).astype(h.dtype)


def problem(batch=40, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  w = jnp.linalg.qr(jax.random.normal(k[0], (D, D)))[0].astype(dtype)  # orthogonal: |W| = 1
  x = {"rate": jnp.linspace(0.05, 0.9, batch, dtype=jnp.float32)[:, None],
       "bias": jax.random.normal(k[1], (batch, D), jnp.float32).astype(dtype)}
  h0 = jax.random.normal(k[2], (batch, D), jnp.float32).astype(dtype)
  return w, h0, x


def _compare(impl, w, h0, x, want_f32=None, **kw):
  got, info = pallas_loop.iterate(contraction, w, h0, x, return_info=True,
                                  **kw, options=cases.IMPLEMENTATIONS[impl].replace(block_rows=8))
  want, ref_info = reference.iterate(contraction, w, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(got, want, want_f32)
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.halted, ref_info.halted)
  np.testing.assert_allclose(info.residual, ref_info.residual, rtol=1e-4, atol=1e-6)
  return info


@pytest.mark.parametrize("impl", IMPLS)
def test_tol_converges_after_many_different_counts(impl):
  w, h0, x = problem()
  budget = jnp.where(jnp.arange(40) % 5 == 0, 4, 60)  # some rows hit their budget first
  info = _compare(impl, w, h0, x, iters=budget, max_iters=60, tol=1e-4)
  assert len(np.unique(info.steps)) >= 8, info.steps
  assert np.all(info.halted == (np.asarray(info.residual) <= 1e-4))
  assert np.any(~info.halted) and np.any(info.halted)
  assert np.all(info.steps <= budget)


@pytest.mark.parametrize("impl", IMPLS)
def test_min_iters(impl):
  w, h0, x = problem()
  info = _compare(impl, w, h0, x, iters=60, max_iters=60, tol=1e-3, min_iters=25)
  assert np.all(info.steps >= 25)


@pytest.mark.parametrize("impl", IMPLS)
def test_custom_halt_and_combined_with_tol(impl):
  w, h0, x = problem()
  rel = halting.relative_change(1e-3)
  only_halt = _compare(impl, w, h0, x, iters=60, max_iters=60, halt=rel)
  only_tol = _compare(impl, w, h0, x, iters=60, max_iters=60, tol=1e-5)
  both = _compare(impl, w, h0, x, iters=60, max_iters=60, tol=1e-5, halt=rel)
  np.testing.assert_array_equal(both.steps, np.minimum(only_halt.steps, only_tol.steps))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_traced_tol_and_min_iters_compile_once(impl):
  w, h0, x = problem(24)
  traces = []

  def counted(p, h, x_):
    traces.append(1)
    return contraction(p, h, x_)

  @jax.jit
  def run(tol, min_iters):
    return pallas_loop.iterate(counted, w, h0, x, iters=50, max_iters=50, tol=tol,
                               min_iters=min_iters, return_info=True,
                               options=cases.IMPLEMENTATIONS[impl])[1].steps

  for tol, m in ((1e-3, 0), (1e-5, 10), (1e-2, 30)):
    want = reference.iterate(contraction, w, h0, x, iters=50, max_iters=50, tol=tol,
                             min_iters=m, return_info=True)[1].steps
    np.testing.assert_array_equal(run(jnp.float32(tol), jnp.int32(m)), want)
  assert len(traces) <= 2 * 2, "new tol/min_iters values must not retrace"


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bf16_state_float32_residual(impl):
  w, h0, x = problem(dtype=jnp.bfloat16)
  kw = dict(iters=40, max_iters=40, tol=2e-2)
  got, info = pallas_loop.iterate(contraction, w, h0, x, return_info=True,
                                  **kw, options=cases.IMPLEMENTATIONS[impl])
  want, ref_info = reference.iterate(contraction, w, h0, x, return_info=True, **kw)
  want_f32 = reference.iterate(contraction, *oracle.to_f32((w, h0, x)), **kw)
  assert got.dtype == jnp.bfloat16 and info.residual.dtype == jnp.float32
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  oracle.assert_trees_close(got, want, want_f32)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_row_runs_to_its_budget(impl):
  w, h0, x = problem(16)
  x = {"rate": x["rate"], "bias": x["bias"].at[3].set(jnp.nan)}
  got, info = pallas_loop.iterate(contraction, w, h0, x, iters=30, max_iters=30, tol=1e-4,
                                  return_info=True, options=cases.IMPLEMENTATIONS[impl])
  assert info.steps[3] == 30 and not info.halted[3] and np.isnan(info.residual[3])
  others = np.arange(16) != 3
  assert np.all(info.halted[others]) and np.all(np.isfinite(got[others]))


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_through_the_applied_steps(impl):
  w, h0, x = problem(20)
  budget = jnp.where(jnp.arange(20) % 4 == 0, 3, 40)
  kw = dict(iters=budget, max_iters=40, tol=1e-3, min_iters=2)

  def loss(run, w, h0, x):
    return jnp.sum(jnp.sin(run(contraction, w, h0, x, **kw)))

  run = functools.partial(pallas_loop.iterate,
                          options=cases.IMPLEMENTATIONS[impl].replace(block_rows=8))
  got = jax.grad(functools.partial(loss, run), argnums=(0, 1, 2))(w, h0, x)
  want = jax.grad(functools.partial(loss, reference.iterate), argnums=(0, 1, 2))(w, h0, x)
  oracle.assert_trees_close(got, want, what="gradient")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("criterion", ["tol", "relative_change", "below"])
def test_halting_kernel_lowers(platform, criterion):
  w, h0, x = problem(64)
  opts = {"tol": dict(tol=1e-4, min_iters=3),
          "relative_change": dict(halt=halting.relative_change(1e-3)),
          "below": dict(halt=halting.below(lambda p, hn, h, x: halting.row_rms(hn), 0.5),
                        tol=1e-4)}[criterion]
  f = lambda w, h0, x: pallas_loop.iterate(contraction, w, h0, x, iters=40, max_iters=40,
                                           return_info=True, **opts,
                                           options=pallas_loop.Options(implementation="pallas",
                                                                       interpret=False))
  text = lowering.export_text(f, w, h0, x, platform=platform)
  assert lowering.kernel_marker(platform) in text


def test_criteria_helpers():
  h = jnp.array([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]])
  h_new = jnp.array([[1.01, 1.0], [2.5, 2.0], [0.0, 1e-9]])
  np.testing.assert_allclose(halting.row_rms(h), [1.0, 2.0, 0.0])
  np.testing.assert_array_equal(halting.relative_change(0.02)(None, h_new, h, None),
                                [True, False, False])
  np.testing.assert_array_equal(halting.relative_change(0.02, atol=1e-6)(None, h_new, h, None),
                                [True, False, True])
  big = halting.below(lambda p, hn, h, x: jnp.max(hn, axis=-1), 1.5)
  np.testing.assert_array_equal(big(None, h_new, h, None), [True, False, True])
  np.testing.assert_array_equal(
      halting.any_of(halting.relative_change(0.02), big)(None, h_new, h, None), [True, False, True])
  with pytest.raises(ValueError, match="must be >= 0"):
    halting.relative_change(-1.0)
  with pytest.raises(ValueError, match="at least one"):
    halting.any_of()


@pytest.mark.parametrize("kw,error,match", [
    (dict(tol=-1.0), ValueError, "tol=-1.0 must be >= 0"),
    (dict(tol=jnp.ones(3)), ValueError, r"tol.shape=\(3,\) must be \(\)"),
    (dict(tol="small"), TypeError, "tol must be a real number"),
    (dict(halt=3), TypeError, "halt must be callable"),
    (dict(halt=lambda p, hn, h, x: jnp.ones((40, 16), bool)), TypeError, r"bool\[40\], one flag per row"),
    (dict(halt=lambda p, hn, h, x: jnp.ones((40,))), TypeError, r"got float32\[40\]"),
    (dict(tol=1e-3, min_iters=-1), ValueError, "min_iters=-1 must be >= 0"),
    (dict(tol=1e-3, min_iters=1.5), TypeError, "min_iters must be an int"),
])
def test_bad_halting_arguments(kw, error, match):
  w, h0, x = problem()
  with pytest.raises(error, match=match):
    pallas_loop.iterate(contraction, w, h0, x, iters=5, max_iters=5, **kw)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_iters_defaults_to_max_iters(impl):
  # A deep-equilibrium call: the budget is spelled once, halting on tol.
  step, params, h0, x = blocks.make("deq", 19, 16)
  kw = dict(max_iters=40, tol=1e-4, return_info=True)
  got, info = pallas_loop.iterate(step, params, h0, x, **kw, options=cases.IMPLEMENTATIONS[impl])
  want, want_info = reference.iterate(step, params, h0, x, **kw)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, want_info.steps)
  explicit = pallas_loop.iterate(step, params, h0, x, iters=40,
                                 **kw, options=cases.IMPLEMENTATIONS[impl])[0]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(explicit))
