"""Per-step outputs (`step_outputs=True`): `step` returns `(h_new, y)` and
`iterate` returns `(h, ys)`, ys stacked like `lax.scan`'s: [max_iters, B, ...],
0 where a row did not apply that step. Checked against the oracle
(`step_outputs=True` there too), forward and gradients, and against a loop
written here row by row, on the XLA implementation and on the Pallas kernels
(interpret mode: the forward writes each trip's outputs to a time-major
output ref, the backward reads their cotangents at the window step's slot),
with NaN padding rows (`testing.poisoned_padding`) and tiles that do not
divide the batch, so a padded row leaking into a result shows.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from tests import cases
from tests import lowering
from tests import oracle

B, D, T = 12, 8, 6

# Implementations under test: the kernels with tiles of 8 rows (12 rows: one
# whole tile and one padded one) and NaN in the padding rows.
IMPLS = {
    "xla": pallas_loop.Options(implementation="xla"),
    "pallas": cases.IMPLEMENTATIONS["pallas"].replace(block_rows=8),
    "pallas_tpu_interpret": cases.IMPLEMENTATIONS["pallas_tpu_interpret"].replace(block_rows=8),
}


def _padding(impl):
  """Poisoned padding rows for the kernels (the XLA forward pads nothing)."""
  return (pallas_loop.testing.poisoned_padding() if impl != "xla"
          else contextlib.nullcontext())


def _step(w, h, x):
  """A recurrent cell with two per-step outputs: a prediction and a halting
  probability (PonderNet's pair), a 1-D and a 2-D leaf; a float16, a
  bfloat16, an integer and a bool output."""
  h_new = jnp.tanh(h @ w + x)
  return h_new, {"pred": jnp.sum(h_new, axis=-1), "p": jax.nn.sigmoid(h_new[:, :2]),
                 "low": h_new[:, :3].astype(jnp.float16),
                 "half": h_new[:, 4:].astype(jnp.bfloat16),
                 "sign": (h_new[:, 0] > 0).astype(jnp.int32), "pos": h_new[:, 1] > 0}


def _inputs(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return (0.6 * jax.random.normal(k[0], (D, D)) / np.sqrt(D), jax.random.normal(k[1], (B, D)),
          jax.random.normal(k[2], (B, D)))


def _loss(run, n, **kw):
  def loss(w, h0, x):
    h, ys = run(_step, w, h0, x, iters=n, max_iters=T, step_outputs=True, **kw)
    return (jnp.sum(h ** 2) + jnp.sum(jnp.cos(ys["pred"])) + 3 * jnp.sum(ys["p"])
            + jnp.sum(ys["low"].astype(jnp.float32))
            + jnp.sum(jnp.sin(ys["half"].astype(jnp.float32))))
  return loss


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("halting", [False, True], ids=["counts", "tol"])
@pytest.mark.parametrize("pattern", ["ragged", "zero", "max", "one_long_per_tile"])
def test_forward_matches_the_oracle_and_a_row_loop(pattern, halting, impl):
  w, h0, x = _inputs()
  n = cases.counts(pattern, B, T, seed=1)
  kw = dict(iters=n, max_iters=T, step_outputs=True, tol=0.05 if halting else None)
  with _padding(impl):
    (h, ys, info) = pallas_loop.iterate(_step, w, h0, x, return_info=True, **kw,
                                        options=IMPLS[impl])
  (h_r, ys_r, info_r) = reference.iterate(_step, w, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(h, h_r)
  oracle.assert_trees_close(ys, ys_r)
  np.testing.assert_array_equal(info.steps, info_r.steps)
  assert ys["pred"].shape == (T, B) and ys["p"].shape == (T, B, 2)
  assert ys["low"].dtype == jnp.float16 and ys["sign"].dtype == jnp.int32
  assert ys["half"].dtype == jnp.bfloat16 and ys["pos"].dtype == jnp.bool_
  # Row by row: slot t holds step t's output where the row applied it, else 0.
  steps = np.asarray(info.steps)
  for i in range(B):
    hi = h0[i:i + 1]
    for t in range(T):
      if t < steps[i]:
        hi, y = _step(w, hi, x[i:i + 1])
        np.testing.assert_allclose(ys["pred"][t, i], y["pred"][0], rtol=1e-5, atol=1e-6)
      else:
        assert float(ys["pred"][t, i]) == 0 and not np.any(np.asarray(ys["p"][t, i]))
        assert not np.any(np.asarray(ys["half"][t, i], np.float32)) and not ys["pos"][t, i]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["full", "truncated"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_through_the_outputs(mode, jit, impl):
  w, h0, x = _inputs(seed=2)
  n = cases.counts("ragged", B, T, seed=3)
  grad_mode = "full" if mode == "full" else pallas_loop.Truncated(2)
  grad = jax.grad(_loss(functools.partial(pallas_loop.iterate, grad=grad_mode, options=IMPLS[impl]),
                        n), argnums=(0, 1, 2))
  if jit:
    grad = jax.jit(grad)
  extra = {} if mode == "full" else {"truncate": 2}
  want = jax.grad(_loss(functools.partial(reference.iterate, **extra), n),
                  argnums=(0, 1, 2))(w, h0, x)
  with _padding(impl):
    got = grad(w, h0, x)
  oracle.assert_trees_close(got, want, what="gradient")


@pytest.mark.parametrize("mode", ["full", "truncated"])
@pytest.mark.parametrize("pattern", ["zero", "max", "one_long_per_tile"])
def test_kernel_gradients_over_count_patterns_and_halting(pattern, mode):
  """The kernels' gradients on more count patterns, with halting (the
  backward replays each row's steps) and a checkpoint interval that does
  not divide the window (segments of 4 over up to 6 steps)."""
  w, h0, x = _inputs(seed=6)
  n = cases.counts(pattern, B, T, seed=7)
  grad_mode = pallas_loop.Full(checkpoint_every=4) if mode == "full" else pallas_loop.Truncated(3)
  run = functools.partial(pallas_loop.iterate, grad=grad_mode, tol=0.05, options=IMPLS["pallas"])
  ref = functools.partial(reference.iterate, tol=0.05,
                          **({} if mode == "full" else {"truncate": 3}))
  with _padding("pallas"):
    got = jax.jit(jax.grad(_loss(run, n), argnums=(0, 1, 2)))(w, h0, x)
  want = jax.grad(_loss(ref, n), argnums=(0, 1, 2))(w, h0, x)
  oracle.assert_trees_close(got, want, what="gradient")


def test_kernels_on_tpu_semantics():
  """Mosaic's interpret mode (TPU semantics): forward outputs and gradients."""
  w, h0, x = _inputs(seed=8)
  n = cases.counts("ragged", B, T, seed=9)
  run = functools.partial(pallas_loop.iterate, options=IMPLS["pallas_tpu_interpret"])
  kw = dict(iters=n, max_iters=T, step_outputs=True)
  with _padding("pallas_tpu_interpret"):
    got = run(_step, w, h0, x, **kw)
    grads = jax.grad(_loss(run, n), argnums=(0, 1, 2))(w, h0, x)
  oracle.assert_trees_close(got, reference.iterate(_step, w, h0, x, **kw))
  oracle.assert_trees_close(
      grads, jax.grad(_loss(reference.iterate, n), argnums=(0, 1, 2))(w, h0, x),
      what="gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_with_key_index_and_per_example(impl):
  """The extras together: a step written for one row with key= and index=."""
  def one_row(w, h, x, *, key, index):
    h_new = jnp.tanh(h @ w[index] + x) + 0.01 * pallas_loop.random.normal(key, h.shape)
    return h_new, jnp.sum(h_new)

  k = jax.random.split(jax.random.key(4), 3)
  w = 0.6 * jax.random.normal(k[0], (T, D, D)) / np.sqrt(D)
  h0, x = jax.random.normal(k[1], (B, D)), jax.random.normal(k[2], (B, D))
  n = cases.counts("ragged", B, T, seed=5)
  kw = dict(iters=n, max_iters=T, key=jax.random.key(1), step_index=True, step_outputs=True,
            per_example=True)
  with _padding(impl):
    got = pallas_loop.iterate(one_row, w, h0, x, **kw, options=IMPLS[impl])
  oracle.assert_trees_close(got, reference.iterate(one_row, w, h0, x, **kw))


@pytest.mark.parametrize("mode", ["full", "truncated"])
def test_kernel_gradients_with_the_step_index(mode):
  """A step that depends on its index, with per-step outputs: the backward
  kernel's windows run on one clock and read each step's output cotangent at
  that step's slot. (The weights are scaled by the index rather than indexed
  by it: the TPU's backward kernel declines `params[index]`'s gradient, a
  dynamic_update_slice, and interpret mode applies its rules.)"""
  def step(w, h, x, *, index):
    h_new = jnp.tanh(h @ (w * (1.0 + 0.05 * index.astype(w.dtype))) + x)
    return h_new, {"pred": jnp.sum(h_new, axis=-1), "first": h_new[:, :2]}

  k = jax.random.split(jax.random.key(10), 3)
  w = 0.6 * jax.random.normal(k[0], (D, D)) / np.sqrt(D)
  h0, x = jax.random.normal(k[1], (B, D)), jax.random.normal(k[2], (B, D))
  n = cases.counts("ragged", B, T, seed=11)
  grad_mode, extra = ("full", {}) if mode == "full" else (pallas_loop.Truncated(2),
                                                          {"truncate": 2})

  def f(run, w_, **kw):
    h, ys = run(step, w_, h0, x, iters=n, max_iters=T, step_index=True, step_outputs=True,
                **kw)
    return jnp.sum(h ** 2) + jnp.sum(jnp.cos(ys["pred"])) + jnp.sum(ys["first"] ** 2)

  with _padding("pallas"):
    got = jax.grad(lambda w_: f(pallas_loop.iterate, w_, grad=grad_mode,
                                options=IMPLS["pallas"]))(w)
  want = jax.grad(lambda w_: f(reference.iterate, w_, **extra))(w)
  oracle.assert_trees_close(got, want, what="gradient")


def test_where_outputs_are_not_supported():
  w, h0, x = _inputs()
  # Modes without a gradient for the outputs of a fixed-point solve.
  for mode in (pallas_loop.Implicit(), pallas_loop.Phantom(2)):
    with pytest.raises(ValueError, match="step_outputs=True is not supported"):
      pallas_loop.iterate(_step, w, h0, x, max_iters=T, step_outputs=True, grad=mode)
  with pytest.raises(TypeError, match=r"must return a pair \(h_new, y\)"):
    pallas_loop.iterate(lambda w, h, x: h, w, h0, x, max_iters=T, step_outputs=True)
  with pytest.raises(TypeError, match="needs the row axis"):
    pallas_loop.iterate(lambda w, h, x: (h, w[0]), w, h0, x, max_iters=T, step_outputs=True)
  with pytest.raises(TypeError, match="step_outputs must be True or False"):
    pallas_loop.iterate(_step, w, h0, x, max_iters=T, step_outputs="yes")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_the_kernels_lower_with_outputs_for_gpu_and_tpu(platform, grad):
  """The default implementation picks the kernels (not XLA) for a step with
  a 2-D and a 1-D output, max_iters not a power of 2 (slots rounded up)."""
  rows, d = 64, 32
  k = jax.random.split(jax.random.key(12), 4)
  params = (jax.random.normal(k[0], (d, d)) / np.sqrt(d), jax.random.normal(k[1], (d, 16)))
  h0, x = jax.random.normal(k[2], (rows, d)), jax.random.normal(k[3], (rows, d))
  n = jnp.arange(rows, dtype=jnp.int32) % (T + 1)

  def step(p, h, x_):
    h_new = jnp.tanh(h @ p[0] + x_)
    return h_new, (h_new @ p[1], jax.nn.sigmoid(jnp.sum(h_new, axis=-1)))

  def f(p, h, x_, n_):
    out, (logits, lam) = pallas_loop.iterate(step, p, h, x_, iters=n_, max_iters=T,
                                             step_outputs=True)
    return jnp.sum(out) + jnp.sum(jnp.tanh(logits)) + jnp.sum(lam)

  fn = jax.grad(f) if grad else f
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # no fallback warning
    text = lowering.export_text(fn, params, h0, x, n, platform=platform)
  assert lowering.kernel_marker(platform) in text
  assert "pallas_loop_iterate_fwd" in text
  if grad:
    assert "pallas_loop_iterate_bwd" in text


def test_kernel_outputs_under_vmap():
  """vmap over the kernel (a batch of batches): outputs and gradients."""
  w, h0, x = _inputs(seed=13)
  n = cases.counts("ragged", B, T, seed=14)
  hs = jnp.stack([h0, -0.5 * h0])
  kw = dict(iters=n, max_iters=T, step_outputs=True)

  def total(run, w_):
    h, ys = jax.vmap(lambda h_: run(_step, w_, h_, x, **kw))(hs)
    return jnp.sum(h ** 2) + jnp.sum(jnp.cos(ys["pred"])) + jnp.sum(ys["p"])

  run = functools.partial(pallas_loop.iterate, options=IMPLS["pallas"])
  with _padding("pallas"):
    got = jax.vmap(lambda h_: run(_step, w, h_, x, **kw))(hs)
    got_grad = jax.grad(lambda w_: total(run, w_))(w)
  oracle.assert_trees_close(got, jax.vmap(lambda h_: reference.iterate(_step, w, h_, x, **kw))(hs))
  oracle.assert_trees_close(got_grad, jax.grad(lambda w_: total(reference.iterate, w_))(w),
                            what="gradient")
