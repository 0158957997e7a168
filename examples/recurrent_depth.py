"""A recurrent-depth network that learns prefix parity and thinks longer on longer inputs.

    pip install -e ".[examples]"          # optax (required), matplotlib (optional plot)
    python examples/recurrent_depth.py [--quick] [--steps N] [--plot PATH]

Task. Input: a bit string b_1..b_L. Output, at every position j, the parity
of the prefix: y_j = (b_1 + ... + b_j) mod 2. One example is one row of
`iterate`'s state, h [B, L, D]: a D-wide latent per position. The block
mixes each position with its left and right neighbours in the same row
(a width-3 convolution over positions, written as two shift matrices) and
re-reads the input bits at every step:

    a    = relu(W_l h[j-1] + W_h h[j] + W_r h[j+1] + w_x b_j + b_1)
    h[j] <- (1 - z) * h[j] + z * tanh(W_2 a + b_2),   z = sigmoid(W_z a + b_z)

so information moves one position per step: the parity of position j needs
about j steps, and a longer string needs more steps. A linear read-out of h
gives the logits. Rows never mix, so rows are examples and each can get its
own depth.

Training (the recurrent-depth recipe). Each example's depth is sampled
per step by `pallas_loop.sampling.truncated_split` (log-normal Poisson total,
mean `--mean`, capped at `--cap`), and the loss backpropagates through the
last k steps only: `grad=pallas_loop.Truncated(k)`. The earlier steps run
without saving anything, so the step must learn to improve whatever state
it is given: that is what lets the model run for more steps than it was
trained with. Optimizer: optax AdamW with gradient clipping.

Evaluation. Strings of the training length and 2x and 4x longer, run for
more steps than any training example got; each row is advanced from its
previous state (`iterate` again with `h0` = the last state), so one pass
gives the accuracy at every step count. Prints the per-position accuracy and
the fraction of strings entirely right, and saves a plot when matplotlib is
installed (skipped with a note otherwise).

Quick mode (used by the tests): 8-bit strings, 200 steps; it shows the
loss going down and checks one training gradient against
`reference.iterate` (same `Truncated(k)`), not the extrapolation.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import sampling
from pallas_loop import _reference as reference

try:
  import optax
except ImportError:  # an optional extra: say how to get it instead of hand-rolling Adam
  optax = None

INSTALL_HINT = ('examples/recurrent_depth.py needs optax: pip install -e ".[examples]" '
                '(or pip install optax)')


# ---------------------------------------------------------------------------
# Model. B: examples (rows)  L: positions  D: latent width  H: hidden width


def _shift(length: int, offset: int) -> jax.Array:
  """[L, L] matrix S with (S h)[j] = h[j + offset] (0 past the ends)."""
  i = lax.broadcasted_iota(jnp.int32, (length, length), 0)
  j = lax.broadcasted_iota(jnp.int32, (length, length), 1)
  return (j == i + offset).astype(jnp.float32)


def block(params, h, x):
  """One step on a group of rows. h: [R, L, D]; x: [R, L, 1] the bits as floats."""
  length = h.shape[1]
  # Neighbours within the row only (contracting over positions, never rows).
  left = jnp.einsum("ij,rjd->rid", _shift(length, -1), h)
  right = jnp.einsum("ij,rjd->rid", _shift(length, 1), h)
  a = jax.nn.relu(left @ params["w_left"] + h @ params["w_self"] + right @ params["w_right"]
                  + x * params["w_x"] + params["b_1"])
  candidate = jnp.tanh(a @ params["w_2"] + params["b_2"])
  z = jax.nn.sigmoid(a @ params["w_z"] + params["b_z"])
  return (1 - z) * h + z * candidate


def init_params(key, d: int, hidden: int):
  """Scaled-normal weights, zero biases."""
  ks = jax.random.split(key, 7)

  def normal(k, shape, fan_in):
    return jax.random.normal(k, shape) / np.sqrt(fan_in)

  return {
      "w_left": normal(ks[0], (d, hidden), 3 * d), "w_self": normal(ks[1], (d, hidden), 3 * d),
      "w_right": normal(ks[2], (d, hidden), 3 * d), "w_x": normal(ks[3], (1, hidden), 1.0),
      "b_1": jnp.zeros((hidden,)), "w_2": normal(ks[4], (hidden, d), hidden),
      "b_2": jnp.zeros((d,)), "w_z": normal(ks[5], (hidden, d), hidden), "b_z": jnp.zeros((d,)),
      "w_out": normal(ks[6], (d, 1), d), "b_out": jnp.zeros((1,)),
  }


def readout(params, h):
  """Logits [B, L] from the state [B, L, D]."""
  return (h @ params["w_out"] + params["b_out"])[..., 0]


def make_data(key, batch: int, length: int):
  """Random bit strings [B, L] (int32) and their prefix parities."""
  bits = jax.random.bernoulli(key, 0.5, (batch, length)).astype(jnp.int32)
  return bits, jnp.cumsum(bits, axis=1) % 2


def as_input(bits):
  return bits[..., None].astype(jnp.float32)


# ---------------------------------------------------------------------------
# Training and evaluation.


def make_loss(args, iterate):
  """Mean cross-entropy of the prefix parities after each row's own depth.

  `iterate` is `pallas_loop.iterate` (or the oracle, for the check).
  """

  def loss_fn(params, bits, targets, total):
    h0 = jnp.zeros(bits.shape + (args.width,))
    h = iterate(block, params, h0, as_input(bits), iters=total, max_iters=args.cap,
                grad=pallas_loop.Truncated(args.k))
    return jnp.mean(optax.sigmoid_binary_cross_entropy(readout(params, h), targets))

  return loss_fn


def sample_depths(args, key, batch: int):
  """Each example's TOTAL depth (log-normal Poisson); Truncated(k) backprops the last k."""
  return sampling.truncated_split(key, batch, args.k, mean=args.mean, sigma=0.5,
                                  cap=args.cap).total


