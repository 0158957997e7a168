"""The step index (`step_index=True`): `step(params, h, x, index=t)`.

Every row that applies a step at trip t is at its step t, so the index is one
int32 scalar per call of the step, and per-step parameters `[max_iters, ...]`
are read with `params[index]` (a dynamic slice). Checked against the oracle
(`step_index=True` there too) and, for the gradient modes the oracle has no
flag for, against loops written here row by row.
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
from tests import oracle

B, D, T = 12, 16, 6
IMPLS = {"xla": pallas_loop.Options(implementation="xla"),
         "pallas": cases.IMPLEMENTATIONS["pallas"], "auto": pallas_loop.Options()}


def _untied(params, h, x, *, index):
  """A Universal Transformer with untied layers, in miniature: layer `index`."""
  w, b = params
  return jnp.tanh(h @ w[index] + x + b[index])


def _inputs(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  w = 0.6 * jax.random.normal(k[0], (T, D, D)) / np.sqrt(D)
  b = 0.1 * jax.random.normal(k[1], (T, D))
  return (w, b), jax.random.normal(k[2], (B, D)), jax.random.normal(k[3], (B, D))


def _loss(run, **kw):
  def loss(params, h0, x):
    return jnp.sum(jnp.cos(jnp.arange(B * D, dtype=jnp.float32).reshape(B, D))
                   * run(_untied, params, h0, x, step_index=True, **kw))
  return loss


def _row_loop(params, h0, x, first, last):
  """Row i applies steps first[i] .. last[i] - 1 to h0[i], one at a time."""
  rows = []
  for i in range(B):
    h = h0[i:i + 1]
    for t in range(int(first[i]), int(last[i])):
      h = _untied(params, h, x[i:i + 1], index=t)
    rows.append(h)
  return jnp.concatenate(rows)


def _lift_tpu_rules(request, impl):
  """The untied backward is declined by every compiled backend (the VJP of
  `w[index]` is a `dynamic_update_slice`), and so by interpret mode
  (`test_interpret_mode_declines_the_untied_backward_as_the_tpu_does`); its
  kernel logic is checked here with the TPU's rules lifted."""
  if impl == "pallas":
    request.getfixturevalue("tpu_step_rules_lifted")


def test_interpret_mode_declines_the_untied_backward_as_the_tpu_does():
  params, h0, x = _inputs()
  run = functools.partial(pallas_loop.iterate, iters=3, max_iters=T, options=IMPLS["pallas"])
  oracle.assert_trees_close(
      run(_untied, params, h0, x, step_index=True),
      reference.iterate(_untied, params, h0, x, iters=3, max_iters=T, step_index=True))
  with pytest.raises(ValueError, match=r"the Pallas mosaic_tpu backward kernel cannot run this "
                     r"step: step uses the primitive `dynamic_slice`"):
    jax.grad(_loss(run), argnums=(0, 1, 2))(params, h0, x)
  with pytest.raises(ValueError, match=r"the Pallas triton backward kernel cannot run this step"):
    gpu = IMPLS["pallas"].replace(interpret="gpu")
    jax.grad(_loss(functools.partial(run, options=gpu)), argnums=(0, 1, 2))(params, h0, x)


