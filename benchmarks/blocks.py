"""Blocks (step functions) and their parameters, shared by tests and benchmarks.

Each block is `step(params, h, x) -> h_new`, row independent, written with
operations both Pallas backends lower: matmuls accumulate in float32
(`preferred_element_type`) and cast back to the state's dtype, as a
mixed-precision model would. `make(name, d, dtype, key)` builds the
parameters; weights are scaled so the maps are contractions (stable over
many steps, in bf16 too).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp


def _mm(a, w):
  return jnp.dot(a, w, preferred_element_type=jnp.float32)


def tanh_rnn(params, h, x):
  """h <- tanh(h W + x U + b). FLOPs per row-step: 4 D^2."""
  w, u, b = params
  z = _mm(h, w) + _mm(x, u) + b.astype(jnp.float32)
  return jnp.tanh(z).astype(h.dtype)


def residual_mlp(params, h, x):
  """h <- h + relu(h W1) W2 + x (hidden F = 4 D). FLOPs per row-step: 16 D^2."""
  w1, w2 = params
  hidden = jnp.maximum(_mm(h, w1), 0.0).astype(h.dtype)
  return (h.astype(jnp.float32) + _mm(hidden, w2) + x.astype(jnp.float32)).astype(h.dtype)


def residual_mlp_ln(params, h, x):
  """h <- h + relu(LN(h) W1) W2 + x, LN a layer norm with gain and bias [D].

  Hidden F = 4 D. FLOPs per row-step: 16 D^2 (the norm is O(D)).
  """
  w1, w2, gain, bias = params
  hf = h.astype(jnp.float32)
  mu = jnp.mean(hf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(hf - mu), axis=-1, keepdims=True)
  normed = (hf - mu) * lax.rsqrt(var + 1e-5) * gain.astype(jnp.float32) + bias.astype(jnp.float32)
  hidden = jnp.maximum(_mm(normed.astype(h.dtype), w1), 0.0).astype(h.dtype)
  return (hf + _mm(hidden, w2) + x.astype(jnp.float32)).astype(h.dtype)


def lstm(params, state, x):
  """An LSTM cell on the pytree state (h, c). FLOPs per row-step: 16 D^2."""
  (wi, wf, wo, wg), (ui, uf, uo, ug) = params
  h, c = state
  gate = lambda w, u: _mm(h, w) + _mm(x, u)
  i = jax.nn.sigmoid(gate(wi, ui))
  f = jax.nn.sigmoid(gate(wf, uf))
  o = jax.nn.sigmoid(gate(wo, uo))
  g = jnp.tanh(gate(wg, ug))
  c_new = f * c.astype(jnp.float32) + i * g
  h_new = o * jnp.tanh(c_new)
  return h_new.astype(h.dtype), c_new.astype(c.dtype)


def gru(params, h, x):
  """A GRU cell. FLOPs per row-step: 12 D^2."""
  (wz, wr, wh), (uz, ur, uh) = params
  hf = h.astype(jnp.float32)
  z = jax.nn.sigmoid(_mm(h, wz) + _mm(x, uz))
  r = jax.nn.sigmoid(_mm(h, wr) + _mm(x, ur))
  cand = jnp.tanh(_mm((r * hf).astype(h.dtype), wh) + _mm(x, uh))
  return ((1.0 - z) * hf + z * cand).astype(h.dtype)


def transformer(params, h, x):
  """A pre-norm transformer block over a short sequence per row.

  h, x: [B, L, D] (L tokens per row; attention only within a row). One
  attention head, MLP hidden 4 D. FLOPs per row-step: L (24 D^2) + 4 L^2 D.
  Uses layer norm and softmax over non-row axes: run on the XLA path.
  """
  wq, wk, wv, wo, w1, w2 = params
  f32 = h.astype(jnp.float32) + x.astype(jnp.float32)

  def norm(a):
    mu = jnp.mean(a, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(a - mu), axis=-1, keepdims=True)
    return ((a - mu) * lax.rsqrt(var + 1e-5)).astype(h.dtype)

  mm = lambda a, w: jnp.einsum("bld,de->ble", a, w, preferred_element_type=jnp.float32)
  a = norm(f32)
  q, k, v = mm(a, wq), mm(a, wk), mm(a, wv)
  scores = jnp.einsum("bld,bmd->blm", q, k) * (1.0 / q.shape[-1] ** 0.5)
  attn = jnp.einsum("blm,bmd->bld", jax.nn.softmax(scores, axis=-1), v)
  f32 = f32 + mm(attn.astype(h.dtype), wo)
  hidden = jnp.maximum(mm(norm(f32), w1), 0.0).astype(h.dtype)
  return (f32 + mm(hidden, w2) - x.astype(jnp.float32)).astype(h.dtype)


def deq(params, h, x):
  """A deep-equilibrium layer h <- tanh(h W + x U) (W a contraction). 4 D^2."""
  w, u = params
  return jnp.tanh(_mm(h, w) + _mm(x, u)).astype(h.dtype)


def untied_rnn(params, h, x, *, index):
  """A tanh RNN with a different layer per step (untied, `step_index=True`):
  h <- tanh(h W[index] + x U + b[index]), W [UNTIED_LAYERS, D, D]. 4 D^2."""
  w, u, b = params
  return jnp.tanh(_mm(h, w[index]) + _mm(x, u) + b[index].astype(jnp.float32)).astype(h.dtype)


# --- Hoisted by hand: what a careful user writes instead of iterate ---------
#
# Each block's state-independent part (`x U + b`, a gate's `x U`) computed
# once before a loop, and the step that takes it: the masked scan of the
# second form is the "hoisted scan" baseline (`harness.hoisted_scan`).


def tanh_rnn_inputs(params, x):
  """x U + b, float32 [B, D]."""
  _, u, b = params
  return _mm(x, u) + b.astype(jnp.float32)


def tanh_rnn_hoisted(params, h, xu):
  w = params[0]
  return jnp.tanh(_mm(h, w) + xu).astype(h.dtype)


def gru_inputs(params, x):
  """(x Uz, x Ur, x Uh), float32 [B, D] each."""
  return tuple(_mm(x, u) for u in params[1])


def gru_hoisted(params, h, xu):
  (wz, wr, wh), _ = params
  xz, xr, xh = xu
  hf = h.astype(jnp.float32)
  z = jax.nn.sigmoid(_mm(h, wz) + xz)
  r = jax.nn.sigmoid(_mm(h, wr) + xr)
  cand = jnp.tanh(_mm((r * hf).astype(h.dtype), wh) + xh)
  return ((1.0 - z) * hf + z * cand).astype(h.dtype)


def lstm_inputs(params, x):
  """x U per gate (i, f, o, g), float32 [B, D] each."""
  return tuple(_mm(x, u) for u in params[1])


def lstm_hoisted(params, state, xu):
  w = params[0]
  h, c = state
  gate = lambda k: _mm(h, w[k]) + xu[k]
  i, f, o = (jax.nn.sigmoid(gate(k)) for k in range(3))
  g = jnp.tanh(gate(3))
  c_new = f * c.astype(jnp.float32) + i * g
  return (o * jnp.tanh(c_new)).astype(h.dtype), c_new.astype(c.dtype)


@dataclasses.dataclass(frozen=True)
class Block:
  """A block with what benchmarks need to count its work."""

  name: str
  step: Callable[..., Any]
  flops_per_row_step: Callable[[int], int]   # D -> FLOPs
  # The state-dependent products' FLOPs per row-step (D -> FLOPs): what the
  # matrix unit must do inside the loop once the rest is hoisted; the
  # numerator of the bound (`device_timing.bound_ns_per_row_step`).
  loop_flops_per_row_step: Callable[[int], int] | None = None
  # (inputs(params, x) -> xu, step(params, h, xu) -> h): the block hoisted
  # by hand, or None where nothing but x itself is state-independent.
  hoisted: tuple[Callable[..., Any], Callable[..., Any]] | None = None


BLOCKS = {
    "tanh_rnn": Block("tanh_rnn", tanh_rnn, lambda d: 4 * d * d, lambda d: 2 * d * d,
                      (tanh_rnn_inputs, tanh_rnn_hoisted)),
    "residual_mlp": Block("residual_mlp", residual_mlp, lambda d: 16 * d * d,
                          lambda d: 16 * d * d),
    "lstm": Block("lstm", lstm, lambda d: 16 * d * d, lambda d: 8 * d * d,
                  (lstm_inputs, lstm_hoisted)),
    "residual_mlp_ln": Block("residual_mlp_ln", residual_mlp_ln, lambda d: 16 * d * d),
    "deq": Block("deq", deq, lambda d: 4 * d * d),
    "gru": Block("gru", gru, lambda d: 12 * d * d, lambda d: 6 * d * d,
                 (gru_inputs, gru_hoisted)),
    "untied_rnn": Block("untied_rnn", untied_rnn, lambda d: 4 * d * d),
    "transformer": Block("transformer", transformer,
                         lambda d: SEQ_LEN * 24 * d * d + 4 * SEQ_LEN * SEQ_LEN * d),
}

SEQ_LEN = 8  # tokens per row of the transformer block


def hoisted_form(step: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """`Block.hoisted` of the block whose step is `step`.

  Raises:
    ValueError: `step` is no block's, or its block has no hoisted form.
  """
  for block in BLOCKS.values():
    if block.step is step and block.hoisted is not None:
      return block.hoisted
  raise ValueError(f"{getattr(step, '__name__', step)!r} is not a block with a hoisted form")
UNTIED_LAYERS = 16  # per-step layers of the untied RNN: its max_iters at most this


def make(name: str, batch: int, d: int, dtype=jnp.float32, key=None):
  """(step, params, h0, x) for block `name` with B=batch rows of width d."""
  key = jax.random.key(0) if key is None else key
  keys = jax.random.split(key, 12)
  scale = 0.9 / jnp.sqrt(d)
  normal = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)
  x = jax.random.normal(keys[0], (batch, d), jnp.float32).astype(dtype)
  h0 = (0.5 * jax.random.normal(keys[1], (batch, d), jnp.float32)).astype(dtype)
  if name == "tanh_rnn":
    params = (normal(keys[2], (d, d)), normal(keys[3], (d, d)),
              (0.1 * jax.random.normal(keys[4], (d,), jnp.float32)).astype(dtype))
  elif name == "untied_rnn":
    params = (normal(keys[2], (UNTIED_LAYERS, d, d)), normal(keys[3], (d, d)),
              (0.1 * jax.random.normal(keys[4], (UNTIED_LAYERS, d), jnp.float32)).astype(dtype))
  elif name == "residual_mlp":
    # Small residual branch: 64 steps stay O(1).
    params = (normal(keys[2], (d, 4 * d)), (0.05 * normal(keys[3], (4 * d, d))).astype(dtype))
    x = (0.01 * x.astype(jnp.float32)).astype(dtype)
  elif name == "residual_mlp_ln":
    params = (normal(keys[2], (d, 4 * d)), (0.05 * normal(keys[3], (4 * d, d))).astype(dtype),
              (1.0 + 0.1 * jax.random.normal(keys[4], (d,), jnp.float32)).astype(dtype),
              (0.1 * jax.random.normal(keys[5], (d,), jnp.float32)).astype(dtype))
    x = (0.01 * x.astype(jnp.float32)).astype(dtype)
  elif name == "deq":
    # Per-row input scale spreads the convergence speed across rows.
    params = (normal(keys[2], (d, d)), normal(keys[3], (d, d)) / 0.9)
    x = (x.astype(jnp.float32) * jnp.linspace(0.1, 3.0, batch)[:, None]).astype(dtype)
    h0 = jnp.zeros((batch, d), dtype)
  elif name == "gru":
    params = (tuple(normal(keys[2 + i], (d, d)) for i in range(3)),
              tuple(normal(keys[5 + i], (d, d)) for i in range(3)))
  elif name == "transformer":
    x = (0.1 * jax.random.normal(keys[0], (batch, SEQ_LEN, d), jnp.float32)).astype(dtype)
    h0 = (0.5 * jax.random.normal(keys[1], (batch, SEQ_LEN, d), jnp.float32)).astype(dtype)
    # Small residual branches: many steps stay O(1).
    params = tuple(normal(keys[2 + i], (d, d)) for i in range(3)) + (
        (0.1 * normal(keys[5], (d, d))).astype(dtype),
        normal(keys[6], (d, 4 * d)), (0.1 * normal(keys[7], (4 * d, d))).astype(dtype))
  elif name == "lstm":
    params = (tuple(normal(keys[2 + i], (d, d)) for i in range(4)),
              tuple(normal(keys[6 + i], (d, d)) for i in range(4)))
    h0 = (h0, jnp.zeros((batch, d), dtype))
  else:
    raise ValueError(f"unknown block {name!r}; known: {sorted(BLOCKS)}")
  return BLOCKS[name].step, params, h0, x
