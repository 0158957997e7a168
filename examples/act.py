"""Adaptive Computation Time (Graves 2016) on `iterate`, per example and per token.

    pip install -e ".[examples]"          # optax
    python examples/act.py [--quick] [--steps N] [--implementation xla|pallas]

ACT lets a network decide how many times to apply a block (tied layers: the
same parameters every step). Each step n also emits a halting probability
h_n; a unit stops after the first step N at which sum_{m<=N} h_m >= 1 - eps
(at most M steps), the last step's weight is the remainder
R = 1 - sum_{n<N} h_n, the output is sum_n w_n y_n (w_n = h_n, w_N = R), and
the ponder cost N + R, scaled by tau, is added to the loss.
`pallas_loop.halting.act` turns a block `(params, s, x) -> (s_new, y, h)`
into the step and the halting criterion for `iterate`; the ACT books
(cumulative probability, remainder, weighted output, int32 step counter,
halted flag) travel in the state, and `halt=` stops each row.

Part 1, per example: Graves' parity task. The input is a vector of L = 6
entries, a random number of them +-1 and the rest 0; the target is whether
the number of +1 entries is odd. Each example is one row and halts on its own.

Part 2, per token: a one-layer Universal-Transformer-style block (single-head
self-attention over the T tokens of a row, then a tanh layer) where each
token halts on its own. Tokens attend to each other, so they cannot be rows
of `iterate` (rows must be independent): the row is the example, each
token's halting is a mask inside the row (a halted token keeps its state,
still visible to the attention of the others), and the row stops when its
last token halts. The task: at every position, whether the sequence has more
+1 than -1 tokens up to and including that position (it needs the tokens on
the left, so attention must do some work).

Both are trained with optax Adam (800 steps on fresh batches of 128; the
time since the start of training, compilation included, is printed) and print the loss, the accuracy and the
ponder (mean N, and the spread of N over rows or tokens); then, on a fresh
batch, the accuracy and mean N by number of non-zero entries (parity) or
by position (tokens). Before training, one forward is checked against the
library's `lax.scan` oracle with the same ACT step.

Quick mode (used by the tests): 12 steps on batches of 32, no report by group.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop import halting

try:
  import optax
except ImportError:  # an optional extra: say how to get it instead of hand-rolling Adam
  optax = None

INSTALL_HINT = 'examples/act.py needs optax: pip install -e ".[examples]"'


def dense(key, fan_in, fan_out, scale=1.0):
  return scale * jax.random.normal(key, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)


# ---------------------------------------------------------------------------
# Part 1: per example (parity)
# ---------------------------------------------------------------------------


def parity_params(key, length, width):
  k = jax.random.split(key, 4)
  return {"W": dense(k[0], width, width), "U": dense(k[1], length, width, 2.0),
          "b": jnp.zeros((width,)), "wh": dense(k[2], width, 1)[:, 0],
          "bh": jnp.float32(1.0),     # Graves: a positive initial halting bias
          "V": dense(k[3], width, 1), "c": jnp.zeros((1,))}


def parity_block(p, s, x):
  """One ponder step: s [R, W]; x [R, L], the input, read at every step.

  (Graves also feeds a flag that marks the first ponder step; this block
  does without it.)

  Returns the new state, the step's logit y_n [R, 1] and h_n [R].
  """
  s_new = jnp.tanh(s @ p["W"] + x @ p["U"] + p["b"])
  return s_new, s_new @ p["V"] + p["c"], jax.nn.sigmoid(s_new @ p["wh"] + p["bh"])


def parity_batch(key, batch, length):
  """Inputs in {-1, 0, 1} (a random number of non-zeros), target: odd number of +1."""
  k = jax.random.split(key, 3)
  nonzero = jnp.arange(length) < jax.random.randint(k[0], (batch, 1), 1, length + 1)
  sign = jnp.where(jax.random.bernoulli(k[1], 0.5, (batch, length)), 1.0, -1.0)
  bits = jnp.where(nonzero, sign, 0.0)
  bits = jax.random.permutation(k[2], bits, axis=1, independent=True)
  target = (jnp.sum(bits > 0, axis=1) % 2).astype(jnp.float32)
  return bits, target


# ---------------------------------------------------------------------------
# Part 2: per token (a Universal-Transformer-style block)
# ---------------------------------------------------------------------------


def token_params(key, seq, width):
  k = jax.random.split(key, 7)
  return {"Wq": dense(k[0], width, width), "Wk": dense(k[1], width, width),
          "Wv": dense(k[2], width, width), "W": dense(k[3], width, width),
          "U": dense(k[4], 2, width, 2.0), "pos": 0.5 * jax.random.normal(k[5], (seq, width)),
          "b": jnp.zeros((width,)), "wh": dense(k[6], width, 1)[:, 0], "bh": jnp.float32(1.0),
          "V": jnp.zeros((width, 1)), "c": jnp.zeros((1,))}


def token_block(p, s, x):
  """One ponder step for every token of the row: s [R, T, W], x [R, T, 2].

  Causal single-head attention over the row's tokens, then a tanh layer.
  Returns the new state, the logits y_n [R, T, 1] and h_n [R, T].
  """
  seq = s.shape[1]
  q, k, v = s @ p["Wq"], s @ p["Wk"], s @ p["Wv"]
  scores = jnp.einsum("rtd,rsd->rts", q, k) / np.sqrt(s.shape[-1])
  causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
  att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  ctx = jnp.einsum("rts,rsd->rtd", att, v)
  s_new = jnp.tanh(s + ctx @ p["W"] + x @ p["U"] + p["pos"] + p["b"])
  return s_new, s_new @ p["V"] + p["c"], jax.nn.sigmoid(s_new @ p["wh"] + p["bh"])


def token_batch(key, batch, seq):
  """Tokens +-1; target at t: more +1 than -1 among tokens 0..t (ties: 0)."""
  tokens = jnp.where(jax.random.bernoulli(key, 0.5, (batch, seq)), 1.0, -1.0)
  target = (jnp.cumsum(tokens, axis=1) > 0).astype(jnp.float32)
  return tokens, target


# ---------------------------------------------------------------------------
# ACT, training, reporting
# ---------------------------------------------------------------------------


def act_forward(block, params, s0, x, args, iterate=pallas_loop.iterate):
  a = halting.act(block, max_iters=args.max_steps, eps=args.eps)
  return iterate(a.step, params, a.init(params, s0, x), x, max_iters=a.max_iters,
                 halt=a.halt)


def make_problem(part, args):
  """(block, params, batch(key) -> (s0, x, target)) for one part."""
  if part == "parity":
    def batch(key):
      bits, target = parity_batch(key, args.batch, args.length)
      return jnp.zeros((args.batch, args.width)), bits, target[:, None]
    return parity_block, parity_params(jax.random.key(args.seed), args.length, args.width), batch

  def batch(key):
    tokens, target = token_batch(key, args.batch, args.seq)
    x = jnp.stack([tokens, jnp.ones_like(tokens)], axis=-1)
    return jnp.zeros((args.batch, args.seq, args.width)), x, target[..., None]
  return token_block, token_params(jax.random.key(args.seed), args.seq, args.width), batch


def make_train_step(block, args, optimizer, iterate):
  def loss_fn(params, s0, x, target):
    h = act_forward(block, params, s0, x, args, iterate)
    bce = optax.sigmoid_binary_cross_entropy(h.output, target).mean()
    ponder = h.ponder_cost.mean()
    accuracy = jnp.mean((h.output > 0) == (target > 0.5))
    return bce + args.tau * ponder, (bce, ponder, accuracy, h.steps)

  @jax.jit
  def train_step(params, opt_state, s0, x, target):
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, s0, x, target)
    # optax's Adam bias correction computes `decay ** count` (a Python float to
    # an int32 power), which strict dtype promotion (our tests) rejects; the
    # model is strict-clean, so relax promotion for the optimizer only.
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, aux

  return train_step


def check_against_oracle(block, params, batch_fn, args, iterate):
  """max |output - oracle| and whether N agrees, the oracle being reference.iterate
  (a masked lax.scan over max_steps) with the same ACT step and halt."""
  s0, x, _ = batch_fn(jax.random.key(args.seed + 1))
  a = halting.act(block, max_iters=args.max_steps, eps=args.eps)
  h0 = a.init(params, s0, x)
  got = iterate(a.step, params, h0, x, max_iters=a.max_iters, halt=a.halt)
  want = reference.iterate(a.step, params, h0, x, max_iters=a.max_iters, halt=a.halt)
  return (float(jnp.max(jnp.abs(got.output - want.output))),
          bool(jnp.all(got.steps == want.steps)))


def train(part, args, iterate):
  block, params, batch_fn = make_problem(part, args)
  err, same_n = check_against_oracle(block, params, batch_fn, args, iterate)
  print(f"  forward vs the lax.scan oracle: max |output difference| {err:.1e}, "
        f"N {'identical' if same_n else 'DIFFERENT'}")
  ok = err <= 1e-5 and same_n
  optimizer = optax.adam(args.lr)
  opt_state = optimizer.init(params)
  train_step = make_train_step(block, args, optimizer, iterate)
  start, losses = time.perf_counter(), []
  for i, key in enumerate(jax.random.split(jax.random.key(args.seed + 2), args.steps)):
    params, opt_state, (bce, ponder, acc, steps) = train_step(params, opt_state,
                                                              *batch_fn(key))
    losses.append(float(bce))
    if i % max(1, args.steps // 8) == 0 or i == args.steps - 1:
      n = np.asarray(steps)
      print(f"  step {i:3d}  loss {float(bce):.4f}  accuracy {float(acc):.3f}  "
            f"ponder N+R {float(ponder):5.2f}  N: mean {n.mean():5.2f} min {n.min()} "
            f"max {n.max()}  {time.perf_counter() - start:5.1f} s")
  ok &= bool(np.all(np.isfinite(losses)))
  if not args.quick:          # one more compile: not in the tests' quick run
    report_ponder(part, block, params, args, iterate)
  return ok


def report_ponder(part, block, params, args, iterate):
  """Accuracy and mean N on a fresh batch, grouped by what makes an input hard."""
  key = jax.random.key(args.seed + 3)
  if part == "parity":
    bits, target = parity_batch(key, 1024, args.length)
    h = act_forward(block, params, jnp.zeros((1024, args.width)), bits, args, iterate)
    group, name = np.asarray(jnp.sum(bits != 0, axis=1)), "non-zero entries"
    right = np.asarray((h.output[:, 0] > 0) == (target > 0.5))
  else:
    tokens, target = token_batch(key, 1024, args.seq)
    x = jnp.stack([tokens, jnp.ones_like(tokens)], axis=-1)
    h = act_forward(block, params, jnp.zeros((1024, args.seq, args.width)), x, args, iterate)
    group = np.broadcast_to(np.arange(args.seq), tokens.shape).ravel()
    name = "position"
    right = np.asarray((h.output[..., 0] > 0) == (target > 0.5)).ravel()
  n = np.asarray(h.steps).ravel()
  print(f"  fresh batch of 1024: accuracy {right.mean():.3f}, mean N {n.mean():.2f}; "
        f"by {name}:")
  print("    " + "  ".join(f"{g}: N {n[group == g].mean():.2f} acc {right[group == g].mean():.2f}"
                          for g in np.unique(group)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="fewer, smaller optimizer steps (used by the tests)")
  parser.add_argument("--steps", type=int, default=None, help="optimizer steps per part")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--implementation", default=None, choices=["pallas", "xla"],
                      help="default: the kernel on GPU/TPU, XLA on CPU")
  args = parser.parse_args(argv)
  if optax is None:
    print(INSTALL_HINT, file=sys.stderr)
    return 2
  args.length, args.seq, args.width = 6, 8, 32
  args.batch = 32 if args.quick else 128
  args.steps = args.steps or (12 if args.quick else 800)
  args.max_steps, args.eps, args.tau, args.lr = 10, 0.01, 1e-3, 3e-3
  iterate = functools.partial(pallas_loop.iterate,
                              options=pallas_loop.Options(implementation=args.implementation))
  print(f"ACT: max_iters M={args.max_steps}, eps={args.eps}, ponder weight tau={args.tau}; "
        f"Adam lr {args.lr}, batch {args.batch}, {args.steps} steps per part; "
        f"{jax.devices()[0].platform.upper()}")
  print(f"\n1. per example: parity of {args.length}-entry vectors (one row = one example)")
  ok = train("parity", args, iterate)
  print(f"\n2. per token: {args.seq} tokens per row, causal attention; each token halts "
        "on its own")
  ok &= train("tokens", args, iterate)
  print("\nOK" if ok else "\nFAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
