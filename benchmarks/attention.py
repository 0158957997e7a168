"""Multi-head attention steps as the libraries write them, for the compile checks.

A Universal Transformer's step is a transformer encoder layer applied to each
row's tokens: h [B, L, D] (L tokens per row; attention only within a row).
Written with a library's own attention, its dots have two batch axes (the
rows and the heads), which the TPU compiler of JAX 0.10.2 does not take
('tpu.matmul' op Not implemented: Up to 1 batch dim supported), and its
backward keeps [TB, H, L, L] probabilities and [TB, L, H, K] heads alive.
The blocks of `benchmarks/blocks.py` write attention another way (one head,
`einsum("bld,bmd->blm")`), so these steps stand beside them:

* `flax`: a pre-norm encoder layer of Flax linen modules
  (`nn.MultiHeadDotProductAttention`, `nn.LayerNorm`, `nn.Dense`), as a Flax
  Universal Transformer with ACT writes its shared layer; the step is
  `module.apply(params, h + x)`.
* `equinox`: the same layer of Equinox modules (`eqx.nn.MultiheadAttention`,
  `eqx.nn.LayerNorm`, `eqx.nn.Linear`), written for one example ([L, D]) as
  Equinox writes everything, run with `iterate(..., per_example=True)`, so
  the heads are vmapped inside the rows' vmap.
* `einsum`: the same layer in raw `jnp.einsum`s, heads a separate axis:
  `einsum("bqhd,bkhd->bhqk")` and `einsum("bhqk,bkhd->bqhd")`, rows and
  heads both batch axes.

`make(style, batch, d, dtype)` returns `(step, params, h0, x, options)`,
`options` the keyword arguments of `iterate` the style needs. Flax and
Equinox are imported only when their style is made (optional extras).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

STYLES = ("flax", "equinox", "einsum")
HEADS = 4
TOKENS = 8  # tokens per row (the UT-ACT classifier: 8)


def _flax_layer(d: int, mlp: int, heads: int, dtype):
  from flax import linen as nn  # pylint: disable=g-import-not-at-top

  class EncoderLayer(nn.Module):
    """Pre-norm: h + MHA(LN(h)), then + MLP(LN(.)), as Flax's examples write it."""

    @nn.compact
    def __call__(self, h):
      a = nn.LayerNorm(dtype=dtype, param_dtype=dtype)(h)
      a = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=d, dtype=dtype,
                                          param_dtype=dtype, deterministic=True)(a)
      h = h + a
      m = nn.LayerNorm(dtype=dtype, param_dtype=dtype)(h)
      m = nn.Dense(mlp, dtype=dtype, param_dtype=dtype)(m)
      m = nn.Dense(d, dtype=dtype, param_dtype=dtype)(nn.relu(m))
      return h + m

  return EncoderLayer()


def _equinox_layer(d: int, mlp: int, heads: int, dtype, key):
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class EncoderLayer(eqx.Module):
    """One example's tokens [L, D], as Equinox writes a transformer layer."""

    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 3)
      self.attention = eqx.nn.MultiheadAttention(heads, d, key=k[0], dtype=dtype)
      self.norm1 = eqx.nn.LayerNorm(d, dtype=dtype)
      self.norm2 = eqx.nn.LayerNorm(d, dtype=dtype)
      self.up = eqx.nn.Linear(d, mlp, key=k[1], dtype=dtype)
      self.down = eqx.nn.Linear(mlp, d, key=k[2], dtype=dtype)

    def __call__(self, h):
      a = jax.vmap(self.norm1)(h)
      h = h + self.attention(a, a, a)
      m = jax.vmap(self.norm2)(h)
      return h + jax.vmap(self.down)(jax.nn.relu(jax.vmap(self.up)(m)))

  return EncoderLayer(key)


