"""ACT (`pallas_loop.halting.act`) against an independent step-by-step loop.

The oracles here are written in this file, not with `iterate` and not with
the library's reference: the forward runs each example alone, one step at a
time, and applies Graves' rule (N = first n with sum_{m<=n} h_m >= 1 - eps,
capped at M; remainder R = 1 - sum_{n<N} h_n on the last step) unit by unit
in numpy; the gradient oracle is `jax.grad` of a fixed-length masked jnp loop
over M steps. Both per example (U = ()) and per token (U = (T,), tokens mix
by attention inside the row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import halting
from pallas_loop import _reference as reference

D, DX, K, T = 8, 4, 3, 5
IMPLS = {"xla": pallas_loop.Options(implementation="xla"),
         "pallas": pallas_loop.Options(implementation="pallas", interpret=True)}


def make_params(seed=0, bias=-1.0):
  k = jax.random.split(jax.random.key(seed), 8)
  n = lambda i, shape, s: s * jax.random.normal(k[i], shape, jnp.float32)
  return {"W": n(0, (D, D), 0.4), "U": n(1, (DX, D), 0.8), "b": n(2, (D,), 0.1),
          "wh": n(3, (D,), 1.0), "bh": jnp.float32(bias), "V": n(4, (D, K), 0.5),
          "Wq": n(5, (D, D), 0.4), "Wk": n(6, (D, D), 0.4)}


# The halting heads are matrix-vector products (`s @ wh`, wh of shape [D]), as
# examples/act.py writes them: on a TPU (and in interpret mode, its rules) the
# kernels compute them as a multiply and a sum (`jaxpr_eval._vector_dot`).


def example_block(p, s, x):
  """One halting decision per row: s [R, D], x [R, DX] -> y [R, K], h [R]."""
  s_new = jnp.tanh(s @ p["W"] + x @ p["U"] + p["b"])
  return s_new, s_new @ p["V"], jax.nn.sigmoid(s_new @ p["wh"] + p["bh"])


def token_block(p, s, x):
  """One halting decision per token: s [R, T, D] (tokens attend to each
  other inside the row), x [R, T, DX] -> y [R, T, K], h [R, T]."""
  q, k = s @ p["Wq"], s @ p["Wk"]
  att = jax.nn.softmax(jnp.einsum("rtd,rsd->rts", q, k) / np.sqrt(D), axis=-1)
  s_new = jnp.tanh(jnp.einsum("rts,rsd->rtd", att, s) @ p["W"] + x @ p["U"] + p["b"])
  return s_new, s_new @ p["V"], jax.nn.sigmoid(s_new @ p["wh"] + p["bh"])


def make_inputs(per_token, batch, seed=1):
  k = jax.random.split(jax.random.key(seed), 2)
  lead = (batch, T) if per_token else (batch,)
  # Rows with inputs of different scale get very different step counts.
  scale = jnp.linspace(0.0, 3.0, batch).reshape((batch,) + (1,) * len(lead))
  x = scale * jax.random.normal(k[0], lead + (DX,), jnp.float32)
  s0 = 0.5 * jax.random.normal(k[1], lead + (D,), jnp.float32)
  return s0, x


# ---------------------------------------------------------------------------
# The independent oracles
# ---------------------------------------------------------------------------


def oracle_forward(block, params, s0, x, max_steps, eps, indexed=False):
  """Each example alone, step by step; Graves' rule applied unit by unit in numpy.
  With `indexed`, step n calls block(..., index=n - 1) (untied layers).

  Returns (output, ponder N + R, N), stacked over examples.
  """
  threshold = np.float32(1.0 - eps)
  outs, ponders, counts = [], [], []
  for i in range(s0.shape[0]):
    s = np.array(s0[i:i + 1])                  # a writable copy
    units = s.shape[1:-1]                       # () per example, (T,) per token
    cum = np.zeros(units, np.float32)
    rem = np.zeros(units, np.float32)
    n_applied = np.zeros(units, np.int32)
    halted = np.zeros(units, bool)
    out = None
    for n in range(1, max_steps + 1):
      if halted.all():
        break
      kw = dict(index=jnp.int32(n - 1)) if indexed else {}
      s_new, y, p = block(params, jnp.asarray(s), x[i:i + 1], **kw)
      s_new, y, p = np.asarray(s_new)[0], np.asarray(y)[0], np.asarray(p, np.float32)[0]
      out = np.zeros_like(y) if out is None else out
      for u in np.ndindex(units):
        if halted[u]:
          continue                              # frozen: state, output, books
        n_applied[u] = n
        if cum[u] + p[u] >= threshold or n == max_steps:
          rem[u] = np.float32(1.0) - cum[u]
          out[u] += rem[u] * y[u]
          halted[u] = True
        else:
          cum[u] += p[u]
          out[u] += p[u] * y[u]
        s[(0,) + u] = s_new[u]
    outs.append(out)
    ponders.append(n_applied + rem)
    counts.append(n_applied)
  return np.stack(outs), np.stack(ponders), np.stack(counts)


def oracle_masked(block, params, s0, x, max_steps, eps, indexed=False):
  """Fixed-length jnp loop over all M steps with masks (differentiable)."""
  s = s0
  units = s0.shape[:-1]
  cum = jnp.zeros(units, jnp.float32)
  rem = jnp.zeros(units, jnp.float32)
  count = jnp.zeros(units, jnp.float32)
  halted = jnp.zeros(units, bool)
  out = 0.0
  for n in range(1, max_steps + 1):
    s_new, y, p = block(params, s, x, **(dict(index=n - 1) if indexed else {}))
    running = ~halted
    stop = running & ((cum + p >= 1.0 - eps) | (n == max_steps))
    weight = jnp.where(stop, 1.0 - cum, jnp.where(running, p, 0.0))
    out = out + weight[..., None] * y
    rem = jnp.where(stop, 1.0 - cum, rem)
    count = jnp.where(running, float(n), count)
    cum = jnp.where(running & ~stop, cum + p, cum)
    s = jnp.where(running[..., None], s_new, s)
    halted = halted | stop
  return out, count + rem


def run_act(block, params, s0, x, max_steps, eps, impl, block_rows=None, **kw):
  a = halting.act(block, max_iters=max_steps, eps=eps)
  h0 = a.init(params, s0, x)
  return pallas_loop.iterate(a.step, params, h0, x, max_iters=a.max_iters, halt=a.halt, **kw,
                             options=IMPLS[impl].replace(block_rows=block_rows))


CASES = {"per_example": (example_block, False), "per_token": (token_block, True)}


# ---------------------------------------------------------------------------
# Forward and gradients
# ---------------------------------------------------------------------------


@functools.cache
def _forward_want(case, max_steps, eps):
  """The oracle's forward for test_forward (shared by its implementations)."""
  block, per_token = CASES[case]
  return oracle_forward(block, make_params(), *make_inputs(per_token, batch=11),
                        max_steps, eps)


