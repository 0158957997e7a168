"""Per-step outputs (`step_outputs=True`): `step` returns `(h_new, y)` and
`iterate` returns `(h, ys)`, ys stacked like `lax.scan`'s: [max_iters, B, ...],
0 where a row did not apply that step. Checked against the oracle
(`step_outputs=True` there too), forward and gradients, and against a loop
written here row by row.
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

B, D, T = 12, 8, 6


def _step(w, h, x):
  """A recurrent cell with two per-step outputs: a prediction and a halting
  probability (PonderNet's pair), one float16 and one integer output."""
  h_new = jnp.tanh(h @ w + x)
  return h_new, {"pred": jnp.sum(h_new, axis=-1), "p": jax.nn.sigmoid(h_new[:, :2]),
                 "low": h_new[:, :3].astype(jnp.float16),
                 "sign": (h_new[:, 0] > 0).astype(jnp.int32)}


def _inputs(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return (0.6 * jax.random.normal(k[0], (D, D)) / np.sqrt(D), jax.random.normal(k[1], (B, D)),
          jax.random.normal(k[2], (B, D)))


def _loss(run, n, **kw):
  def loss(w, h0, x):
    h, ys = run(_step, w, h0, x, iters=n, max_iters=T, step_outputs=True, **kw)
    return (jnp.sum(h ** 2) + jnp.sum(jnp.cos(ys["pred"])) + 3 * jnp.sum(ys["p"])
            + jnp.sum(ys["low"].astype(jnp.float32)))
  return loss


@pytest.mark.parametrize("halting", [False, True], ids=["counts", "tol"])
@pytest.mark.parametrize("pattern", ["ragged", "zero", "max"])
def test_forward_matches_the_oracle_and_a_row_loop(pattern, halting):
  w, h0, x = _inputs()
  n = cases.counts(pattern, B, T, seed=1)
  kw = dict(iters=n, max_iters=T, step_outputs=True, tol=0.05 if halting else None)
  (h, ys, info) = pallas_loop.iterate(_step, w, h0, x, return_info=True, **kw)
  (h_r, ys_r, info_r) = reference.iterate(_step, w, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(h, h_r)
  oracle.assert_trees_close(ys, ys_r)
  np.testing.assert_array_equal(info.steps, info_r.steps)
  assert ys["pred"].shape == (T, B) and ys["p"].shape == (T, B, 2)
  assert ys["low"].dtype == jnp.float16 and ys["sign"].dtype == jnp.int32
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


@pytest.mark.parametrize("mode", ["full", "truncated"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_through_the_outputs(mode, jit):
  w, h0, x = _inputs(seed=2)
  n = cases.counts("ragged", B, T, seed=3)
  grad_mode = "full" if mode == "full" else pallas_loop.Truncated(2)
  grad = jax.grad(_loss(functools.partial(pallas_loop.iterate, grad=grad_mode), n),
                  argnums=(0, 1, 2))
  if jit:
    grad = jax.jit(grad)
  extra = {} if mode == "full" else {"truncate": 2}
  want = jax.grad(_loss(functools.partial(reference.iterate, **extra), n),
                  argnums=(0, 1, 2))(w, h0, x)
  oracle.assert_trees_close(grad(w, h0, x), want, what="gradient")


def test_with_key_index_and_per_example():
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
  oracle.assert_trees_close(pallas_loop.iterate(one_row, w, h0, x, **kw),
                            reference.iterate(one_row, w, h0, x, **kw))


def test_where_outputs_are_not_supported():
  w, h0, x = _inputs()
  # The kernels do not stream outputs yet: "pallas" says so, never silently.
  with pytest.raises(ValueError, match="per-step outputs"):
    pallas_loop.iterate(_step, w, h0, x, max_iters=T, step_outputs=True,
                        **cases.IMPLEMENTATIONS["pallas"])
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
