"""pallas_loop.deq: per-row solvers against an independent numpy solver, implicit
gradients of the map against unrolled and dense-formula gradients, the failure policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import deq

B, D = 6, 8


def _layer(params, h, x):
  w, u = params
  return jnp.tanh(h @ w + x @ u)


def _problem(radius=1.2, x_scale=0.3, seed=0, batch=B):
  """A tanh layer whose W has spectral radius `radius` (> 1: not a contraction)."""
  rng = np.random.RandomState(seed)
  w = rng.randn(D, D) / np.sqrt(D)
  w *= radius / np.max(np.abs(np.linalg.eigvals(w)))
  u = rng.randn(D, D) / np.sqrt(D)
  x = x_scale * rng.randn(batch, D)
  return (jnp.asarray(w, jnp.float32), jnp.asarray(u, jnp.float32)), jnp.asarray(x, jnp.float32)


# ---------------------------------------------------------------------------
# An independent solver: numpy, float64, one row at a time, plain Python loop.

def _np_solve(fmap_row, z0, *, m, beta, tol, max_steps, ridge=1e-8):
  """Anderson (m >= 1; m = 1 is damped iteration) on one row; returns (z*, steps, converged)."""
  z = np.asarray(z0, np.float64)
  zs, fs = [], []
  for k in range(1, max_steps + 1):
    fz = fmap_row(z)
    if np.sqrt(np.mean((fz - z) ** 2)) <= tol:
      return fz, k, True
    zs, fs = ([z] + zs)[:m], ([fz] + fs)[:m]
    g = np.stack([f - zz for zz, f in zip(zs, fs)])
    a = g @ g.T
    scale = np.max(np.diag(a))
    a = a / (scale if scale > 0 else 1.0) + ridge * np.eye(len(zs))
    w = np.linalg.solve(a, np.ones(len(zs)))
    alpha = w / w.sum()
    z = sum(al * (zz + beta * gg) for al, zz, gg in zip(alpha, zs, g))
  return z, max_steps, False


def _np_layer_row(params, x_row):
  w, u = (np.asarray(p, np.float64) for p in params)
  xu = np.asarray(x_row, np.float64) @ u
  return lambda z: np.tanh(z @ w + xu)


@pytest.mark.parametrize("solver,m,beta", [
    (deq.Anderson(m=4), 4, 1.0),
    (deq.Anderson(m=3, beta=0.7), 3, 0.7),
    (deq.Damped(0.5), 1, 0.5),
])
def test_solver_matches_numpy_per_row(solver, m, beta):
  params, x = _problem()
  tol, max_steps = 1e-5, 80
  h, info = deq.fixed_point(_layer, params, jnp.zeros((B, D)), x, solver=solver, tol=tol,
                            max_steps=max_steps, on_failure="ignore", return_info=True)
  for i in range(B):
    want, steps, converged = _np_solve(_np_layer_row(params, x[i]), np.zeros(D), m=m, beta=beta,
                                       tol=tol, max_steps=max_steps)
    assert bool(info.converged[i]) == converged, i
    # float32 against float64: the trajectories agree to rounding, so the
    # halting step may move by one when a residual lands next to tol.
    assert abs(int(info.steps[i]) - steps) <= 1, (i, int(info.steps[i]), steps)
    if converged:
      np.testing.assert_allclose(h[i], want, atol=3e-5)
  # The problem is the intended one: plain iteration does not solve every row.
  _, plain = deq.fixed_point(_layer, params, jnp.zeros((B, D)), x, solver=deq.Damped(1.0),
                             tol=tol, max_steps=max_steps, on_failure="ignore", return_info=True)
  assert int(plain.converged.sum()) < B <= int(info.converged.sum()) + (m == 1) * B


def test_anderson_solves_a_linear_map_with_eigenvalue_above_one():
  """On h = h A + x, Anderson with m >= D is GMRES-like: exact in about D + 1 steps."""
  rng = np.random.RandomState(1)
  q, _ = np.linalg.qr(rng.randn(4, 4))
  a = q @ np.diag([1.5, 0.9, -0.5, 0.2]) @ q.T
  x = rng.randn(3, 4)
  want = x @ np.linalg.inv(np.eye(4) - a)
  h, info = deq.fixed_point(lambda a, h, x: h @ a + x, jnp.asarray(a, jnp.float32),
                            jnp.zeros((3, 4)), jnp.asarray(x, jnp.float32),
                            solver=deq.Anderson(m=6), tol=1e-5, max_steps=30, return_info=True)
  np.testing.assert_allclose(h, want, rtol=1e-4, atol=1e-4)
  assert bool(info.converged.all()) and int(info.steps.max()) <= 8


# ---------------------------------------------------------------------------
# Implicit gradients of the map.

def _dense_implicit_grad(params, x, h_star, g):
  """The implicit-function gradient by dense per-row solves (I - J)^T u = g in numpy."""
  jac = jax.vmap(lambda hr, xr: jax.jacobian(lambda z: _layer(params, z[None], xr[None])[0])(hr))(
      h_star, x)
  jac = np.asarray(jac, np.float64)
  u = np.stack([np.linalg.solve(np.eye(D) - jac[i].T, np.asarray(g[i], np.float64))
                for i in range(len(g))])
  _, vjp = jax.vjp(lambda p, xx: _layer(p, h_star, xx), params, x)
  return vjp(jnp.asarray(u, jnp.float32))


def test_implicit_gradient_non_contractive_matches_dense_formula():
  params, x = _problem()
  g = jnp.asarray(np.random.RandomState(2).randn(B, D), jnp.float32)
  loss = lambda p, xx, h0: jnp.sum(g * deq.fixed_point(_layer, p, h0, xx, tol=1e-6,
                                                      max_steps=150))
  h0 = jnp.zeros((B, D))
  g_params, g_x, g_h0 = jax.grad(loss, argnums=(0, 1, 2))(params, x, h0)
  h_star = deq.fixed_point(_layer, params, h0, x, tol=1e-6, max_steps=150)
  want_params, want_x = _dense_implicit_grad(params, x, h_star, g)
  for got, want in zip(jax.tree.leaves((g_params, g_x)), jax.tree.leaves((want_params, want_x))):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(jnp.max(jnp.abs(want))))
  assert not np.any(np.asarray(g_h0))


def test_implicit_gradient_contraction_matches_unrolled_and_iterate_implicit():
  params, x = _problem(radius=0.6, x_scale=1.0)
  h0 = jnp.zeros((B, D))
  g = jnp.asarray(np.random.RandomState(3).randn(B, D), jnp.float32)

  def unrolled(p, xx):  # a long, converged, plainly differentiated loop
    return jax.lax.fori_loop(0, 200, lambda _, h: _layer(p, h, xx), h0)

  def via_iterate(p, xx):
    return pallas_loop.iterate(_layer, p, h0, xx, max_iters=200, tol=1e-7,
                               grad=pallas_loop.Implicit())

  def via_deq(p, xx):
    return deq.fixed_point(_layer, p, h0, xx, solver=deq.Anderson(m=3), tol=1e-7, max_steps=60)

  grads = {name: jax.grad(lambda p, xx: jnp.sum(g * fn(p, xx)), argnums=(0, 1))(params, x)
           for name, fn in [("unrolled", unrolled), ("iterate", via_iterate), ("deq", via_deq)]}
  for other in ("unrolled", "iterate"):
    for got, want in zip(jax.tree.leaves(grads["deq"]), jax.tree.leaves(grads[other])):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class _AdaptiveDamping(deq.Solver):
  """A user-written solver with its own state: damping per row, grown while the
  residual shrinks and halved when it grows."""

  def init(self, z):
    rows = z.shape[:1]
    return jnp.full(rows, 0.5, z.dtype), jnp.full(rows, jnp.inf, z.dtype)

  def update(self, state, z, fz):
    beta, last = state
    res = jnp.sqrt(jnp.mean(jnp.square(fz - z), axis=-1))
    beta = jnp.where(res < last, jnp.minimum(1.5 * beta, 1.0), 0.5 * beta)
    return z + beta[:, None] * (fz - z), (beta, res)


def test_user_solver_gets_the_implicit_gradient_of_the_map():
  """A custom solver (own state, not differentiable as written) and Anderson give the
  same gradient: that of f at the fixed point, not of the solver's update."""
  params, x = _problem(radius=0.8, x_scale=1.0)
  h0 = jnp.zeros((B, D))
  g = jnp.asarray(np.random.RandomState(4).randn(B, D), jnp.float32)

  def grads(solver):
    loss = lambda p, xx: jnp.sum(g * deq.fixed_point(_layer, p, h0, xx, solver=solver,
                                                     tol=1e-7, max_steps=200))
    return jax.grad(loss, argnums=(0, 1))(params, x)

  for got, want in zip(jax.tree.leaves(grads(_AdaptiveDamping())),
                       jax.tree.leaves(grads(deq.Anderson(m=3)))):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_pytree_state_closure_and_traced_tol_under_jit():
  """A dict state with two leaves and an array closed over by f; tol traced under jit."""
  params, x = _problem()
  w, u = params

  def layer(p, h, xx):  # u is closed over: differentiated like params
    z = jnp.concatenate([h["a"], h["b"].reshape(h["b"].shape[0], -1)], axis=-1)
    out = jnp.tanh(z @ p + xx @ u)
    return {"a": out[:, :3], "b": out[:, 3:].reshape(-1, 5, 1)}

  h0 = {"a": jnp.zeros((B, 3)), "b": jnp.zeros((B, 5, 1))}
  run = jax.jit(lambda p, t: deq.fixed_point(layer, p, h0, x, tol=t, max_steps=80))
  h = run(w, jnp.float32(1e-6))
  flat = jnp.concatenate([h["a"], h["b"][..., 0]], axis=-1)
  want = deq.fixed_point(_layer, params, jnp.zeros((B, D)), x, tol=1e-6, max_steps=80)
  np.testing.assert_allclose(flat, want, atol=1e-5)
  g = jax.grad(lambda p: jnp.sum(run(p, jnp.float32(1e-6))["b"]))(w)
  g_want = jax.grad(lambda p: jnp.sum(deq.fixed_point(
      _layer, (p, u), jnp.zeros((B, D)), x, tol=1e-6, max_steps=80)[:, 3:]))(w)
  np.testing.assert_allclose(g, g_want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_vmap_over_problems_matches_one_batch():
  """vmap of fixed_point over 3 problems of 2 rows = one call on 6 rows (value and grad)."""
  params, x = _problem()
  h0 = jnp.zeros((B, D))
  g = jnp.asarray(np.random.RandomState(5).randn(B, D), jnp.float32)
  solve = lambda p, h, xx: deq.fixed_point(_layer, p, h, xx, tol=1e-6, max_steps=80)
  batched = lambda p: jax.vmap(solve, in_axes=(None, 0, 0))(
      p, h0.reshape(3, 2, D), x.reshape(3, 2, D)).reshape(B, D)
  np.testing.assert_allclose(batched(params), solve(params, h0, x), atol=1e-6)
  g_vmap = jax.grad(lambda p: jnp.sum(g * batched(p)))(params)
  g_flat = jax.grad(lambda p: jnp.sum(g * solve(p, h0, x)))(params)
  for a, b in zip(jax.tree.leaves(g_vmap), jax.tree.leaves(g_flat)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# No silent failure.

def _shift(c, h, x):
  """h + c x: no fixed point where x != 0 (the residual stays |c x|)."""
  return h + c * x


_X_STUCK = jnp.array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])


