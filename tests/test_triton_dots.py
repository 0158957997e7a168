"""Dots the Pallas Triton lowering cannot take are rejected up front.

Triton's `dot_general` lowering takes a matrix product of two 2-D operands
only (one contracted axis each, no batch axes); anything else was a bare
AssertionError (batch axes) or ValueError (rank) at lowering. ACT per token
(a Universal-Transformer-style block: attention over the tokens of a row,
`einsum("rtd,rsd->rts")`, and matmuls of a [rows, T, D] state) hit it. The
Triton backend's plan now names the dot, so `implementation=None` falls back
to XLA with a warning and `implementation="pallas"` raises a ValueError that
says why. Checked by exporting for an H200 on this CPU machine.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import halting
from pallas_loop._src.kernels import backend_triton
from pallas_loop._src import notices
from tests import lowering

B, SEQ, W = 64, 16, 32


def _token_block(p, s, x):
  """ACT per token: causal attention over the row's tokens, then a tanh
  layer (as examples/act.py). s [R, T, W], x [R, T, W]."""
  q, k, v = s @ p["Wq"], s @ p["Wk"], s @ p["Wv"]
  scores = jnp.einsum("rtd,rsd->rts", q, k) / np.sqrt(s.shape[-1])
  causal = jnp.arange(SEQ)[:, None] >= jnp.arange(SEQ)[None, :]
  att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  s_new = jnp.tanh(s + jnp.einsum("rts,rsd->rtd", att, v) @ p["W"] + x)
  return s_new, s_new, jax.nn.sigmoid(jnp.sum(s_new, axis=-1))


def _problem():
  k = jax.random.split(jax.random.key(0), 4)
  p = {name: jax.random.normal(kk, (W, W)) / np.sqrt(W)
       for name, kk in zip(("Wq", "Wk", "Wv", "W"), k)}
  s0 = jnp.zeros((B, SEQ, W))
  x = jax.random.normal(jax.random.key(1), (B, SEQ, W))
  return p, s0, x


def _act(**kw):
  a = halting.act(_token_block, max_iters=8)

  def f(p, s0, x):
    return pallas_loop.iterate(a.step, p, a.init(p, s0, x), x, max_iters=a.max_iters,
                               halt=a.halt, **kw).output
  return f


def test_the_rule_names_batched_and_higher_rank_dots():
  rank3 = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((16, 8, 32)), jnp.ones((32, 32))).jaxpr
  batched = jax.make_jaxpr(lambda q, k: jnp.einsum("rtd,rsd->rts", q, k))(
      jnp.ones((16, 8, 32)), jnp.ones((16, 8, 32))).jaxpr
  matrix = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((16, 32)), jnp.ones((32, 32))).jaxpr
  (one,) = backend_triton.TRITON.extra_problems(batched)
  assert "batched dot of (16, 8, 32) x (16, 8, 32)" in one and "batch axes (0,)" in one
  (one,) = backend_triton.TRITON.extra_problems(rank3)
  assert "a dot of (16, 8, 32) x (32, 32)" in one
  assert backend_triton.TRITON.extra_problems(matrix) == []


def test_act_per_token_falls_back_on_the_gpu_with_a_warning():
  p, s0, x = _problem()
  notices._warned.clear()
  with pytest.warns(UserWarning, match=r"Triton lowers only matrix products of two 2-D "
                    r"operands.*using the XLA implementation"):
    text = lowering.export_text(_act(), p, s0, x, platform="cuda")
  assert lowering.kernel_marker("cuda") not in text


def test_act_per_token_with_pallas_raises_a_clear_error():
  p, s0, x = _problem()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with pytest.raises(ValueError, match=r"Triton lowers only matrix products.*batched dot"):
      lowering.export_text(_act(options=pallas_loop.Options(implementation="pallas",
                                                            interpret=False)), p, s0, x,
                           platform="cuda")