@functools.cache
def _grad_want(case, max_steps, eps, tau):
  """The oracle's loss and gradient for test_grad_full (shared by its implementations)."""
  block, per_token = CASES[case]
  params, (s0, x) = make_params(), make_inputs(per_token, batch=7)

  def loss_oracle(params, s0, x):
    out, ponder = oracle_masked(block, params, s0, x, max_steps, eps)
    return jnp.sum(out * _cotangent(s0)) + tau * jnp.sum(ponder)

  return jax.value_and_grad(loss_oracle, argnums=(0, 1, 2))(params, s0, x)


def _cotangent(s0):
  return jax.random.normal(jax.random.key(3), s0.shape[:-1] + (K,))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_forward(case, impl):
  block, per_token = CASES[case]
  params, (s0, x) = make_params(), make_inputs(per_token, batch=11)
  max_steps, eps = 6, 0.01
  h = run_act(block, params, s0, x, max_steps, eps, impl, block_rows=4)
  want_out, want_ponder, want_n = _forward_want(case, max_steps, eps)
  np.testing.assert_array_equal(np.asarray(h.steps), want_n)
  # The inputs give a spread of counts, including the cap, so the test means something.
  assert want_n.min() <= 2 and want_n.max() == max_steps, want_n
  assert len(np.unique(want_n)) >= 3, want_n
  np.testing.assert_allclose(np.asarray(h.ponder_cost), want_ponder, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(h.output), want_out, rtol=1e-5, atol=1e-6)
  assert bool(jnp.all(h.halted))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_grad_full(case, impl):
  block, per_token = CASES[case]
  params, (s0, x) = make_params(), make_inputs(per_token, batch=7)
  max_steps, eps, tau = 5, 0.01, 0.1
  c = _cotangent(s0)

  def loss_iterate(params, s0, x):
    h = run_act(block, params, s0, x, max_steps, eps, impl, grad="full", block_rows=4)
    return jnp.sum(h.output * c) + tau * jnp.sum(h.ponder_cost)

  want_loss, want = _grad_want(case, max_steps, eps, tau)
  got_loss, got = jax.jit(jax.value_and_grad(loss_iterate, argnums=(0, 1, 2)))(params, s0, x)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for g, w, path in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                        jax.tree_util.tree_flatten_with_path(want)[0]):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=str(path[0]))
  # The halting probabilities get a gradient (through the weights and R).
  assert float(jnp.abs(got[0]["wh"]).sum()) > 0 and float(jnp.abs(got[0]["bh"])) > 0


