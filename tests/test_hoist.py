"""Loop-invariant hoisting (`iterate(hoist=True)`, `_src/step/hoist.py`).

Hoisting moves the step's state-independent work (e.g. `x @ U`) out of the
loop; results must match the reference and `hoist=False`, for every gradient
mode and extra (key, step index, halting, per-step outputs, per-example
steps, vmap), and the kernels' traced step must no longer hold that work.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop import random as plrandom
from pallas_loop._src import dispatch
from pallas_loop._src.step import hoist
from pallas_loop._src.step import step_fn as step_fn_lib
from benchmarks import blocks
from tests import cases
from tests import oracle

IMPLS = ("xla", "pallas")
B, D = 19, 16


def softplus_gate(params, h, x):
  """A step whose invariant parts are row-independent (softplus(params))
  and per-row (x * exp(scale))."""
  w, a, scale = params
  gate = jax.nn.softplus(a)
  return jnp.tanh(h @ w) * gate + x * jnp.exp(scale)


def keyed_step(params, h, x, *, key):
  """x @ U is invariant; the dropout mask depends on the key: stays in."""
  w, u = params
  return jnp.tanh(plrandom.dropout(key, h @ w, 0.25) + x @ u)


def indexed_step(params, h, x, *, index):
  """params[index] @ x depends on the step index: stays in; x @ u is hoisted."""
  ws, u = params
  return jnp.tanh(h @ ws[index] + x @ u + x @ ws[index])


def _make(name, batch=B, d=D, dtype=jnp.float32):
  """(step, params, h0, x, extra iterate kwargs)."""
  if name in ("tanh_rnn", "gru", "lstm", "deq"):
    return (*blocks.make(name, batch, d, dtype), {})
  k = jax.random.split(jax.random.key(1), 5)
  h0 = jax.random.normal(k[0], (batch, d), dtype)
  x = jax.random.normal(k[1], (batch, d), dtype)
  w = (0.4 / np.sqrt(d)) * jax.random.normal(k[2], (d, d), dtype)
  u = (1.0 / np.sqrt(d)) * jax.random.normal(k[3], (d, d), dtype)
  if name == "softplus":
    return softplus_gate, (w, jax.random.normal(k[4], (d,), dtype), jnp.asarray(-0.5, dtype)), \
        h0, x, {}
  if name == "keyed":
    return keyed_step, (w, u), h0, x, {"key": jax.random.key(7)}
  if name == "indexed":
    ws = (0.4 / np.sqrt(d)) * jax.random.normal(k[4], (cases.MAX_ITERS, d, d), dtype)
    return indexed_step, (ws, u), h0, x, {"step_index": True}
  raise ValueError(name)


STEPS = ("tanh_rnn", "gru", "lstm", "softplus", "keyed", "indexed")


def _loss(run, step, extra, params, h0, x, n):
  out = run(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS, **extra)
  return sum(jnp.sum(jnp.sin(jnp.arange(leaf.size, dtype=jnp.float32).reshape(leaf.shape))
                     * leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))


def _grads(run, step, extra, params, h0, x, n):
  return jax.grad(functools.partial(_loss, run, step, extra), argnums=(0, 1, 2))(
      params, h0, x, n)


def _run(impl, hoist_on=True, **kw):
  options = cases.IMPLEMENTATIONS[impl].replace(block_rows=8, hoist=hoist_on)
  return functools.partial(pallas_loop.iterate, **kw, options=options)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", STEPS)
def test_forward_and_grad_match_reference(request, impl, name):
  if name == "indexed" and impl == "pallas":
    # Untied weights: every compiled backend declines the backward (and so
    # does interpret mode, `tests/test_step_index.py`); its logic is checked
    # with the TPU's rules lifted.
    request.getfixturevalue("tpu_step_rules_lifted")
  step, params, h0, x, extra = _make(name)
  n = cases.counts("ragged", B)
  got = _run(impl)(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS, **extra)
  want = reference.iterate(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                           **extra)
  oracle.assert_trees_close(got, want)
  oracle.assert_trees_close(_grads(_run(impl), step, extra, params, h0, x, n),
                            _grads(reference.iterate, step, extra, params, h0, x, n),
                            what="gradient")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["tanh_rnn", "gru", "softplus"])
def test_hoisted_equals_unhoisted(impl, name):
  """Forward bit for bit (the same ops on the same values); gradients to
  rounding (the hoisted part's gradient is one batched product outside)."""
  step, params, h0, x, extra = _make(name)
  n = cases.counts("one_long_per_tile", B)
  on = _run(impl, True)(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  off = _run(impl, False)(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  jax.tree.map(np.testing.assert_array_equal, on, off)
  oracle.assert_trees_close(_grads(_run(impl, True), step, extra, params, h0, x, n),
                            _grads(_run(impl, False), step, extra, params, h0, x, n),
                            what="gradient")


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_equals_eager(impl):
  step, params, h0, x, _ = _make("gru")
  n = cases.counts("ragged", B)
  run = lambda p, h, x_: _run(impl)(step, p, h, x_, iters=n, max_iters=cases.MAX_ITERS)
  oracle.assert_trees_close(jax.jit(run)(params, h0, x), run(params, h0, x))


@pytest.mark.parametrize("mode", [pallas_loop.Full(), pallas_loop.Truncated(2),
                                  pallas_loop.Phantom(2), pallas_loop.Implicit()])
@pytest.mark.parametrize("impl", IMPLS)
def test_grad_modes(impl, mode):
  """Every mode: against the reference where it has the mode, else against
  hoist=False (Implicit and Phantom)."""
  step, params, h0, x = blocks.make("deq", B, D)
  n = cases.counts("ragged", B)
  extra = {"grad": mode}
  if isinstance(mode, (pallas_loop.Implicit, pallas_loop.Phantom)):
    extra["tol"] = 1e-6
    n = jnp.full((B,), cases.MAX_ITERS, jnp.int32).at[0].set(0)
  got = _grads(_run(impl), step, extra, params, h0, x, n)
  ref = mode.reference_grad()
  if ref is None:
    want = _grads(_run(impl, False), step, extra, params, h0, x, n)
  else:
    kw = {**ref, **{k: v for k, v in extra.items() if k == "tol"}}
    want = _grads(reference.iterate, step, kw, params, h0, x, n)
  oracle.assert_trees_close(got, want, what="gradient")


def test_halt_outputs_per_example_and_vmap():
  """halt= and step_outputs=True (XLA), a per-example step, and vmap."""
  step, params, h0, x, _ = _make("tanh_rnn")
  n = cases.counts("ragged", B)
  halt = lambda p, h_new, h, x_: jnp.max(jnp.abs(h_new - h), axis=-1) < 0.3
  kw = {"iters": n, "max_iters": cases.MAX_ITERS, "halt": halt}
  oracle.assert_trees_close(_run("xla")(step, params, h0, x, **kw),
                            reference.iterate(step, params, h0, x, **kw))

  with_y = lambda p, h, x_: (step(p, h, x_), jnp.sum(x_ @ p[1], axis=-1))
  on = _run("xla")(with_y, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                   step_outputs=True)
  off = _run("xla", False)(with_y, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                           step_outputs=True)
  jax.tree.map(np.testing.assert_array_equal, on, off)

  one_row = lambda p, h, x_: jnp.tanh(h @ p[0] + x_ @ p[1] + p[2])
  per_example = _run("pallas")(one_row, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                               per_example=True)
  oracle.assert_trees_close(per_example, reference.iterate(
      step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS))

  hs, xs = jnp.stack([h0, -h0]), jnp.stack([x, 0.5 * x])
  batched = jax.vmap(lambda h, x_: _run("pallas")(step, params, h, x_, iters=n,
                                                  max_iters=cases.MAX_ITERS))(hs, xs)
  for i in range(2):
    oracle.assert_trees_close(batched[i], reference.iterate(
        step, params, hs[i], xs[i], iters=n, max_iters=cases.MAX_ITERS))


def _count(jaxpr, name="dot_general"):
  """Equations named `name` in `jaxpr`, nested jaxprs included."""
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      total += _count(sub, name)
  return total


def _kernel_plans(hoist_on):
  step, params, h0, x = blocks.make("tanh_rnn", 32, D)
  n = cases.counts("ragged", 32)
  loss = lambda p, x_: jnp.sum(_run("pallas", hoist_on)(step, p, h0, x_, iters=n,
                                                       max_iters=cases.MAX_ITERS))
  with dispatch.observe_plans() as seen:
    jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x)
  plans = {what: p for what, _, p in seen}
  return plans["forward"], plans["backward"]


def test_kernel_body_loses_the_invariant_dot():
  """tanh(h W + x U + b): the kernels' step holds h @ W only (2 dots -> 1);
  its VJP, which the backward kernel evaluates, 6 dots -> 3 (x U and its
  transposes for dU and dx leave)."""
  for hoist_on, dots, vjp_dots in ((False, 2, 6), (True, 1, 3)):
    forward, backward = _kernel_plans(hoist_on)
    assert _count(forward.traced.jaxpr) == dots
    traced = backward.tile.traced
    assert _count(traced.jaxpr) == dots

    def vjp(consts, flat, jaxpr=traced.jaxpr):
      f = lambda cs, a: jax.core.eval_jaxpr(jaxpr, cs, *a)[0]
      out, pull = jax.vjp(f, consts, flat)
      return pull(jnp.ones_like(out))

    flat = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in traced.jaxpr.invars]
    consts = [jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c))
              for c in traced.const_values]
    jaxpr = jax.make_jaxpr(vjp)(consts, flat).jaxpr
    assert _count(jaxpr) == vjp_dots  # the step's dots and their transposes


