"""Gradients of every implementation against `jax.grad` of the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from tests import cases
from tests import oracle

IMPLS = tuple(cases.IMPLEMENTATIONS)


def _loss(run, step, params, h0, x, n):
  out = run(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  # A fixed, non-uniform cotangent so that every output element matters.
  return sum(jnp.sum(jnp.sin(jnp.arange(leaf.size, dtype=jnp.float32).reshape(leaf.shape))
                     * leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))


def _grads(run, step, params, h0, x, n):
  return jax.grad(functools.partial(_loss, run, step), argnums=(0, 1, 2))(params, h0, x, n)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block", ["tanh_rnn", "residual_mlp", "lstm"])
@pytest.mark.parametrize("pattern", ["ragged", "one_long_per_tile", "zero"])
def test_grad_matches_reference(impl, block, pattern):
  step, params, h0, x = blocks.make(block, 19, 16)
  n = cases.counts(pattern, 19)
  run = functools.partial(pallas_loop.iterate,
                          options=cases.IMPLEMENTATIONS[impl].replace(block_rows=8))
  got = _grads(run, step, params, h0, x, n)
  want = _grads(reference.iterate, step, params, h0, x, n)
  oracle.assert_trees_close(got, want, what="gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_grad_bf16(impl):
  step, params, h0, x = blocks.make("tanh_rnn", 16, 16, jnp.bfloat16)
  n = cases.counts("ragged", 16)
  run = functools.partial(pallas_loop.iterate, options=cases.IMPLEMENTATIONS[impl])
  got = _grads(run, step, params, h0, x, n)
  want = _grads(reference.iterate, step, params, h0, x, n)
  want_f32 = _grads(reference.iterate, step, *oracle.to_f32((params, h0, x)), n)
  oracle.assert_trees_close(got, want, want_f32, what="bf16 gradient")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_finite_differences(impl):
  step, params, h0, x = blocks.make("tanh_rnn", 6, 16)
  n = jnp.array([0, 1, 2, 3, 4, 6], jnp.int32)
  run = functools.partial(pallas_loop.iterate, options=cases.IMPLEMENTATIONS[impl])
  f = lambda p, h, x_: _loss(run, step, p, h, x_, n)
  check_grads(f, (params, h0, x), order=1, modes=("rev",), eps=1e-2, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_rows_with_zero_count_keep_gradients_finite(impl):
  """A count-0 row holding NaN gets a pass-through gradient, others unaffected."""
  step, params, h0, x = blocks.make("tanh_rnn", 8, 16)
  n = jnp.array([0, 3, 1, 6, 2, 0, 5, 4], jnp.int32)
  run = functools.partial(pallas_loop.iterate, options=cases.IMPLEMENTATIONS[impl])
  g_h0 = jax.grad(lambda h: _loss(run, step, params, h, x, n))(h0)
  want = jax.grad(lambda h: _loss(reference.iterate, step, params, h, x, n))(h0)
  oracle.assert_trees_close(g_h0, want)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_compositions(impl):
  """jit(grad), vmap(grad) with per-example counts, grad(vmap), vmap of iterate."""
  step, params, h0, x = blocks.make("tanh_rnn", 6, 16)
  n = cases.counts("ragged", 6, seed=1)
  run = functools.partial(pallas_loop.iterate, options=cases.IMPLEMENTATIONS[impl])

  def per_example(p, h, x_, k, iterate):
    """One example (no row axis) with its own count: what vmap users write."""
    out = iterate(step, p, h[None], x_[None], iters=k, max_iters=cases.MAX_ITERS)
    return jnp.sum(jnp.tanh(out))

  for iterate_fn in (run,):
    want_vals = jax.vmap(per_example, (None, 0, 0, 0, None))(params, h0, x, n, reference.iterate)
    got_vals = jax.jit(jax.vmap(per_example, (None, 0, 0, 0, None)), static_argnums=4)(
        params, h0, x, n, iterate_fn)
    np.testing.assert_allclose(got_vals, want_vals, rtol=1e-5, atol=1e-5)

    # vmap(grad): per-example parameter gradients.
    per_ex_grad = jax.vmap(jax.grad(per_example), (None, 0, 0, 0, None))
    oracle.assert_trees_close(jax.jit(per_ex_grad, static_argnums=4)(params, h0, x, n, iterate_fn),
                              per_ex_grad(params, h0, x, n, reference.iterate))

    # grad(vmap): gradient of the batch loss.
    batch_loss = lambda p, it: jnp.sum(jax.vmap(per_example, (None, 0, 0, 0, None))(p, h0, x, n, it))
    oracle.assert_trees_close(jax.jit(jax.grad(batch_loss), static_argnums=1)(params, iterate_fn),
                              jax.grad(batch_loss)(params, reference.iterate))

    # jit(grad) on the batched call.
    oracle.assert_trees_close(jax.jit(_grads, static_argnums=(0, 1))(iterate_fn, step, params, h0, x, n),
                              _grads(reference.iterate, step, params, h0, x, n))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["full", pallas_loop.Truncated(1), pallas_loop.Implicit(),
                                  pallas_loop.Phantom(1)], ids=str)
def test_grad_of_vmap_over_a_closed_over_array(impl, mode):
  """grad(vmap(...)) where each example's step closes over its own (batched)
  array: the gradient equals the sum of the examples' own, every mode. On JAX
  0.10 the backward is traced after the vmap's trace ended and retraced a step
  holding a dead tracer (`jax_versions.BACKWARD_TRACED_AFTER_VMAP`)."""
  step, params, h0, x = blocks.make("tanh_rnn", 4, 16)
  bias = jnp.linspace(-0.5, 0.5, 4 * 16).reshape(4, 16)
  n = jnp.array([3, 1, 4, 2])

  def one(p, h, x_, b, k):
    closing = lambda p_, h_, xx: 0.5 * step(p_, h_, xx) + 0.1 * jnp.tanh(b)
    out = pallas_loop.iterate(closing, p, h[None], x_[None], iters=k, max_iters=4, grad=mode,
                              options=cases.IMPLEMENTATIONS[impl])
    return jnp.sum(jnp.sin(out))

  batch_loss = lambda p: jnp.sum(jax.vmap(one, (None, 0, 0, 0, 0))(p, h0, x, bias, n))
  looped = lambda p: sum(one(p, h0[i], x[i], bias[i], n[i]) for i in range(4))
  oracle.assert_trees_close(jax.jit(jax.grad(batch_loss))(params), jax.grad(looped)(params),
                            what="gradient")


def test_counts_get_no_gradient_and_info_is_not_differentiated():
  step, params, h0, x = blocks.make("tanh_rnn", 4, 16)

  def f(p):
    h, info = pallas_loop.iterate(step, p, h0, x, iters=3, max_iters=4, return_info=True)
    return jnp.sum(h) + jnp.sum(info.residual)

  g_with_info = jax.grad(f)(params)
  g_plain = jax.grad(lambda p: jnp.sum(pallas_loop.iterate(step, p, h0, x, iters=3, max_iters=4)))(params)
  oracle.assert_trees_close(g_with_info, g_plain)