@pytest.mark.parametrize("impl", tuple(IMPLS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_and_full_gradient_match_the_oracle(request, impl, jit):
  _lift_tpu_rules(request, impl)
  params, h0, x = _inputs()
  n = cases.counts("ragged", B, T, seed=1)
  run = functools.partial(pallas_loop.iterate, iters=n, max_iters=T, options=IMPLS[impl])
  got = run(_untied, params, h0, x, step_index=True)
  want = reference.iterate(_untied, params, h0, x, iters=n, max_iters=T, step_index=True)
  oracle.assert_trees_close(got, want)
  np.testing.assert_allclose(got, _row_loop(params, h0, x, np.zeros(B), np.asarray(n)),
                             rtol=2e-5, atol=2e-5)
  grad = jax.grad(_loss(run), argnums=(0, 1, 2))
  if jit:
    grad = jax.jit(grad)
  want_g = jax.grad(_loss(functools.partial(reference.iterate, iters=n, max_iters=T)),
                    argnums=(0, 1, 2))(params, h0, x)
  oracle.assert_trees_close(grad(params, h0, x), want_g, what="gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["truncated", "phantom"])
def test_last_steps_windows_see_each_steps_own_index(request, impl, mode):
  """Truncated(k) / Phantom(k): rows' windows start at different steps; each
  step still gets its own index (the windows run on one clock)."""
  _lift_tpu_rules(request, impl)
  params, h0, x = _inputs(seed=2)
  n = cases.counts("ragged", B, T, seed=3)
  k = 2
  got = jax.grad(_loss(functools.partial(
      pallas_loop.iterate, iters=n, max_iters=T,
      grad=pallas_loop.Truncated(k) if mode == "truncated" else pallas_loop.Phantom(k),
      options=IMPLS[impl])),
      argnums=(0, 1, 2))(params, h0, x)
  steps = np.asarray(n)
  first = steps - np.minimum(steps, k)

  def oracle_run(step, params, h0, x, **_):
    if mode == "truncated":
      start = jax.lax.stop_gradient(_row_loop(params, h0, x, np.zeros(B), first))
      start = jnp.where((first == 0)[:, None], h0, start)
    else:  # k steps unrolled from the stopped output, with their own indices
      start = jax.lax.stop_gradient(_row_loop(params, h0, x, np.zeros(B), steps))
    out = _row_loop(params, start, x, first, steps)
    return out if mode == "truncated" else jnp.where((steps == 0)[:, None], h0, out)

  want = jax.grad(_loss(oracle_run), argnums=(0, 1, 2))(params, h0, x)
  oracle.assert_trees_close(got, want, what="gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_implicit_differentiates_each_rows_last_map(impl):
  """A damping schedule that settles after 5 steps: every row's fixed point
  is that of its last map, and the implicit gradient equals backprop through
  the converged loop."""

  def damped(w, h, x, *, index):
    alpha = 0.5 + 0.1 * jnp.minimum(index, 5).astype(jnp.float32)
    return (1 - alpha) * h + alpha * jnp.tanh(h @ w + x)

  k = jax.random.split(jax.random.key(4), 3)
  w = 0.5 * jax.random.normal(k[0], (D, D)) / np.sqrt(D)
  h0, x = jax.random.normal(k[1], (B, D)), jax.random.normal(k[2], (B, D))
  kw = dict(max_iters=120, tol=1e-7, step_index=True)

  def loss(run, **extra):
    return lambda w, x: jnp.sum(jnp.sin(run(damped, w, h0, x, **kw, **extra)))

  got = jax.grad(loss(pallas_loop.iterate, grad=pallas_loop.Implicit(), options=IMPLS[impl]),
                 argnums=(0, 1))(w, x)
  want = jax.grad(loss(reference.iterate), argnums=(0, 1))(w, x)
  for g_, w_ in zip(got, want):
    np.testing.assert_allclose(g_, w_, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_with_key_and_per_example(impl):
  """The extras together: `key=` and `index=`, and a step written for one row."""

  def noisy(params, h, x, *, key, index):
    w, b = params
    return jnp.tanh(h @ w[index] + x + b[index]) + 0.01 * pallas_loop.random.normal(key, h.shape)

  params, h0, x = _inputs(seed=5)
  n = cases.counts("ragged", B, T, seed=6)
  kw = dict(iters=n, max_iters=T, key=jax.random.key(9), step_index=True)
  want = reference.iterate(noisy, params, h0, x, **kw)
  oracle.assert_trees_close(pallas_loop.iterate(noisy, params, h0, x, **kw,
                                                options=IMPLS[impl]), want)
  one_row = lambda params, h, x, *, key, index: noisy(params, h[None], x[None], key=key[None],
                                                      index=index)[0]
  oracle.assert_trees_close(
      pallas_loop.iterate(one_row, params, h0, x, per_example=True, **kw,
                          options=IMPLS[impl]), want)


def test_step_index_errors():
  params, h0, x = _inputs()
  with pytest.raises(TypeError, match="step must accept `index` as a keyword argument"):
    pallas_loop.iterate(lambda p, h, x: h, params, h0, x, max_iters=2, step_index=True)
  with pytest.raises(TypeError, match="step_index must be True or False"):
    pallas_loop.iterate(_untied, params, h0, x, max_iters=2, step_index=1)
  with pytest.raises(TypeError, match="step must accept `key` as a keyword argument"):
    pallas_loop.iterate(lambda p, h, x, k: h, None, h0, x, max_iters=2, key=jax.random.key(0))


def test_the_kernel_reads_one_steps_weights_per_step():
  """Stacked per-step weights [T, D, D] are read as [1, D, D] slices of
  their ref inside every platform's kernel, never whole."""
  from benchmarks import blocks  # pylint: disable=g-import-not-at-top

  step, params, h0, x = blocks.make("untied_rnn", 64, 32, jnp.bfloat16)
  n = jnp.arange(64, dtype=jnp.int32) % (blocks.UNTIED_LAYERS + 1)
  run = lambda p: pallas_loop.iterate(step, p, h0, x, iters=n, max_iters=blocks.UNTIED_LAYERS,
                                      step_index=True,
                                      options=pallas_loop.Options(implementation="pallas"))
  oracle.assert_trees_close(run(params), *oracle.reference_pair(
      step, params, h0, x, iters=n, max_iters=blocks.UNTIED_LAYERS, step_index=True))

  def eqns(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from eqns(sub)

  kernels = [e.params["jaxpr"] for e in eqns(jax.make_jaxpr(run)(params).jaxpr)
             if e.primitive.name == "pallas_call"]
  assert len(kernels) >= 2  # the interpreter's and the GPU/TPU kernels' bodies
  for kernel in kernels:
    reads = [tuple(v.aval.shape) for e in eqns(kernel) if e.primitive.name == "get"
             for v in e.outvars]
    # b [T, D] travels as [T, 1, D] (its step axis a leading one, for Mosaic).
    assert (1, 32, 32) in reads and (1, 1, 32) in reads, reads
    assert (blocks.UNTIED_LAYERS, 32, 32) not in reads, reads