def einsum_layer(params: dict, h: jax.Array) -> jax.Array:
  """The encoder layer in raw einsums: h [B, L, D]; params as `_einsum_params`."""
  f32 = h.astype(jnp.float32)

  def norm(a, gain, bias):
    mu = jnp.mean(a, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(a - mu), axis=-1, keepdims=True)
    return ((a - mu) * jax.lax.rsqrt(var + 1e-6) * gain.astype(jnp.float32)
            + bias.astype(jnp.float32)).astype(h.dtype)

  a = norm(f32, params["ln1_g"], params["ln1_b"])
  q = jnp.einsum("bld,dhk->blhk", a, params["wq"])
  k = jnp.einsum("bld,dhk->blhk", a, params["wk"])
  v = jnp.einsum("bld,dhk->blhk", a, params["wv"])
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(h.dtype)
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(h.dtype)
  attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  f32 = f32 + jnp.einsum("bqhd,hde->bqe", attn, params["wo"]).astype(jnp.float32)
  m = norm(f32, params["ln2_g"], params["ln2_b"])
  m = jax.nn.relu(jnp.einsum("bld,df->blf", m, params["w1"]))
  return (f32 + jnp.einsum("blf,fd->bld", m, params["w2"]).astype(jnp.float32)).astype(h.dtype)


def _einsum_params(key, d: int, mlp: int, heads: int, dtype) -> dict:
  k = jax.random.split(key, 6)
  normal = lambda k_, shape, fan_in: (jax.random.normal(k_, shape, jnp.float32)
                                      / jnp.sqrt(fan_in)).astype(dtype)
  per_head = (d, heads, d // heads)
  return {"wq": normal(k[0], per_head, d), "wk": normal(k[1], per_head, d),
          "wv": normal(k[2], per_head, d), "wo": normal(k[3], (heads, d // heads, d), d),
          "w1": normal(k[4], (d, mlp), d), "w2": normal(k[5], (mlp, d), mlp),
          "ln1_g": jnp.ones((d,), dtype), "ln1_b": jnp.zeros((d,), dtype),
          "ln2_g": jnp.ones((d,), dtype), "ln2_b": jnp.zeros((d,), dtype)}


def _add_input(layer, params, h, x):
  return layer(params, (h.astype(jnp.float32) + x.astype(jnp.float32)).astype(h.dtype))


def make(style: str, batch: int, d: int = 128, dtype: Any = jnp.float32, *,
         heads: int = HEADS, tokens: int = TOKENS, mlp: int | None = None,
         key: jax.Array | None = None) -> tuple[Any, Any, Any, Any, dict]:
  """A transformer encoder layer as a step of `iterate`, written in `style`.

  Args:
    style: "flax", "equinox" or "einsum" (see the module docstring).
    batch: B, the rows (examples).
    d: the model width D (a multiple of `heads`).
    dtype: of the parameters and the state (the layer computes in it;
      softmax and norms in float32 where the library does).
    heads: attention heads.
    tokens: L, tokens per row.
    mlp: the MLP's hidden width (default 4 D).
    key: for the parameters and inputs (default `jax.random.key(0)`).

  Returns:
    (step, params, h0, x, options): `step(params, h, x)`, with `h`, `x`
    [B, L, D] (one example's [L, D] where `options` has `per_example=True`);
    `options` the keyword arguments `iterate` needs for this style.

  Example:
    >>> step, params, h0, x, options = make("einsum", 4, 16, heads=2, tokens=3)
    >>> step(params, h0, x).shape, options
    ((4, 3, 16), {})
  """
  if style not in STYLES:
    raise ValueError(f"{style=} is not one of {STYLES}")
  if d % heads:
    raise ValueError(f"{d=} must be a multiple of {heads=}")
  dtype = jnp.dtype(dtype)
  mlp = 4 * d if mlp is None else mlp
  key = jax.random.key(0) if key is None else key
  k_params, k_h, k_x = jax.random.split(key, 3)
  h0 = (0.5 * jax.random.normal(k_h, (batch, tokens, d), jnp.float32)).astype(dtype)
  x = (0.1 * jax.random.normal(k_x, (batch, tokens, d), jnp.float32)).astype(dtype)
  options: dict = {}
  if style == "flax":
    module = _flax_layer(d, mlp, heads, dtype)
    params = module.init(k_params, h0[:1])
    step = functools.partial(_add_input, module.apply)
  elif style == "equinox":
    import equinox as eqx  # pylint: disable=g-import-not-at-top
    params, static = eqx.partition(_equinox_layer(d, mlp, heads, dtype, k_params),
                                   eqx.is_array)
    step = functools.partial(_add_input, lambda p, h: eqx.combine(p, static)(h))
    options["per_example"] = True
  else:
    params = _einsum_params(k_params, d, mlp, heads, dtype)
    step = functools.partial(_add_input, einsum_layer)
  return step, params, h0, x, options