@pytest.mark.parametrize("jit", [False, True])
def test_warn_policy_is_the_default_eager_and_jit(jit):
  run = lambda: deq.fixed_point(_shift, 1.0, jnp.zeros((3, 2)), _X_STUCK, max_steps=5)
  run = jax.jit(run) if jit else run
  with pytest.warns(deq.NonConvergenceWarning, match=r"1 of 3 rows did not converge in the "
                    r"forward solve \(max_steps=5"):
    jax.block_until_ready(run())
    jax.effects_barrier()


def test_raise_policy_eager_and_jit():
  run = lambda: deq.fixed_point(_shift, 1.0, jnp.zeros((3, 2)), _X_STUCK, max_steps=5,
                                on_failure="raise")
  with pytest.raises(deq.NonConvergenceError, match="1 of 3 rows"):
    jax.block_until_ready(run())
  with pytest.raises(jax.errors.JaxRuntimeError, match="1 of 3 rows did not converge"):
    jax.block_until_ready(jax.jit(run)())


def test_nan_and_ignore_policies():
  h, info = deq.fixed_point(_shift, 1.0, jnp.zeros((3, 2)), _X_STUCK, max_steps=5,
                            on_failure="nan", return_info=True)
  assert np.asarray(info.converged).tolist() == [True, False, True]
  h = np.asarray(h)
  assert np.isnan(h[1]).all() and np.isfinite(h[[0, 2]]).all()
  # "ignore": no warning (the suite turns warnings into errors).
  h = jax.jit(lambda: deq.fixed_point(_shift, 1.0, jnp.zeros((3, 2)), _X_STUCK, max_steps=5,
                                      on_failure="ignore"))()
  jax.effects_barrier()
  np.testing.assert_array_equal(h[1], [5.0, 5.0])