def make_train_step(args, optimizer, loss_fn):
  """One jit-compiled optimizer step on a fresh batch with sampled depths."""

  @jax.jit
  def train_step(params, opt_state, key):
    k_data, k_depth = jax.random.split(key)
    bits, targets = make_data(k_data, args.batch, args.length)
    total = sample_depths(args, k_depth, args.batch)
    loss, grads = jax.value_and_grad(loss_fn)(params, bits, targets, total)
    # optax's Adam bias correction computes `decay ** count` (a Python float to
    # an int32 power), which strict dtype promotion (our tests) rejects; the
    # model above is strict-clean, so relax promotion for the optimizer only.
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def evaluate(params, key, length: int, checkpoints: list[int], batch: int, width: int, iterate):
  """Accuracy after each number of steps in `checkpoints` (increasing), one pass.

  Returns [(steps, per-position accuracy, fraction of strings all right)].
  """
  bits, targets = make_data(key, batch, length)
  x = as_input(bits)
  max_delta = max(b - a for a, b in zip([0] + checkpoints[:-1], checkpoints))

  @jax.jit
  def advance(h, n):
    # Continue every row from its current state: n more steps (traced: one compile).
    return iterate(block, params, h, x, iters=n, max_iters=max_delta)

  h = jnp.zeros((batch, length, width))
  done, rows = 0, []
  for t in checkpoints:
    h = advance(h, jnp.int32(t - done))
    done = t
    right = readout(params, h) > 0
    right = right == (targets == 1)
    rows.append((t, float(jnp.mean(right)), float(jnp.mean(jnp.all(right, axis=1)))))
  return rows


def check_against_reference(args, loss_fn, params, key) -> float:
  """Max relative difference of one Truncated(k) gradient vs reference.iterate's."""
  k_data, k_depth = jax.random.split(key)
  bits, targets = make_data(k_data, 8, args.length)
  total = sample_depths(args, k_depth, 8)
  got = jax.jit(jax.grad(loss_fn))(params, bits, targets, total)
  # The oracle takes the truncation as its own `truncate=k` argument.
  oracle = lambda *a, grad, **kw: reference.iterate(*a, truncate=grad.k, **kw)
  want = jax.jit(jax.grad(make_loss(args, oracle)))(params, bits, targets, total)
  return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
             for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))