# ---------------------------------------------------------------------------
# The rule itself
# ---------------------------------------------------------------------------


def constant_block(h_value):
  """h_n = h_value every step, y_n = the step number (carried in the state)."""
  def block(params, s, x):
    del params, x
    s_new = s + 1.0
    return s_new, s_new, jnp.full(s.shape[:-1], h_value, jnp.float32)
  return block


@pytest.mark.parametrize("impl", list(IMPLS))
def test_threshold_is_inclusive(impl):
  """h = 0.25, eps = 0.5: sum h reaches 1 - eps = 0.5 exactly at n = 2, so N = 2
  (the paper's >=); the widely copied `> threshold` would take a third step."""
  s0 = jnp.zeros((3, 1))
  h = run_act(constant_block(0.25), None, s0, None, 6, 0.5, impl)
  np.testing.assert_array_equal(h.steps, [2, 2, 2])
  np.testing.assert_array_equal(h.remainder, [0.75] * 3)       # R = 1 - h_1
  np.testing.assert_array_equal(h.ponder_cost, [2.75] * 3)
  # Output = h_1 * y_1 + R * y_2 = 0.25 * 1 + 0.75 * 2.
  np.testing.assert_array_equal(h.output[:, 0], [1.75] * 3)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_cap_takes_the_remainder(impl):
  """Never confident (h = 0.1): the cap M = 4 stops the row, and the last step
  still gets R = 1 - 3 * 0.1, so the weights sum to 1 (the widely copied loop
  leaves them summing to 0.3)."""
  s0 = jnp.zeros((2, 1))
  h = run_act(constant_block(0.1), None, s0, None, 4, 0.01, impl)
  np.testing.assert_array_equal(h.steps, [4, 4])
  np.testing.assert_allclose(h.remainder, [0.7, 0.7], rtol=1e-6)
  np.testing.assert_allclose(h.ponder_cost, [4.7, 4.7], rtol=1e-6)
  np.testing.assert_allclose(h.output[:, 0], [0.1 * (1 + 2 + 3) + 0.7 * 4] * 2, rtol=1e-6)