def test_adjoint_failure_reported_and_statistics_delivered():
  """The forward converges; the adjoint gets one step: the user is warned, the
  per-row adjoint statistics reach the callback, and "nan" marks the gradient."""
  params, x = _problem(radius=0.8, x_scale=1.0)
  h0 = jnp.zeros((B, D))
  seen = []
  adjoint = deq.ImplicitAdjoint(solver=deq.Damped(), max_steps=1, tol=1e-9,
                                callback=seen.append)
  loss = jax.jit(lambda p: jnp.sum(deq.fixed_point(_layer, p, h0, x, tol=1e-6, max_steps=100,
                                                   adjoint=adjoint)))
  with pytest.warns(deq.NonConvergenceWarning, match=f"{B} of {B} rows did not converge in the "
                    "adjoint solve"):
    jax.block_until_ready(jax.grad(loss)(params))
    jax.effects_barrier()
  (info,) = seen
  assert np.asarray(info.steps).tolist() == [1] * B and not np.asarray(info.converged).any()
  assert np.all(np.asarray(info.residual) > 0)
  nan_adjoint = deq.ImplicitAdjoint(solver=deq.Damped(), max_steps=1, tol=1e-9, on_failure="nan")
  g = jax.grad(lambda p: jnp.sum(deq.fixed_point(_layer, p, h0, x, tol=1e-6, max_steps=100,
                                                 adjoint=nan_adjoint)))(params)
  assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(g))


