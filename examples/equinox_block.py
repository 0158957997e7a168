"""An Equinox module as the block, trained through `pallas_loop.iterate`.

    python examples/equinox_block.py [--quick] [--implementation pallas|xla]

The block is an `eqx.Module` (a residual MLP cell). `eqx.partition` splits it
into its floating-point arrays (the `params` pytree of `iterate`) and the
rest (static structure, activation functions); the step recombines them and
calls the module:

    params, static = eqx.partition(cell, eqx.is_inexact_array)
    step = lambda params, h, x: eqx.combine(params, static)(h, x)

Equinox layers act on one example, so the cell maps its layers over the rows
with `jax.vmap` (which traces to a matmul over the row tile). A jitted training step takes the gradient w.r.t. `params`
through `iterate` (each row applies the cell its own number of times) and
applies an SGD update. The script checks the first gradient against
`reference.iterate` and that the loss went down, then prints OK.
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp

import pallas_loop
from pallas_loop import _reference as reference


class ResidualCell(eqx.Module):
  """h <- h + tanh(relu(h W_up + x W_in) W_down) / 4, on [rows, d] arrays."""

  up: eqx.nn.Linear
  inp: eqx.nn.Linear
  down: eqx.nn.Linear

  def __init__(self, d: int, hidden: int, *, key: jax.Array):
    k_up, k_in, k_down = jax.random.split(key, 3)
    self.up = eqx.nn.Linear(d, hidden, key=k_up)
    self.inp = eqx.nn.Linear(d, hidden, use_bias=False, key=k_in)
    self.down = eqx.nn.Linear(hidden, d, key=k_down)

  def __call__(self, h, x):
    # vmap over rows: each row is computed from that row alone.
    rows = lambda layer, a: jax.vmap(layer)(a)
    z = jax.nn.relu(rows(self.up, h) + rows(self.inp, x))
    return h + 0.25 * jnp.tanh(rows(self.down, z))


def make_step(static):
  """The `step(params, h, x)` that `iterate` wants, from the module's static part."""
  return lambda params, h, x: eqx.combine(params, static)(h, x)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
  parser.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
  args = parser.parse_args(argv)
  batch, d, hidden, max_iters, n_steps = (32, 16, 32, 6, 15) if args.quick else (512, 64, 256, 16, 200)
  lr = 0.2

  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (batch, d))
  h0 = jnp.zeros((batch, d))
  n = jax.random.randint(keys[1], (batch,), 1, max_iters + 1)   # per-row depth
  # Target: what a differently initialised cell computes with the same depths.
  t_params, t_static = eqx.partition(ResidualCell(d, hidden, key=keys[2]), eqx.is_inexact_array)
  target = reference.iterate(make_step(t_static), t_params, h0, x, iters=n, max_iters=max_iters)

  cell = ResidualCell(d, hidden, key=keys[3])
  params, static = eqx.partition(cell, eqx.is_inexact_array)
  step = make_step(static)

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
  cell = eqx.combine(params, static)   # the trained module
  final = float(loss_fn(eqx.partition(cell, eqx.is_inexact_array)[0], reference.iterate))
  print(f"loss {float(first_loss):.5f} -> {final:.5f}")
  ok = grad_err <= 1e-5 * max(1.0, grad_scale) and final < 0.8 * float(first_loss)
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