def test_one_step_when_confident():
  """h_1 >= 1 - eps: N = 1 and R = 1 (the weight of the only step is 1, not h_1)."""
  h = run_act(constant_block(0.995), None, jnp.zeros((2, 1)), None, 5, 0.01, "xla")
  np.testing.assert_array_equal(h.steps, [1, 1])
  np.testing.assert_array_equal(h.remainder, [1.0, 1.0])
  np.testing.assert_array_equal(h.output[:, 0], [1.0, 1.0])


def test_token_halting_is_a_mask_inside_the_row():
  """Per token: a halted token's state stops changing while its row runs on, and
  the row's step count (what `iterate` spends) is its slowest token's N."""
  params, (s0, x) = make_params(), make_inputs(True, batch=6)
  h, info = run_act(token_block, params, s0, x, 6, 0.01, "xla", return_info=True)
  np.testing.assert_array_equal(info.steps, np.asarray(h.steps).max(axis=1))
  assert (np.asarray(h.steps).min(axis=1) < np.asarray(info.steps)).any(), h.steps
  assert bool(jnp.all(info.halted))


def test_invalid_arguments():
  with pytest.raises(ValueError, match="max_iters=0 must be >= 1"):
    halting.act(example_block, max_iters=0)
  with pytest.raises(ValueError, match=r"eps=1.0 must be in \[0, 1\)"):
    halting.act(example_block, max_iters=3, eps=1.0)
  # One vocabulary with iterate: the old keyword names the new one.
  with pytest.raises(TypeError, match=r"act\(\) got max_steps=3: the keyword is now spelled "
                     r"max_iters \(as in pallas_loop.iterate\): act\(\.\.\., max_iters=3\)"):
    halting.act(example_block, max_steps=3)
  with pytest.raises(AttributeError, match=r"ACT.max_steps is now spelled ACT.max_iters"):
    halting.act(example_block, max_iters=3).max_steps


# ---------------------------------------------------------------------------
# Untied layers: a stack of per-step weights read with the step index
# ---------------------------------------------------------------------------


def untied_block(p, s, x, *, index):
  """Scenic's Universal Transformer with share_parameters=False, in small: step n
  (index n - 1) has its own W, read from a stack of M."""
  s_new = jnp.tanh(s @ p["Ws"][index] + x @ p["U"] + p["b"])
  return s_new, s_new @ p["V"], jax.nn.sigmoid(s_new @ p["wh"] + p["bh"])


def _untied_params(max_steps, seed=0):
  params = make_params(seed)
  k = jax.random.split(jax.random.key(seed + 100), max_steps)
  params["Ws"] = jnp.stack([0.4 * jax.random.normal(kk, (D, D)) for kk in k])
  return params


