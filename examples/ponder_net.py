"""PonderNet (Banino et al. 2021) on `iterate`: per-step outputs for training,
sampled halting for inference.

    python examples/ponder_net.py            # parity of 8 bits, 600 Adam steps
    python examples/ponder_net.py --quick    # a few steps (the test runs this)

Training runs every row for `N` steps and takes each step's prediction y_n and
halting probability lambda_n as per-step outputs (`step_outputs=True`):

    p_n  = lambda_n * prod_{j<n} (1 - lambda_j)      (lambda_N := 1: halt by N)
    loss = sum_n p_n * BCE(y_n, target) + beta * KL(p || Geometric(lambda_p))

with the geometric prior truncated at N and renormalised. Inference samples
halting: at step n a row stops with probability lambda_n (a Bernoulli draw on
the row's per-step key, carried in the state as a bool), so rows stop at
different steps and `iterate` stops computing them; the answer is the last
step's prediction. Needs optax (the `examples` extra).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop

BITS, HIDDEN, N = 8, 64, 12
BETA, LAMBDA_P = 0.01, 0.2


def init(key: jax.Array) -> dict:
  k = jax.random.split(key, 4)
  return {"w": 0.9 * jax.random.normal(k[0], (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN),
          "u": jax.random.normal(k[1], (BITS, HIDDEN)) / np.sqrt(BITS),
          "b": jnp.zeros((HIDDEN,)),
          "out": jax.random.normal(k[2], (HIDDEN,)) / np.sqrt(HIDDEN),
          "halt": jax.random.normal(k[3], (HIDDEN,)) / np.sqrt(HIDDEN),
          "halt_bias": jnp.array(-1.0)}


def cell(params: dict, h: jax.Array, x: jax.Array) -> tuple[jax.Array, dict]:
  """One step: the new state, its prediction (a logit) and halting probability."""
  h = jnp.tanh(h @ params["w"] + x @ params["u"] + params["b"])
  lam = jax.nn.sigmoid(jnp.sum(h * params["halt"], axis=-1) + params["halt_bias"])
  return h, {"logit": jnp.sum(h * params["out"], axis=-1), "lam": lam}


def halting_distribution(lam: jax.Array) -> jax.Array:
  """p_n [N, B] from lambda_n [N, B], the last step absorbing the rest."""
  lam = lam.at[-1].set(1.0)
  survive = jnp.cumprod(jnp.concatenate([jnp.ones_like(lam[:1]), 1 - lam[:-1]]), axis=0)
  return lam * survive


def geometric_prior(n: int) -> jax.Array:
  p = LAMBDA_P * (1 - LAMBDA_P) ** jnp.arange(n, dtype=jnp.float32)
  return p / jnp.sum(p)


def loss_fn(params: dict, x: jax.Array, target: jax.Array) -> tuple[jax.Array, dict]:
  """PonderNet's loss: the expected reconstruction loss under p_n plus the KL
  to the geometric prior. Every row runs N steps (training needs them all)."""
  h0 = jnp.zeros((x.shape[0], HIDDEN))
  _, ys = pallas_loop.iterate(cell, params, h0, x, max_iters=N, step_outputs=True,
                              options=pallas_loop.Options(implementation="xla"))
  p = halting_distribution(ys["lam"])                       # [N, B]
  # softplus(l) - l t: smooth at l = 0 (a max/abs form has a kink there,
  # where autodiff picks one side: rows of all-zero inputs sit on it).
  bce = jax.nn.softplus(ys["logit"]) - ys["logit"] * target[None]   # [N, B]
  rec = jnp.mean(jnp.sum(p * bce, axis=0))
  prior = geometric_prior(N)[:, None]
  kl = jnp.mean(jnp.sum(p * (jnp.log(p + 1e-12) - jnp.log(prior)), axis=0))
  expected_steps = jnp.mean(jnp.sum(p * (1 + jnp.arange(N, dtype=jnp.float32))[:, None], axis=0))
  return rec + BETA * kl, {"rec": rec, "kl": kl, "expected_steps": expected_steps}


def sampled_cell(params: dict, state: tuple, x: jax.Array, *, key: jax.Array) -> tuple:
  """Inference: the cell, then a Bernoulli(lambda_n) draw on the row's key."""
  h, _ = state
  h, y = cell(params, h, x)
  stop = pallas_loop.random.uniform(key, y["lam"].shape) < y["lam"]
  return h, stop


def infer(params: dict, x: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(predicted bits [B], steps each row applied [B]) with sampled halting."""
  h0 = (jnp.zeros((x.shape[0], HIDDEN)), jnp.zeros((x.shape[0],), bool))
  (h, _), info = pallas_loop.iterate(
      sampled_cell, params, h0, x, max_iters=N, key=key, return_info=True,
      halt=lambda p, new, old, x_: new[1])
  return jnp.sum(h * params["out"], axis=-1) > 0, info.steps


def parity_batch(key: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
  """Inputs in {-1, 0, 1} (a random number of bits set) and their parity."""
  k1, k2 = jax.random.split(key)
  bits = jax.random.choice(k1, jnp.array([-1.0, 1.0]), (batch, BITS))
  keep = jax.random.uniform(k2, (batch, BITS)) < jax.random.uniform(k2, (batch, 1))
  x = jnp.where(keep, bits, 0.0)
  return x, (jnp.sum(x == 1.0, axis=-1) % 2).astype(jnp.float32)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few steps, small batches")
  parser.add_argument("--steps", type=int, default=None)
  args = parser.parse_args(argv)
  import optax  # pylint: disable=g-import-not-at-top

  steps = args.steps or (8 if args.quick else 600)
  batch = 64 if args.quick else 256
  params = init(jax.random.key(0))
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def train_step(params, state, key):
    x, target = parity_batch(key, batch)
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int32 and float
      updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss, aux

  start = time.perf_counter()
  first = None
  for i in range(steps):
    params, state, loss, aux = train_step(params, state, jax.random.key(i + 1))
    first = float(loss) if first is None else first
    if i % max(1, steps // 6) == 0 or i == steps - 1:
      print(f"step {i:4d}: loss {float(loss):.4f}  reconstruction {float(aux['rec']):.4f}  "
            f"KL {float(aux['kl']):.4f}  expected steps {float(aux['expected_steps']):.2f}")
  x, target = parity_batch(jax.random.key(10_000), 1024)
  predicted, halted_at = jax.jit(infer)(params, x, jax.random.key(7))
  accuracy = float(jnp.mean(predicted == (target > 0)))
  counts = np.bincount(np.asarray(halted_at), minlength=N + 1)[1:]
  print(f"inference on 1024 fresh examples, sampled halting: accuracy {accuracy:.3f}, "
        f"mean steps {float(jnp.mean(halted_at)):.2f} (rows halting at 1..{N}: "
        f"{counts.tolist()})")
  print(f"{time.perf_counter() - start:.1f} s")
  ok = np.isfinite(float(loss)) and np.all(np.asarray(halted_at) >= 1)
  ok = ok and (args.quick or float(loss) < first)
  print("OK" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