def test_split_decisions(caplog):
  """What is hoisted, and why a step runs unhoisted (logged)."""
  body = lambda step: step_fn_lib.with_halt(step, None)
  h0, x = jnp.ones((8, 4)), jnp.ones((8, 3))
  u = jnp.ones((3, 4))

  _, d = hoist.split(body(lambda p, h, x_: jnp.tanh(h + x_ @ p)), u, h0, x)
  assert d.hoisted and [a.shape for a in d.per_row] == [(8, 4)] and not d.shared

  _, d = hoist.split(body(lambda p, h, x_: h * jax.nn.softplus(p)), jnp.ones(4), h0, x)
  assert d.hoisted and [a.shape for a in d.shared] == [(4,)] and not d.per_row

  # A broadcast of x is cheap: recomputed in the loop, never a large input.
  big = lambda p, h, x_: h + jnp.sum(jnp.broadcast_to(x_[:, :, None], (8, 3, 64)) * p, (1, 2))[:, None]
  _, d = hoist.split(body(big), jnp.ones(64), h0, x)
  assert d.per_row == () or all(np.prod(a.shape[1:]) <= 7 for a in d.per_row)

  # A constant (attention's `jnp.sqrt(d)` scaling) is no residual: the kernels
  # compute it while tracing; as a parameter its gradient would be a scalar sum.
  scaled = lambda p, h, x_: h + jnp.tanh(x_ @ p) / jnp.sqrt(4.0).astype(h.dtype)
  _, d = hoist.split(body(scaled), u, h0, x)
  assert d.hoisted and not d.shared and [a.shape for a in d.per_row] == [(8, 4)]

  # A result whose row axis is not leading stays in the loop.
  trailing = lambda p, h, x_: h + jnp.tanh(jnp.einsum("bi,ij->jb", x_, p)).T
  hoisted, d = hoist.split(body(trailing), u, h0, x)
  assert hoisted is None and "worth" in d.reason

  with caplog.at_level(logging.DEBUG, logger="pallas_loop"):
    def printing(p, h, x_):
      jax.debug.print("{}", h[0, 0])
      return h + x_ @ p
    hoisted, d = hoist.split(body(printing), u, h0, x)
  assert hoisted is None and d.reason == "the step has effects"
  assert "the step has effects" in caplog.text

  # The key and the step index make their dependents variant.
  keyed = step_fn_lib.with_halt(
      lambda p, h, x_, *, key: h * plrandom.uniform(key, h.shape) + jnp.exp(x_ @ p), None,
      keys=lambda t, rows: plrandom.step_keys(jnp.zeros((1, 2), jnp.uint32), rows, t))
  _, d = hoist.split(keyed, u, h0, x)
  assert [a.shape for a in d.per_row] == [(8, 4)]