def save_plot(path: str, results: dict[int, list], args) -> str:
  """Accuracy vs test-time steps per length; returns a line saying what happened."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed: no plot (pip install matplotlib)"
  fig, ax = plt.subplots(figsize=(6, 4))
  for length, rows in results.items():
    steps, _, all_right = zip(*rows)
    ax.plot(steps, all_right, marker="o", label=f"{length} bits"
            + (" (trained)" if length == args.length else ""))
  ax.axvline(args.cap, color="gray", linestyle="--", label=f"training cap ({args.cap} steps)")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("test-time steps")
  ax.set_ylabel("strings entirely right")
  ax.set_title("Prefix parity: accuracy vs test-time iterations")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return f"plot saved to {path}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="8-bit strings, 200 steps: the loss goes down (used by the tests)")
  parser.add_argument("--steps", type=int, default=None, help="optimizer steps")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default=None,
                      help="where to save the plot (default: recurrent_depth.png in full mode, "
                           "none in quick mode)")
  parser.add_argument("--implementation", default=None, choices=["pallas", "xla"],
                      help="default: the kernel on GPU/TPU, XLA on CPU")
  parser.add_argument("--no-eval", action="store_true",
                      help="train only (the interpret-mode kernel test)")
  args = parser.parse_args(argv)
  if optax is None:
    print(INSTALL_HINT, file=sys.stderr)
    return 2
  if args.quick:
    args.length, args.batch, args.mean, args.cap = 8, 32, 12, 24
    args.steps = args.steps or 200
    eval_lengths, eval_batch, most_steps = (8, 16), 64, 2
  else:
    args.length, args.batch, args.mean, args.cap = 16, 64, 24, 48
    args.steps = args.steps or 2000
    eval_lengths, eval_batch, most_steps = (16, 32, 64), 256, 4
    args.plot = args.plot or "recurrent_depth.png"
  args.width, args.hidden, args.k, args.lr = 16, 32, 8, 3e-3
  iterate = functools.partial(pallas_loop.iterate,
                              options=pallas_loop.Options(implementation=args.implementation))

  print(f"prefix parity, {args.length}-bit strings, batch {args.batch}; latent {args.width} per "
        f"position; depth per example ~ 1 + Poisson(LogNormal(mean {args.mean})) capped at "
        f"{args.cap}; grad=Truncated({args.k}); AdamW lr {args.lr}; {args.steps} steps")
  key = jax.random.key(args.seed)
  k_init, k_train, k_check, k_eval = jax.random.split(key, 4)
  params = init_params(k_init, args.width, args.hidden)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(args.lr, weight_decay=1e-4))
  opt_state = optimizer.init(params)
  loss_fn = make_loss(args, iterate)
  train_step = make_train_step(args, optimizer, loss_fn)

  grad_err = check_against_reference(args, loss_fn, params, k_check)
  print(f"one Truncated({args.k}) gradient vs reference.iterate: max relative difference "
        f"{grad_err:.1e}")
  ok = grad_err <= 1e-4

  losses, start = [], time.perf_counter()
  for i, k in enumerate(jax.random.split(k_train, args.steps)):
    params, opt_state, loss = train_step(params, opt_state, k)
    losses.append(float(loss))
    if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
      window = losses[-max(1, args.steps // 20):]
      print(f"  step {i:5d}  loss {np.mean(window):.4f} (mean of last {len(window)})  "
            f"{time.perf_counter() - start:6.1f} s")
  train_s = time.perf_counter() - start
  window = max(1, min(50, args.steps // 5))
  first, last = float(np.mean(losses[:window])), float(np.mean(losses[-window:]))
  print(f"trained in {train_s:.1f} s on {jax.devices()[0].platform.upper()}; mean loss of the "
        f"first {window} steps {first:.4f}, of the last {window} {last:.4f}")
  if args.steps >= 100:
    ok &= last < first
  else:  # a few steps on fresh random batches: the loss is too noisy to judge
    print(f"(only {args.steps} steps: the loss is not checked)")

  if args.no_eval:
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1

  print("\naccuracy vs test-time steps (per position / strings entirely right); "
        f"training depths were <= {args.cap}:")
  results = {}
  for length in eval_lengths:
    checkpoints = sorted({s for s in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
                          if s <= most_steps * length})
    results[length] = evaluate(params, k_eval, length, checkpoints, eval_batch, args.width, iterate)
    tag = " (training length)" if length == args.length else " (longer than trained)"
    print(f"  {length} bits{tag}:")
    for t, acc, all_right in results[length]:
      print(f"    {t:4d} steps  {acc:6.3f}  {all_right:6.3f}")
  if args.plot:
    print(save_plot(args.plot, results, args))
  print("\nOK" if ok else "\nFAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