@pytest.mark.parametrize("impl", list(IMPLS))
def test_untied_layers_forward_and_gradient(request, impl):
  """act passes the step index to a block that asks for it: the forward matches the
  step-by-step oracle and the library's reference, the gradient reaches every layer
  of the stack that some row used, against the masked-loop oracle. (Interpret mode
  applies the TPU's rules, which decline the untied backward, `params[index]`'s
  VJP; as in tests/test_step_index.py, the kernel's logic is checked here with those
  rules lifted.)"""
  if impl == "pallas":
    request.getfixturevalue("tpu_step_rules_lifted")
  max_steps, eps, tau = 6, 0.01, 0.1
  params = _untied_params(max_steps)
  s0, x = make_inputs(False, batch=11)
  a = halting.act(untied_block, max_iters=max_steps, eps=eps)
  assert a.step_index and a.max_iters == max_steps
  h0 = a.init(params, s0, x)
  h = pallas_loop.iterate(a.step, params, h0, x, max_iters=a.max_iters, halt=a.halt,
                          step_index=a.step_index, options=IMPLS[impl].replace(block_rows=4))
  want_out, want_ponder, want_n = oracle_forward(untied_block, params, s0, x, max_steps, eps,
                                                 indexed=True)
  np.testing.assert_array_equal(np.asarray(h.steps), want_n)
  assert want_n.min() <= 2 and want_n.max() == max_steps, want_n
  np.testing.assert_allclose(np.asarray(h.ponder_cost), want_ponder, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(h.output), want_out, rtol=1e-5, atol=1e-6)
  ref = reference.iterate(a.step, params, h0, x, max_iters=a.max_iters, halt=a.halt,
                          step_index=True)
  np.testing.assert_allclose(np.asarray(h.output), np.asarray(ref.output), rtol=1e-6, atol=1e-6)
  # A tied run of the same stack's first layer differs: the index is used.
  tied = lambda p, s, x_: untied_block(p, s, x_, index=0)
  a_tied = halting.act(tied, max_iters=max_steps, eps=eps)
  assert not a_tied.step_index
  h_tied = pallas_loop.iterate(a_tied.step, params, h0, x, max_iters=max_steps, halt=a_tied.halt)
  assert not np.allclose(np.asarray(h_tied.output), want_out, atol=1e-3)

  c = _cotangent(s0)

  def loss(params):
    h = pallas_loop.iterate(a.step, params, a.init(params, s0, x), x, max_iters=a.max_iters,
                            halt=a.halt, step_index=True, options=IMPLS[impl].replace(block_rows=4))
    return jnp.sum(h.output * c) + tau * jnp.sum(h.ponder_cost)

  def loss_oracle(params):
    out, ponder = oracle_masked(untied_block, params, s0, x, max_steps, eps, indexed=True)
    return jnp.sum(out * c) + tau * jnp.sum(ponder)

  got, want = jax.jit(jax.grad(loss))(params), jax.grad(loss_oracle)(params)
  for g, w, path in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                        jax.tree_util.tree_flatten_with_path(want)[0]):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=str(path[0]))
  used = np.abs(np.asarray(got["Ws"])).sum(axis=(1, 2)) > 0
  assert used.tolist() == [True] * max_steps, used


def test_untied_block_without_step_index_says_how():
  params = _untied_params(4)
  s0, x = make_inputs(False, batch=3)
  a = halting.act(untied_block, max_iters=4)
  with pytest.raises(TypeError, match=r"block takes the step index \(`index`.*\) but iterate "
                     r"did not pass it: run iterate\(act.step, \.\.\., step_index=True\)"):
    pallas_loop.iterate(a.step, params, a.init(params, s0, x), x, max_iters=4, halt=a.halt)


def test_keyed_block_gets_the_per_row_keys():
  """A block with a `key` parameter gets iterate's per-row keys (stochastic ACT)."""
  def block(p, s, x, *, key):
    s_new, y, h = example_block(p, s, x)
    return pallas_loop.random.dropout(key, s_new, 0.5), y, h
  params, (s0, x) = make_params(), make_inputs(False, batch=5)
  a = halting.act(block, max_iters=4)
  run = lambda k: pallas_loop.iterate(a.step, params, a.init(params, s0, x), x, max_iters=4,
                                      halt=a.halt, key=k).state
  np.testing.assert_array_equal(run(jax.random.key(1)), run(jax.random.key(1)))
  assert not np.allclose(run(jax.random.key(1)), run(jax.random.key(2)))


# ---------------------------------------------------------------------------
# Slow sweep: eps, M, batch sizes that are not a multiple of the tile, modes
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("max_steps,eps,batch,block_rows",
                         [(1, 0.01, 3, 2), (3, 0.1, 9, 4), (8, 0.01, 13, 8), (12, 0.0, 5, 4)])
