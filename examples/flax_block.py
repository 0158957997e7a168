"""A Flax NNX module as the block, trained through `pallas_loop.iterate`.

    python examples/flax_block.py [--quick] [--implementation pallas|xla]

The block is an `nnx.Module` (a residual MLP cell). `nnx.split` separates it
into a static `graphdef` and its parameters (`nnx.Param` state); the
parameters are the `params` pytree of `iterate` and the step merges them back
into a module and calls it:

    graphdef, params = nnx.split(cell, nnx.Param)
    step = lambda params, h, x: nnx.merge(graphdef, params)(h, x)

A jitted training step takes the gradient w.r.t. `params` through `iterate`
(each row applies the cell its own number of times) and applies an SGD
update; `nnx.update` writes the trained parameters back into the module.
The script checks the first gradient against `reference.iterate` and that
the loss went down, then prints OK.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_loop
from pallas_loop import _reference as reference


class ResidualCell(nnx.Module):
  """h <- h + tanh(relu(h W_up + x W_in) W_down) / 4, on [rows, d] arrays."""

  def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(d, hidden, rngs=rngs)
    self.inp = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(hidden, d, rngs=rngs)

  def __call__(self, h, x):
    # Rows stay independent: every op acts on the last axis only.
    return h + 0.25 * jnp.tanh(self.down(nnx.relu(self.up(h) + self.inp(x))))


def make_step(graphdef):
  """The `step(params, h, x)` that `iterate` wants, from the module's graphdef."""
  return lambda params, h, x: nnx.merge(graphdef, params)(h, x)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
  parser.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
  args = parser.parse_args(argv)
  batch, d, hidden, max_iters, n_steps = (32, 16, 32, 6, 15) if args.quick else (512, 64, 256, 16, 200)
  lr = 0.2

  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (batch, d))
  h0 = jnp.zeros((batch, d))
  n = jax.random.randint(keys[1], (batch,), 1, max_iters + 1)   # per-row depth
  # Target: what a differently initialised cell computes with the same depths.
  teacher = ResidualCell(d, hidden, rngs=nnx.Rngs(1))
  t_graphdef, t_params = nnx.split(teacher, nnx.Param)
  target = reference.iterate(make_step(t_graphdef), t_params, h0, x, iters=n, max_iters=max_iters)

  cell = ResidualCell(d, hidden, rngs=nnx.Rngs(0))
  # Only the nnx.Param state is trained; a module with other state (batch
  # statistics, RNG counters) would give `nnx.split(cell, nnx.Param, ...)`
  # a third part to close over or pass along in x.
  graphdef, params = nnx.split(cell, nnx.Param)
  step = make_step(graphdef)

  def loss_fn(params, iterate):
    kw = ({} if iterate is reference.iterate
          else {"options": pallas_loop.Options(implementation=args.implementation)})
    h = iterate(step, params, h0, x, iters=n, max_iters=max_iters, **kw)
    return jnp.mean(jnp.square(h - target))

  @jax.jit
  def train_step(params):
    loss, grads = jax.value_and_grad(loss_fn)(params, pallas_loop.iterate)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads

  _, first_loss, grads = train_step(params)
  want = jax.grad(loss_fn)(params, reference.iterate)
  grad_err = max(float(jnp.max(jnp.abs(a - b)))
                 for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))
  grad_scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want))
  print(f"{batch} rows, D={d}, hidden={hidden}, depth 1..{max_iters} per row; "
        f"max |grad - reference grad| = {grad_err:.2e} (grad scale {grad_scale:.2e})")

  loss = first_loss
  for i in range(n_steps):
    params, loss, _ = train_step(params)
    if i % max(1, n_steps // 5) == 0 or i == n_steps - 1:
      print(f"  step {i:4d}  loss {float(loss):.5f}")
  nnx.update(cell, params)   # the trained weights back in the module
  final = float(loss_fn(nnx.split(cell, nnx.Param)[1], reference.iterate))
  print(f"loss {float(first_loss):.5f} -> {final:.5f}")
  ok = grad_err <= 1e-5 * max(1.0, grad_scale) and final < 0.8 * float(first_loss)
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
