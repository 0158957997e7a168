"""`iterate(..., key=)`: per-(row, step) keys identical in every implementation.

Row i's key at step t is a pure function of (key, i, t): results match the
reference (which derives the keys in the plainest way) whatever the
implementation, tiling, row order or padding, and gradients replay the same
keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop import random as plr
from tests import cases
from tests import lowering
from tests import oracle

D = 16


def noisy_dropout_step(w, h, x, key):
  """A residual cell with dropout and additive noise: both use the key."""
  noise = 0.1 * plr.normal(plr.fold_in(key, 1), h.shape)
  return h + plr.dropout(key, jnp.tanh(h @ w + x), 0.25) + noise


def _inputs(batch, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(k[0], (D, D)) / np.sqrt(D)
  return w, jax.random.normal(k[1], (batch, D)), jax.random.normal(k[2], (batch, D))


@pytest.mark.parametrize("impl", tuple(cases.IMPLEMENTATIONS))
@pytest.mark.parametrize("tiling", [dict(block_rows=8), dict(block_rows=16, sort_rows=False)])
def test_keyed_step_matches_reference(impl, tiling):
  w, h0, x = _inputs(19)
  n = cases.counts("ragged", 19)
  key = jax.random.key(7)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, key=key)
  options = cases.IMPLEMENTATIONS[impl].replace(**(tiling if impl != "xla" else {}))
  with pallas_loop.testing.poisoned_padding():
    got = pallas_loop.iterate(noisy_dropout_step, w, h0, x, **kw, options=options)
  oracle.assert_trees_close(got, reference.iterate(noisy_dropout_step, w, h0, x, **kw))


def test_key_kinds_and_determinism():
  w, h0, x = _inputs(8)
  run = functools.partial(pallas_loop.iterate, noisy_dropout_step, w, h0, x, iters=4,
                          max_iters=4, options=pallas_loop.Options(implementation="xla"))
  typed, legacy = run(key=jax.random.key(3)), run(key=jax.random.PRNGKey(3))
  np.testing.assert_array_equal(typed, legacy)
  np.testing.assert_array_equal(typed, run(key=jax.random.key(3)))
  assert not np.allclose(typed, run(key=jax.random.key(4)))


def test_a_row_keeps_its_keys_whatever_the_other_rows():
  """Row i's result depends on (key, i, t) only: reversing the batch order
  changes which keys rows get, but a row computed alone at index i matches."""
  w, h0, x = _inputs(8)
  key = jax.random.key(5)
  full = pallas_loop.iterate(noisy_dropout_step, w, h0, x, iters=3, max_iters=3, key=key,
                             options=pallas_loop.Options(implementation="pallas", block_rows=8))
  # The same rows with different counts elsewhere: row 2's result is unchanged.
  n = jnp.array([0, 1, 3, 2, 0, 3, 1, 2])
  mixed = pallas_loop.iterate(noisy_dropout_step, w, h0, x, iters=n, max_iters=3, key=key,
                              options=pallas_loop.Options(implementation="pallas", block_rows=8))
  np.testing.assert_allclose(mixed[2], full[2], rtol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["full", pallas_loop.Truncated(2)])
def test_gradients_replay_the_keys(impl, mode):
  w, h0, x = _inputs(12)
  n = cases.counts("ragged", 12, seed=4)
  key = jax.random.key(11)
  cot = jax.random.normal(jax.random.key(12), h0.shape)

  def grads(run, **kw):
    loss = lambda w_, h_, x_: jnp.sum(cot * run(noisy_dropout_step, w_, h_, x_, iters=n,
                                                 max_iters=cases.MAX_ITERS, key=key, **kw))
    return jax.grad(loss, argnums=(0, 1, 2))(w, h0, x)

  # The oracle's own argument for Truncated(k)'s gradient.
  truncate = {"truncate": mode.k} if isinstance(mode, pallas_loop.Truncated) else {}
  oracle.assert_trees_close(grads(pallas_loop.iterate, grad=mode,
                                  options=cases.IMPLEMENTATIONS[impl]),
                            grads(reference.iterate, **truncate), what="gradient")


def test_key_under_vmap_and_halting():
  """A key per example under vmap, with tol halting."""
  w, h0, x = _inputs(6)
  keys = jax.random.split(jax.random.key(0), 6)
  step = lambda w_, h, x_, key: 0.5 * h + 0.01 * plr.uniform(key, h.shape) + 0.1 * x_

  def one(h, x_, k, run):
    return run(step, w, h[None], x_[None], iters=30, max_iters=30, tol=1e-3, key=k)[0]

  got = jax.jit(jax.vmap(functools.partial(one, run=pallas_loop.iterate)))(h0, x, keys)
  want = jax.vmap(functools.partial(one, run=reference.iterate))(h0, x, keys)
  oracle.assert_trees_close(got, want)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_per_example_keys_under_vmap(impl):
  """What docs/randomness.md says about vmap: a batch of keys mapped with the
  examples gives each example its own key (the same result as a loop over the
  examples, each called with its key, gradients too); one key shared by every
  example (in_axes=None) gives every example the same draws, as jax.random
  would; one call on the whole batch with one key gives every row its own."""
  batch = 5
  w, h0, x = _inputs(batch)
  n = jnp.array([3, 1, 3, 2, 3])
  keys = jax.random.split(jax.random.key(2), batch)
  step = lambda w_, h, x_, key: plr.dropout(key, jnp.tanh(h @ w_ + x_), 0.5)
  options = pallas_loop.Options(implementation=impl)

  def one(w_, h, x_, m, k):
    return pallas_loop.iterate(step, w_, h[None], x_[None], iters=m, max_iters=3, key=k,
                               options=options)[0]

  mapped = jax.jit(jax.vmap(one, in_axes=(None, 0, 0, 0, 0)))(w, h0, x, n, keys)
  # The loop's calls jitted: one compilation serves every example.
  one_jit = jax.jit(one)
  looped = jnp.stack([one_jit(w, h0[i], x[i], n[i], keys[i]) for i in range(batch)])
  np.testing.assert_array_equal(mapped == 0, looped == 0)  # the same dropout masks
  np.testing.assert_allclose(mapped, looped, rtol=1e-5, atol=1e-6)  # batched dots round apart
  grad_mapped = jax.grad(lambda w_: jnp.sum(jax.vmap(one, in_axes=(None, 0, 0, 0, 0))(
      w_, h0, x, n, keys)))(w)
  grad_one = jax.jit(jax.grad(lambda w_, *rest: jnp.sum(one(w_, *rest))))
  grad_looped = sum(grad_one(w, h0[i], x[i], n[i], keys[i]) for i in range(batch))
  np.testing.assert_allclose(grad_mapped, grad_looped, rtol=1e-5, atol=1e-6)

  # One shared key: example i gets the draws of row 0 under that key, as does
  # every other example, so identical inputs give identical outputs.
  same = jnp.broadcast_to(h0[:1], h0.shape), jnp.broadcast_to(x[:1], x.shape)
  shared = jax.vmap(one, in_axes=(None, 0, 0, None, None))(w, *same, 3, keys[0])
  np.testing.assert_array_equal(shared, jnp.broadcast_to(shared[0], shared.shape))
  # Mapped keys on the same identical inputs: each example draws its own masks.
  own = jax.vmap(one, in_axes=(None, 0, 0, None, 0))(w, *same, 3, keys)
  assert len({np.asarray(r).tobytes() for r in own}) == batch
  # One call on the whole batch with one key: row i's keys come from (key, i).
  whole = pallas_loop.iterate(step, w, *same, iters=3, max_iters=3, key=keys[0],
                              options=options)
  assert len({np.asarray(r).tobytes() for r in whole}) == batch
  np.testing.assert_array_equal(whole[0] == 0, shared[0] == 0)
  np.testing.assert_allclose(whole[0], shared[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("platform", ("cuda", "tpu"))
def test_keyed_kernel_lowers(platform):
  batch, d = 64, 128
  w = jnp.ones((d, d)) * 0.01
  h0, x = jnp.ones((batch, d)), jnp.ones((batch, d))
  n = jnp.arange(batch, dtype=jnp.int32) % 5

  def f(w_, h, x_, n_):
    out = pallas_loop.iterate(noisy_dropout_step, w_, h, x_, iters=n_, max_iters=4,
                              key=jax.random.key(0),
                              options=pallas_loop.Options(implementation="pallas", interpret=False))
    return jnp.sum(out)

  for fn in (f, jax.grad(f)):
    text = lowering.export_text(fn, w, h0, x, n, platform=platform)
    assert lowering.kernel_marker(platform) in text


def test_bad_key_is_rejected_with_advice():
  with pytest.raises((TypeError, ValueError), match="key"):
    pallas_loop.iterate(lambda p, h, x, key: h, None, jnp.ones((2, 4)), iters=1, max_iters=1,
                        key=3)