def test_bad_options_raise():
  with pytest.raises(ValueError, match="on_failure"):
    deq.fixed_point(_shift, 1.0, jnp.zeros((3, 2)), _X_STUCK, on_failure="silent")
  with pytest.raises(ValueError, match="m=0"):
    deq.Anderson(m=0)
  with pytest.raises(ValueError, match="beta"):
    deq.Damped(0.0)
  with pytest.raises(TypeError, match="floating"):
    deq.fixed_point(_shift, 1, jnp.zeros((3, 2), jnp.int32), _X_STUCK)


# ---------------------------------------------------------------------------
# The Pallas kernel (interpret mode on CPU) runs the same solves.

def test_pallas_matches_xla_forward_and_gradient():
  params, x = _problem()
  h0 = jnp.zeros((B, D))

  def run(impl):
    def loss(p):
      h, info = deq.fixed_point(_layer, p, h0, x, solver=deq.Anderson(m=3), tol=1e-5,
                                max_steps=60, return_info=True,
                                on_failure="raise",
                                options=pallas_loop.Options(implementation=impl))
      return jnp.sum(h ** 2), (h, info)
    return jax.grad(loss, has_aux=True)(params)

  g_p, (h_p, info_p) = run("pallas")
  g_x, (h_x, info_x) = run("xla")
  np.testing.assert_array_equal(info_p.steps, info_x.steps)
  np.testing.assert_allclose(h_p, h_x, atol=1e-6)
  # Anderson's small per-row linear solves amplify the float32 rounding
  # differences of the kernel's and XLA's operation order (9e-5 relative
  # seen on JAX 0.12), forward and adjoint.
  for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_x)):
    np.testing.assert_allclose(a, b, rtol=3e-4, atol=1e-6)


def test_example_trains_a_non_contractive_deq(capsys):
  """examples/deq_training.py --quick: W of spectral radius 1.2, Anderson, both gradients."""
  pytest.importorskip("optax", reason='needs the examples extra: pip install -e ".[examples]"')
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parent.parent / "examples" / "deq_training.py"
  spec = importlib.util.spec_from_file_location("deq_training", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.main(["--quick"]) == 0
  out = capsys.readouterr().out
  assert "spectral radius of W at init: 1.20" in out and "OK" in out
  assert "implicit: loss" in out and "unrolled: loss" in out


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_anderson_forward_and_adjoint_lower_to_kernels(platform):
  """Exported (not compiled) for an H200 / a TPU v5e: the forward and the adjoint
  solve are both Pallas kernels, not an XLA fallback."""
  from tests import lowering
  params = (0.5 * jnp.eye(32), jnp.eye(32))
  h0, x = jnp.zeros((64, 32)), jnp.ones((64, 32))

  def grad(p, h0, x):
    return jax.grad(lambda p: jnp.sum(deq.fixed_point(
        _layer, p, h0, x, solver=deq.Anderson(m=5), tol=1e-5, max_steps=50, on_failure="ignore",
        options=pallas_loop.Options(implementation="pallas", interpret=False))))(p)

  text = lowering.export_text(grad, params, h0, x, platform=platform)
  assert text.count(lowering.TARGETS[platform][2]) == 2
