"""The gradient modes (`grad=`) against their oracles, on every implementation.

Full(checkpoint_every) and Truncated(k): `jax.grad` of `reference.iterate`
(Truncated by `stop_gradient`). Phantom(k): `jax.grad` of k steps unrolled
with the reference from the stopped-gradient output. Implicit: the closed form
of a linear contraction and full backprop at convergence. Memory: the
compiled temporary memory of `jit(grad(...))`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from tests import cases
from tests import oracle

MAX = cases.MAX_ITERS
slow = pytest.mark.slow
# The TPU-semantics interpreter is the slowest: the full sweep only.
IMPLS = ("xla", "pallas", pytest.param("pallas_tpu_interpret", marks=slow))


def _grads(run, step, params, h0, x, **kw):
  """Gradients w.r.t. (params, h0, x) of a fixed non-uniform linear loss."""

  def loss(p, h, x_):
    out = run(step, p, h, x_, **kw)
    return sum(jnp.sum(jnp.cos(jnp.arange(leaf.size, dtype=jnp.float32).reshape(leaf.shape))
                       * leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))

  return jax.grad(loss, argnums=(0, 1, 2))(params, h0, x)


def _iterate(impl, block_rows=None, **extra):
  return functools.partial(pallas_loop.iterate, **extra,
                           options=cases.IMPLEMENTATIONS[impl].replace(block_rows=block_rows))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("every", [pytest.param(1, marks=slow), 2,
                                   pytest.param(4, marks=slow), None])
def test_full_checkpointed_matches_reference(impl, every):
  step, params, h0, x = blocks.make("lstm", 19, 16)
  n = cases.counts("ragged", 19, seed=2)
  got = _grads(_iterate(impl, block_rows=8), step, params, h0, x, iters=n, max_iters=MAX,
               grad=pallas_loop.Full(checkpoint_every=every))
  want = _grads(reference.iterate, step, params, h0, x, iters=n, max_iters=MAX)
  oracle.assert_trees_close(got, want, what="gradient")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [1, pytest.param(3, marks=slow), MAX + 2])
@pytest.mark.parametrize("pattern", ["ragged", pytest.param("one_long_per_tile", marks=slow)])
def test_truncated_matches_reference_with_stop_gradient(impl, k, pattern):
  step, params, h0, x = blocks.make("tanh_rnn", 19, 16)
  n = cases.counts(pattern, 19)
  mode = pallas_loop.Truncated(k)
  got = _grads(_iterate(impl, block_rows=8), step, params, h0, x, iters=n, max_iters=MAX,
               grad=mode)
  want = _grads(reference.iterate, step, params, h0, x, iters=n, max_iters=MAX, truncate=k)
  oracle.assert_trees_close(got, want, what="gradient")
  # Rows that applied more than k steps get no gradient w.r.t. h0.
  g_h0 = np.asarray(got[1])
  assert np.all(g_h0[np.asarray(n) > k] == 0)
  assert np.all(np.any(g_h0[np.asarray(n) <= k] != 0, axis=1))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_truncated_with_halting(impl):
  """The last k steps are those each row applied before tol stopped it."""
  step, params, h0, x = blocks.make("deq", 16, 16)
  kw = dict(iters=40, max_iters=40, tol=1e-3)
  got = _grads(_iterate(impl), step, params, h0, x, grad=pallas_loop.Truncated(3), **kw)
  want = _grads(reference.iterate, step, params, h0, x, truncate=3, **kw)
  oracle.assert_trees_close(got, want, what="gradient")


def _unrolled_phantom(k, n, max_iters):
  """Oracle: k steps unrolled with the reference from stop_gradient(h*)."""

  def run(step, p, h, x_, **_):
    h_star = jax.lax.stop_gradient(reference.iterate(step, p, h, x_, iters=n, max_iters=max_iters))
    unrolled = reference.iterate(step, p, h_star, x_, iters=jnp.minimum(n, k), max_iters=k)
    return jnp.where((n == 0)[:, None], h, unrolled)

  return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [1, 4])
def test_phantom_matches_unrolled_oracle(impl, k):
  step, params, h0, x = blocks.make("tanh_rnn", 19, 16)
  n = cases.counts("ragged", 19, seed=3)
  got_h = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=MAX,
                              grad=pallas_loop.Phantom(k), options=cases.IMPLEMENTATIONS[impl])
  oracle.assert_trees_close(got_h, reference.iterate(step, params, h0, x, iters=n, max_iters=MAX))
  got = _grads(_iterate(impl, block_rows=8), step, params, h0, x, iters=n, max_iters=MAX,
               grad=pallas_loop.Phantom(k))
  want = _grads(_unrolled_phantom(k, n, MAX), step, params, h0, x)
  oracle.assert_trees_close(got, want, what="gradient")


def _linear(a, h, x):
  return h @ a.T + x


@pytest.mark.parametrize("impl", IMPLS)
def test_implicit_linear_closed_form(impl):
  """f(h) = A h + x, ||A|| < 1: dL/dx = (I - A)^-T g, dL/dA = u h*^T, dL/dh0 = 0."""
  d, batch = 16, 8
  a = jax.random.normal(jax.random.key(0), (d, d)) * 0.4 / np.sqrt(d)
  x = jax.random.normal(jax.random.key(1), (batch, d))
  h0 = jax.random.normal(jax.random.key(2), (batch, d))
  g = jax.random.normal(jax.random.key(3), (batch, d))
  n = jnp.array([0, 200, 200, 200, 200, 200, 200, 200], jnp.int32)
  mode = pallas_loop.Implicit(tol=1e-7, max_iters=200)

  def loss(a, h, x_):
    out = pallas_loop.iterate(_linear, a, h, x_, iters=n, max_iters=200, tol=1e-7, grad=mode,
                              options=cases.IMPLEMENTATIONS[impl])
    return jnp.sum(g * out)

  g_a, g_h0, g_x = jax.grad(loss, argnums=(0, 1, 2))(a, h0, x)
  eye = np.eye(d)
  h_star = np.linalg.solve(eye - np.asarray(a, np.float64), np.asarray(x, np.float64).T).T
  u = np.linalg.solve((eye - np.asarray(a, np.float64)).T, np.asarray(g, np.float64).T).T
  converged = np.asarray(n) > 0
  np.testing.assert_allclose(g_x[converged], u[converged], atol=2e-5)
  np.testing.assert_allclose(g_a, u[converged].T @ h_star[converged], atol=1e-4)
  np.testing.assert_allclose(g_h0[converged], 0)
  np.testing.assert_allclose(g_h0[~converged], g[~converged])  # no step: output is h0
  np.testing.assert_allclose(g_x[~converged], 0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_implicit_matches_full_backprop_at_convergence(impl):
  step, params, h0, x = blocks.make("deq", 16, 16)
  kw = dict(iters=200, max_iters=200, tol=1e-7)
  got = _grads(_iterate(impl), step, params, h0, x, grad=pallas_loop.Implicit(tol=1e-7), **kw)
  want = _grads(reference.iterate, step, params, h0, x, **kw)
  for i in (0, 2):  # params and x; h0 is forgotten at a fixed point
    for g_, w_ in zip(jax.tree.leaves(got[i]), jax.tree.leaves(want[i])):
      np.testing.assert_allclose(g_, w_, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(got[1], 0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_implicit_defaults_come_from_the_forward(impl):
  step, params, h0, x = blocks.make("deq", 16, 16)
  run = _iterate(impl)

  # The forward's tol is traced (a jit argument).
  implicit = lambda mode: jax.jit(lambda tol: _grads(
      run, step, params, h0, x, max_iters=60, tol=tol, grad=mode))(jnp.float32(1e-5))
  defaults = implicit(pallas_loop.Implicit())
  spelled = implicit(pallas_loop.Implicit(tol=1e-5, max_iters=60))
  for g_, w_ in zip(jax.tree.leaves(defaults), jax.tree.leaves(spelled)):
    np.testing.assert_allclose(g_, w_, rtol=1e-6, atol=1e-7)
  # Without a forward tol the adjoint halts at Implicit.DEFAULT_TOL.
  no_tol = _grads(run, step, params, h0, x, iters=60, max_iters=60, grad=pallas_loop.Implicit())
  spelled = _grads(run, step, params, h0, x, iters=60, max_iters=60,
                   grad=pallas_loop.Implicit(tol=pallas_loop.Implicit.DEFAULT_TOL, max_iters=60))
  for g_, w_ in zip(jax.tree.leaves(no_tol), jax.tree.leaves(spelled)):
    np.testing.assert_allclose(g_, w_, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_implicit_indexed_step_closing_over_a_differentiated_array(impl):
  """grad=Implicit with step_index=True, differentiated w.r.t. an array the
  step closes over: the adjoint applies the step one row at a time, a shape
  the forward never traced (it raised UnexpectedTracerError), and gives the
  gradient of the same array passed through params."""
  d, batch = 8, 6
  w = 0.4 * jax.random.normal(jax.random.key(0), (d, d)) / np.sqrt(d)
  u = 0.3 * jnp.eye(d)
  x = jax.random.normal(jax.random.key(1), (batch, d))
  kw = dict(iters=jnp.array([0, 3, 30, 30, 30, 30]), max_iters=30, tol=1e-5, step_index=True,
            grad=pallas_loop.Implicit(), options=cases.IMPLEMENTATIONS[impl])

  def closed(w, u):
    step = lambda w_, h, x_, *, index: jnp.tanh(h @ w_ + x_ @ u + 0.01 * index.astype(float))
    return jnp.sum(jnp.sin(pallas_loop.iterate(step, w, jnp.zeros((batch, d)), x, **kw)))

  def passed(w, u):
    step = lambda p, h, x_, *, index: jnp.tanh(h @ p[0] + x_ @ p[1] + 0.01 * index.astype(float))
    return jnp.sum(jnp.sin(pallas_loop.iterate(step, (w, u), jnp.zeros((batch, d)), x, **kw)))

  got = jax.grad(closed, argnums=(0, 1))(w, u)
  want = jax.grad(passed, argnums=(0, 1))(w, u)
  for g_, w_ in zip(got, want):
    np.testing.assert_allclose(g_, w_, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", [pallas_loop.Full(), pallas_loop.Truncated(2),
                                  pallas_loop.Phantom(2), pallas_loop.Implicit(max_iters=20)])
def test_modes_under_jit_and_vmap(mode):
  step, params, h0, x = blocks.make("tanh_rnn", 6, 16)
  n = cases.counts("ragged", 6, seed=1)

  def per_example(p, h, x_, k):
    out = pallas_loop.iterate(step, p, h[None], x_[None], iters=k, max_iters=MAX, grad=mode,
                              options=pallas_loop.Options(implementation="xla"))
    return jnp.sum(jnp.tanh(out))

  def batched(p):
    out = pallas_loop.iterate(step, p, h0, x, iters=n, max_iters=MAX, grad=mode,
                              options=pallas_loop.Options(implementation="xla"))
    return jnp.sum(jnp.tanh(out))

  per_row = jax.jit(jax.vmap(jax.grad(per_example), (None, 0, 0, 0)))(params, h0, x, n)
  summed = jax.tree.map(lambda a: jnp.sum(a, axis=0), per_row)
  oracle.assert_trees_close(summed, jax.jit(jax.grad(batched))(params), what="gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_full_memory_grows_like_sqrt_of_max_iters(impl):
  """16x the steps may cost at most 6x the compiled temporary memory."""
  step, params, h0, x = blocks.make("tanh_rnn", 64, 64)

  def temp_bytes(run, max_iters, **kw):
    n = jnp.full((64,), max_iters, jnp.int32)
    loss = lambda p: jnp.sum(run(step, p, h0, x, iters=n, max_iters=max_iters, **kw))
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  run = _iterate(impl)
  small, large = temp_bytes(run, 16), temp_bytes(run, 256)
  assert large <= 6 * small, (small, large)
  # The reference stores every step: it grows ~linearly and ends far above.
  ref_large = temp_bytes(reference.iterate, 256)
  assert ref_large > 4 * large, (ref_large, large)


@pytest.mark.parametrize("bad, error", [
    (lambda: pallas_loop.Truncated(0), ValueError),
    (lambda: pallas_loop.Truncated(2.5), TypeError),
    (lambda: pallas_loop.Phantom(-1), ValueError),
    (lambda: pallas_loop.Full(checkpoint_every=0), ValueError),
    (lambda: pallas_loop.Implicit(tol=0.0), ValueError),
    (lambda: pallas_loop.Implicit(max_iters=1.5), TypeError),
])
def test_bad_mode_arguments(bad, error):
  with pytest.raises(error):
    bad()


def test_unknown_grad_mode_is_rejected():
  with pytest.raises(ValueError, match="Truncated"):
    pallas_loop.iterate(lambda p, h, x: h, None, jnp.ones((2, 4)), iters=1, max_iters=2,
                        grad="truncated")


@pytest.mark.parametrize("impl", tuple(cases.IMPLEMENTATIONS))
@pytest.mark.parametrize("grad", ["full", pallas_loop.Truncated(2), pallas_loop.Implicit(),
                                  pallas_loop.Phantom(2)], ids=repr)
def test_empty_batch(impl, grad):
  """B = 0: every implementation and mode returns empty results and zero
  parameter gradients (the kernels still compile one tile, of padding)."""
  w = 0.5 * jnp.eye(4)
  step = lambda w, h, x: jnp.tanh(h @ w + x)
  empty = jnp.zeros((0, 4))

  def loss(w, h0, x):
    h, info = pallas_loop.iterate(step, w, h0, x, iters=jnp.zeros(0, jnp.int32), max_iters=3,
                                  tol=1e-3, grad=grad, return_info=True,
                                  options=cases.IMPLEMENTATIONS[impl])
    assert h.shape == (0, 4) and info.steps.shape == (0,) and info.halted.shape == (0,)
    return jnp.sum(h)

  g_w, g_h0, g_x = jax.grad(loss, argnums=(0, 1, 2))(w, empty, empty)
  np.testing.assert_array_equal(g_w, np.zeros((4, 4)))
  assert g_h0.shape == (0, 4) and g_x.shape == (0, 4)
