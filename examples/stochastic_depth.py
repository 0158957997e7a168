"""Stochastic depth with dropout inside the loop: per-row depth, per-(row, step) keys.

    python examples/stochastic_depth.py [--quick] [--implementation {xla,pallas}]

A residual layer h <- h + 0.1 * dropout(relu(layer_norm(h) @ W + b), 0.5),
applied a different number of times per example: batch 32, features 64,
depth drawn uniformly in [1, 100] per row (`pallas_loop.sampling.uniform`),
`max_iters=100`, one `jit`-compiled call on the whole batch (no `vmap`).
Dropout draws a fresh mask for every row and step from the key `step`
receives (`pallas_loop.random.dropout`).

The result is checked against `reference.iterate` with the same key (a plain
masked `lax.scan` over 100 steps using the same key derivation): the same
masks, the same output, and the same gradients. Then both are timed
(median of several runs, forward and forward + backward), next to the
masked scan the user wrote by hand (`vmap` of a 100-step `lax.scan` with
`lax.cond` and `jax.random` keys split per step; different random streams,
so it is timed, not compared). On CPU the default implementation is the XLA
loop and the timings are CPU timings; on a GPU the default is the Triton
kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import random as prandom
from pallas_loop import sampling
from pallas_loop import _reference as reference

BATCH, FEATURES, MAX_ITERS, RATE, SCALE = 32, 64, 100, 0.5, 0.1


def residual_layer(params, h, x, key):
  """One residual block with dropout; `key` is uint32 [rows, 2], one per row."""
  del x
  w, b = params
  # Layer norm over features (a reduction within the row: rows stay independent).
  mu = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(h - mu), axis=-1, keepdims=True)
  z = jnp.dot((h - mu) * lax.rsqrt(var + 1e-5), w, preferred_element_type=jnp.float32) + b
  return h + SCALE * prandom.dropout(key, jax.nn.relu(z), RATE)


def user_masked_scan(params, h0, depth, key):
  """The user's version (one example): 100 steps, `lax.cond(t < depth, ...)`."""
  w, b = params
  keys = jax.random.split(key, MAX_ITERS)

  def layer(h, k):
    mu = jnp.mean(h)
    z = (h - mu) * lax.rsqrt(jnp.mean(jnp.square(h - mu)) + 1e-5) @ w + b
    keep = jax.random.bernoulli(k, 1 - RATE, z.shape)
    return h + SCALE * jnp.where(keep, jax.nn.relu(z) / (1 - RATE), 0)

  def body(carry, k):
    h, t = carry
    return (lax.cond(t < depth, lambda: layer(h, k), lambda: h), t + 1), None

  return lax.scan(body, (h0, 0), keys)[0][0]