@pytest.mark.parametrize("bias", [-2.0, 1.0])
def test_forward_sweep(case, impl, max_steps, eps, batch, block_rows, bias):
  block, per_token = CASES[case]
  params, (s0, x) = make_params(seed=batch, bias=bias), make_inputs(per_token, batch, seed=batch)
  h = jax.jit(lambda p, s, x: run_act(block, p, s, x, max_steps, eps, impl,
                                      block_rows=block_rows))(params, s0, x)
  want_out, want_ponder, want_n = oracle_forward(block, params, s0, x, max_steps, eps)
  np.testing.assert_array_equal(np.asarray(h.steps), want_n)
  np.testing.assert_allclose(np.asarray(h.ponder_cost), want_ponder, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(h.output), want_out, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("max_steps,batch", [(2, 3), (9, 10)])
def test_grad_sweep(case, impl, max_steps, batch):
  block, per_token = CASES[case]
  params, (s0, x) = make_params(seed=batch), make_inputs(per_token, batch, seed=batch + 1)
  c = jax.random.normal(jax.random.key(batch), s0.shape[:-1] + (K,))

  def loss(fn):
    def f(params, s0, x):
      out, ponder = fn(params, s0, x)
      return jnp.sum(out * c) + 0.05 * jnp.sum(ponder)
    return f

  def via_iterate(params, s0, x):
    h = run_act(block, params, s0, x, max_steps, 0.01, impl, block_rows=4)
    return h.output, h.ponder_cost

  want = jax.jit(jax.grad(loss(lambda *a: oracle_masked(block, *a, max_steps, 0.01)),
                          argnums=(0, 1, 2)))(params, s0, x)
  got = jax.jit(jax.grad(loss(via_iterate), argnums=(0, 1, 2)))(params, s0, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=5e-5, atol=5e-6)


# ---------------------------------------------------------------------------
# The kernels lower for GPU and TPU (export only: no accelerator needed)
# ---------------------------------------------------------------------------


def wide_example_block(p, s, x):
  """Triton-friendly per-example block: dots of width >= 16, and the halting
  head a row reduction (a dot with one output column would be too narrow)."""
  s_new = jnp.tanh(jnp.dot(s, p["W"], preferred_element_type=jnp.float32) + x)
  y = jnp.dot(s_new, p["V"], preferred_element_type=jnp.float32)
  return s_new, y, jax.nn.sigmoid(jnp.sum(s_new * p["wh"], axis=-1))


def wide_token_block(p, s, x):
  """Attention over the row's tokens: dots with a batch (row) dimension."""
  att = jax.nn.softmax(jnp.einsum("rtd,rsd->rts", s, s), axis=-1)
  s_new = jnp.tanh(jnp.einsum("rts,rsd->rtd", att, s) + x)
  return s_new, s_new, jax.nn.sigmoid(jnp.sum(s_new * p["wh"], axis=-1))


@pytest.mark.parametrize("platform,case", [("cuda", "per_example"), ("tpu", "per_example"),
                                           ("tpu", "per_token")])
def test_kernels_lower(platform, case):
  """Forward and backward kernels of an ACT step export for the platform. (The
  per-token block's batched dots do not lower with Pallas Triton in JAX 0.11.2:
  export fails inside JAX's Triton lowering, so on GPU run such a block
  with options=pallas_loop.Options(implementation="xla").)"""
  from tests import lowering
  width, tokens, batch = 32, 16, 64
  k = jax.random.split(jax.random.key(0), 3)
  params = {"W": 0.2 * jax.random.normal(k[0], (width, width)),
            "V": 0.2 * jax.random.normal(k[1], (width, width)),
            "wh": 0.2 * jax.random.normal(k[2], (width,))}
  block = wide_example_block if case == "per_example" else wide_token_block
  lead = (batch,) if case == "per_example" else (batch, tokens)
  s0, x = jnp.zeros(lead + (width,)), jnp.ones(lead + (width,))
  a = halting.act(block, max_iters=8)
  h0 = a.init(params, s0, x)

  def loss(params, h0, x):
    h = pallas_loop.iterate(a.step, params, h0, x, max_iters=a.max_iters, halt=a.halt,
                            options=pallas_loop.Options(implementation="pallas", interpret=False))
    return jnp.sum(h.output) + jnp.sum(h.ponder_cost)

  text = lowering.export_text(jax.grad(loss), params, h0, x, platform=platform)
  assert text.count(lowering.kernel_marker(platform)) == 2      # forward and backward
