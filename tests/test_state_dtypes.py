"""State leaves of every dtype, in every gradient mode and implementation.

Integer and bool leaves (a per-row step counter, a done flag) are the most
common extra leaves of recurrent-depth models: they are carried through the
loop, may steer the float update, and have no gradient. Each case runs
`jax.grad` eagerly and under `jit`, on the XLA implementation, the kernel (in
interpret mode) and the default choice (whose `jit` traces every platform's
branch, GPU and TPU kernels included), against the oracle of its mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from tests import cases

B, D, MAX = 8, 16, 6
slow = pytest.mark.slow

# Per float dtype of the state: the relative error allowed against the oracle
# (scaled by the largest magnitude of the leaf), a few of the dtype's ulps
# (bfloat16's is 7.8e-3, float16's 9.8e-4): the implementations accumulate
# gradients in float32 where autodiff of the reference accumulates in the
# state's dtype, through every step of the recurrence. The coarsest dtype of
# the state bounds every comparison, float32 gradients of params included.
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 1e-2}
# The implicit gradient is that of the exact fixed point, which the forward
# reaches to its tolerance: as in test_grad_modes' implicit checks.
IMPLICIT_RTOL = 1e-3

# Each state: {leaf name: dtype}. "h" (float) is always updated by the block.
STATES = {
    "float32": {"h": jnp.float32},
    "bfloat16": {"h": jnp.bfloat16},
    "float16": {"h": jnp.float16},
    "int32": {"h": jnp.float32, "count": jnp.int32},
    "bool": {"h": jnp.float32, "done": jnp.bool_},
    "mixed": {"h": jnp.float32, "m": jnp.bfloat16, "s": jnp.float16, "count": jnp.int32,
              "done": jnp.bool_},
}


def _step(w, state, x):
  """A contraction whose float update reads the integer and bool leaves."""
  h = state["h"]
  bias = 0.0
  if "count" in state:  # a saturating counter: constant after 3 steps
    bias = 0.05 * state["count"].astype(h.dtype)[:, None]
  if "done" in state:
    bias = bias + jnp.where(state["done"][:, None], 0.1, -0.1).astype(h.dtype)
  h_new = jnp.tanh(h @ w.astype(h.dtype) + x.astype(h.dtype) + bias)
  new = {"h": h_new}
  for name in ("m", "s"):
    if name in state:
      leaf = state[name]
      new[name] = (0.5 * leaf + 0.25 * h_new[:, :leaf.shape[1]].astype(leaf.dtype)).astype(
          leaf.dtype)
  if "count" in state:
    new["count"] = jnp.minimum(state["count"] + 1, 3)
  if "done" in state:
    new["done"] = jnp.sum(h_new.astype(jnp.float32), axis=1) > 0
  return new


def _inputs(kind):
  keys = jax.random.split(jax.random.key(7), 4)
  w = 0.5 * jax.random.normal(keys[0], (D, D)) / np.sqrt(D)
  x = 0.5 * jax.random.normal(keys[1], (B, D))
  h0 = {}
  for name, dtype in STATES[kind].items():
    if name == "h":
      h0[name] = jax.random.normal(keys[2], (B, D)).astype(dtype)
    elif name in ("m", "s"):
      h0[name] = jax.random.normal(keys[3], (B, 4)).astype(dtype)
    elif name == "count":
      h0[name] = jnp.arange(B, dtype=jnp.int32) % 2
    else:
      h0[name] = jnp.arange(B) % 3 == 0
  return w, h0, x


def _loss(run, **kw):
  """A non-uniform linear loss of the float leaves of the output."""

  def loss(w, h0, x):
    out = run(_step, w, h0, x, **kw)
    return sum(jnp.sum(jnp.cos(jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape))
                       * a.astype(jnp.float32))
               for a in jax.tree.leaves(out) if jnp.issubdtype(a.dtype, jnp.floating))

  return loss


def _phantom_oracle(k, n):
  """k steps unrolled with the reference from stop_gradient(h*)."""

  def run(step, w, h, x, **_):
    h_star = jax.lax.stop_gradient(reference.iterate(step, w, h, x, iters=n, max_iters=MAX))
    unrolled = reference.iterate(step, w, h_star, x, iters=jnp.minimum(n, k), max_iters=k)
    return jax.tree.map(lambda a, b: jnp.where((n == 0).reshape((B,) + (1,) * (a.ndim - 1)),
                                               a, b), h, unrolled)

  return run


def _case(mode_name):
  """(mode, iterate kwargs, oracle loss-maker) for a gradient mode."""
  n = cases.counts("ragged", B, MAX, seed=5)
  if mode_name == "full":
    return "full", dict(iters=n, max_iters=MAX), functools.partial(
        _loss(reference.iterate, iters=n, max_iters=MAX))
  if mode_name == "truncated":
    return pallas_loop.Truncated(2), dict(iters=n, max_iters=MAX), _loss(
        reference.iterate, iters=n, max_iters=MAX, truncate=2)
  if mode_name == "phantom":
    return pallas_loop.Phantom(2), dict(iters=n, max_iters=MAX), _loss(_phantom_oracle(2, n))
  # Implicit: at a fixed point (the map is a contraction), the gradient of
  # full backpropagation through the converged loop.
  kw = dict(max_iters=80, tol=1e-6)
  return pallas_loop.Implicit(), kw, _loss(reference.iterate, **kw)


def _assert_close(got, want, what, rtol=None):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.dtype, w.dtype)
    g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
    scale = max(1.0, float(np.max(np.abs(w64)))) if w64.size else 1.0
    np.testing.assert_allclose(g64, w64, rtol=0, atol=(rtol or RTOL[g.dtype.type]) * scale,
                               err_msg=f"{what} leaf {i}")


IMPLS = {"xla": pallas_loop.Options(implementation="xla"),
         "pallas": cases.IMPLEMENTATIONS["pallas"], "auto": pallas_loop.Options()}
MODES = ("full", "truncated", "phantom", "implicit")


def _kinds():
  # The mixed state (every dtype at once) in the quick set; each dtype alone
  # in the full sweep.
  return [k if k == "mixed" else pytest.param(k, marks=slow) for k in STATES]


@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=slow)], ids=["jit", "eager"])
@pytest.mark.parametrize("impl", tuple(IMPLS))
@pytest.mark.parametrize("mode_name", MODES)
@pytest.mark.parametrize("kind", _kinds())
def test_state_leaf_dtypes_in_every_gradient_mode(kind, mode_name, impl, jit):
  w, h0, x = _inputs(kind)
  mode, kw, oracle_loss = _case(mode_name)
  loss = _loss(functools.partial(pallas_loop.iterate, grad=mode, options=IMPLS[impl]), **kw)
  grad = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)
  if jit:
    grad = jax.jit(grad)
  g_w, g_h0, g_x = grad(w, h0, x)

  # Integer and bool leaves get float0 cotangents, as from any JAX function.
  for name, dtype in STATES[kind].items():
    if not jnp.issubdtype(dtype, jnp.floating):
      assert g_h0[name].dtype == jax.dtypes.float0, (name, g_h0[name].dtype)
  floats = lambda tree: {k: v for k, v in tree.items()
                         if jnp.issubdtype(STATES[kind][k], jnp.floating)}
  want_w, want_h0, want_x = jax.grad(oracle_loss, argnums=(0, 1, 2), allow_int=True)(w, h0, x)
  rtol = max(RTOL[d] for d in STATES[kind].values() if jnp.issubdtype(d, jnp.floating))
  if mode_name == "implicit":
    rtol = max(rtol, IMPLICIT_RTOL)
  _assert_close(g_w, want_w, "g_w", rtol)
  _assert_close(g_x, want_x, "g_x", rtol)
  if mode_name == "implicit":  # h0 is forgotten at a fixed point
    for v in floats(g_h0).values():
      np.testing.assert_array_equal(np.asarray(v, np.float32), 0)
  else:
    _assert_close(floats(g_h0), floats(want_h0), "g_h0", rtol)
  # The forward agrees too (the integer leaves exactly).
  out = pallas_loop.iterate(_step, w, h0, x, grad=mode, **kw, options=IMPLS[impl])
  ref = reference.iterate(_step, w, h0, x, **kw)
  for name, dtype in STATES[kind].items():
    if not jnp.issubdtype(dtype, jnp.floating):
      np.testing.assert_array_equal(out[name], ref[name])
  _assert_close(floats(out), floats(ref), "output")


def test_integer_counter_reproducer():
  """The reported reproducer: jit(grad) with a counter in the state."""
  step = lambda p, h, x: (h[0] + 1, jnp.tanh(h[1] * p + x))
  h0 = (jnp.zeros((4,), jnp.int32), jnp.zeros((4, 3)))
  x = jnp.ones((4, 3))
  want = jax.grad(lambda p: reference.iterate(step, p, h0, x, max_iters=50, tol=1e-6)[1].sum())(
      0.5)
  # The counter keeps every row's update above tol: all 50 steps run, h has
  # converged, and Implicit agrees with full backpropagation.
  for grad in ("full", pallas_loop.Implicit()):
    f = lambda p: pallas_loop.iterate(step, p, h0, x, max_iters=50, tol=1e-6, grad=grad)[1].sum()
    np.testing.assert_allclose(jax.jit(jax.grad(f))(0.5), want, rtol=1e-4)
  for grad in (pallas_loop.Truncated(2), pallas_loop.Phantom(2)):
    f = lambda p: pallas_loop.iterate(step, p, h0, x, max_iters=50, tol=1e-6, grad=grad)[1].sum()
    want_k = jax.grad(lambda p: reference.iterate(step, p, h0, x, max_iters=50, tol=1e-6,
                                                  truncate=2)[1].sum())(0.5)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(0.5), want_k, rtol=1e-4)