def median_seconds(fn, *args, repeats: int) -> float:
  """Median wall time of `fn(*args)` (compiled by a first, untimed call)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer timing repeats (used by the tests)")
  parser.add_argument("--implementation", default=None, choices=["pallas", "xla"],
                      help="default: the kernel on GPU/TPU, XLA on CPU")
  parser.add_argument("--repeats", type=int, default=None, help="timed runs per case")
  parser.add_argument("--no-timing", action="store_true", help="only check against the reference")
  args = parser.parse_args(argv)
  repeats = args.repeats or (3 if args.quick else 20)

  k_w, k_h, k_depth, k_drop, k_user = jax.random.split(jax.random.key(0), 5)
  params = (jax.random.normal(k_w, (FEATURES, FEATURES)) * np.sqrt(2.0 / FEATURES),
            jnp.zeros((FEATURES,)))
  h0 = jax.random.normal(k_h, (BATCH, FEATURES))
  depth = sampling.uniform(k_depth, BATCH, 1, MAX_ITERS)  # int32 [32] in [1, 100]

  def fused(params, h0, depth, key):
    return pallas_loop.iterate(residual_layer, params, h0, iters=depth, max_iters=MAX_ITERS,
                               key=key,
                               options=pallas_loop.Options(implementation=args.implementation))

  def masked_scan(params, h0, depth, key):
    return reference.iterate(residual_layer, params, h0, iters=depth, max_iters=MAX_ITERS,
                             key=key)

  def loss(run):
    return lambda params, h0, depth, key: jnp.mean(jnp.square(run(params, h0, depth, key)))

  fused_fwd, ref_fwd = jax.jit(fused), jax.jit(masked_scan)
  fused_grad = jax.jit(jax.value_and_grad(loss(fused)))
  ref_grad = jax.jit(jax.value_and_grad(loss(masked_scan)))
  user_fwd = jax.jit(jax.vmap(user_masked_scan, (None, 0, 0, 0)))
  user_grad = jax.jit(jax.value_and_grad(
      lambda p, h, d, k: jnp.mean(jnp.square(jax.vmap(user_masked_scan, (None, 0, 0, 0))(p, h, d, k)))))
  user_keys = jax.random.split(k_user, BATCH)

  print(f"batch {BATCH}, features {FEATURES}, dropout {RATE}, depth per row uniform in "
        f"[1, {MAX_ITERS}]: {np.asarray(depth)[:8].tolist()} ...; max_iters={MAX_ITERS}")
  print(f"work: {int(depth.sum())} row-steps applied of {BATCH * MAX_ITERS} a masked scan computes")

  got, want = fused_fwd(params, h0, depth, k_drop), ref_fwd(params, h0, depth, k_drop)
  scale = float(jnp.max(jnp.abs(want)))
  err = float(jnp.max(jnp.abs(got - want)))
  (l_got, g_got), (l_want, g_want) = (fused_grad(params, h0, depth, k_drop),
                                      ref_grad(params, h0, depth, k_drop))
  g_err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
              for a, b in zip(jax.tree_util.tree_leaves(g_got), jax.tree_util.tree_leaves(g_want)))
  # Dropout really fired: the same rows without dropout differ.
  zero_rate = float(jnp.mean(prandom.dropout(
      prandom.step_keys(prandom.key_data(k_drop), jnp.arange(BATCH)[:, None],
                        jnp.zeros((BATCH, 1), jnp.int32)), jnp.ones((BATCH, FEATURES)), RATE) == 0))
  print(f"vs reference.iterate with the same key: max |h - ref| = {err:.1e} (max |ref| = "
        f"{scale:.1f}); loss {float(l_got):.6f} vs {float(l_want):.6f}; max relative gradient "
        f"difference {g_err:.1e}; fraction dropped at step 0: {zero_rate:.2f}")
  ok = err <= 1e-5 * max(1.0, scale) and g_err <= 1e-4 and abs(zero_rate - RATE) < 0.05

  if args.no_timing:
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1

  platform = jax.devices()[0].platform.upper()
  impl = args.implementation or ("xla" if platform == "CPU" else "kernel")
  print(f"\ntimes on {platform} ({jax.devices()[0].device_kind}), median of {repeats} runs, jit:")
  rows = [
      (f"pallas_loop.iterate ({impl})", fused_fwd, fused_grad, k_drop),
      ("reference.iterate (masked scan)", ref_fwd, ref_grad, k_drop),
      ("user's vmap(scan + lax.cond)", user_fwd, user_grad, user_keys),
  ]
  base = None
  for name, fwd, grad, key in rows:
    t_fwd = median_seconds(fwd, params, h0, depth, key, repeats=repeats)
    t_grad = median_seconds(grad, params, h0, depth, key, repeats=repeats)
    base = base or (t_fwd, t_grad)
    print(f"  {name:34s} forward {1e3 * t_fwd:8.2f} ms ({t_fwd / base[0]:5.2f}x)   "
          f"forward+backward {1e3 * t_grad:8.2f} ms ({t_grad / base[1]:5.2f}x)")
  print("  (in brackets: the time relative to pallas_loop.iterate's; > 1 means iterate is faster)")
  if platform == "CPU":
    print("  CPU timings: they show the loop works under jit, not GPU speed.")

  print("\nOK" if ok else "\nMISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