def test_hoist_false_is_todays_loop():
  """hoist=False leaves the step alone: its operands and jaxpr are the user's."""
  for hoist_on, has_u in ((False, True), (True, False)):
    forward, _ = _kernel_plans(hoist_on)
    shapes = [tuple(v.aval.shape) for v in forward.traced.jaxpr.invars]
    assert ((D, D) in shapes and shapes.count((D, D)) == 2) == has_u


_SHARDED = r'''
import functools, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_num_cpu_devices", 8)
import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop._src import dispatch
from tests import hlo, oracle

def step(params, h, x):
  w, u, b = params
  return jnp.tanh(h @ w + x @ u + jax.nn.softplus(b))

k = jax.random.split(jax.random.key(0), 5)
B, D = 48, 8
params = (0.3 * jax.random.normal(k[0], (D, D)), jax.random.normal(k[1], (D, D)),
          jax.random.normal(k[2], (D,)))
h0, x = jax.random.normal(k[3], (B, D)), jax.random.normal(k[4], (B, D))
n = jnp.arange(B, dtype=jnp.int32) % 6
rows = NamedSharding(jax.make_mesh((8,), ("rows",)), P("rows"))
s_h0, s_x, s_n = jax.device_put((h0, x, n), rows)
for impl in ("xla", "pallas"):
  options = pallas_loop.Options(implementation=impl, interpret=True if impl == "pallas" else None,
                                block_rows=4)
  run = functools.partial(pallas_loop.iterate, max_iters=5, options=options)
  forward = jax.jit(lambda p, h, x_, n_: run(step, p, h, x_, iters=n_))
  with dispatch.observe_plans() as seen:
    got = forward(params, s_h0, s_x, s_n)
  for _, _, plan in seen:  # the kernel's step: h @ w only, x @ u was hoisted
    assert [e.primitive.name for e in plan.traced.jaxpr.eqns].count("dot_general") == 1
  assert len(seen) == (impl == "pallas")
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, iters=n, max_iters=5))
  assert got.sharding.spec == P("rows", None), got.sharding
  assert hlo.collectives(forward.lower(params, s_h0, s_x, s_n).compile().as_text()) == {}
  loss = lambda run_, p, h, x_, n_: jnp.sum(jnp.sin(run_(step, p, h, x_, iters=n_)))
  grads = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1, 2)))
  want = jax.grad(functools.partial(loss, functools.partial(reference.iterate, max_iters=5)),
                  argnums=(0, 1, 2))(params, h0, x, n)
  oracle.assert_trees_close(grads(params, s_h0, s_x, s_n), want, what="gradients")
  found = hlo.collectives(grads.lower(params, s_h0, s_x, s_n).compile().as_text())
  assert set(found) <= {"all-reduce"}, found  # parameter gradients summed, no gather
print("sharded hoisting OK")
'''


def test_sharded_rows_with_hoisting():
  """Rows over 8 CPU devices (a fresh process: the device count is fixed at
  JAX's start): the hoisted x @ U runs on each device's rows, no collective
  in the forward, gradients match the reference."""
  root = pathlib.Path(__file__).resolve().parent.parent
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _SHARDED], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and "sharded hoisting OK" in result.stdout, (
      result.stdout + result.stderr)
