"""Flax blocks with dropout (linen and NNX), a fresh mask per row and step.

    python examples/flax_dropout.py [--quick] [--implementation pallas|xla]

`iterate(..., key=k)` gives the step a key per (row, step): uint32 [rows, 2],
row i's key at step t a pure function of (k, i, t). A Flax module draws its
dropout mask from *one* key for the whole array it is given, so it cannot
take [rows, 2] keys at once. Two ways to feed it:

1. Per example (`per_example=True`): the step is written for one row and
   receives that row's key (uint32 [2]); wrap it as a typed key and hand it to
   the module as its "dropout" RNG stream:

     linen: cell.apply(variables, h, x, train=True,
                       rngs={"dropout": jax.random.wrap_key_data(key)})
     NNX:   nnx.merge(graphdef, params)(h, x,
                       rngs=nnx.Rngs(dropout=jax.random.wrap_key_data(key)))

   `nn.Dropout` / `nnx.Dropout` then call `jax.random.bernoulli` on that key.
   That runs in the XLA implementation (the default on CPU) and in Pallas
   interpret mode, but jax.random does not lower inside a compiled Pallas
   kernel (Triton), so on a GPU pass
   `options=pallas_loop.Options(implementation="xla")`.

2. On the whole tile, everywhere (the kernel included): pass the per-row
   keys into the module as an argument and draw with
   `pallas_loop.random.dropout(key, a, rate)`, which takes the [rows, 2] keys
   and lowers in every implementation.

Each variant trains a residual MLP cell for a few SGD steps through
`iterate` (per-row depth, dropout on), checks the first gradient against
`reference.iterate` with the same keys (the masks are a pure function of
(key, row, step), so forward and backward see the same ones), checks that
the loss went down, and prints OK.
"""

# No `from __future__ import annotations`: linen modules are dataclasses whose
# field annotations are resolved through sys.modules, where a module loaded
# from a file path (as the tests do) is not registered.
import argparse
import sys

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx

import pallas_loop

from pallas_loop import _reference as reference


# ---------------------------------------------------------------------------
# 1a. Flax linen, per example: nn.Dropout draws from make_rng("dropout").


class LinenCell(nn.Module):
  """h <- h + tanh(dropout(relu(h W_up + x W_in)) W_down) / 4, on one row [d]."""

  d: int
  hidden: int
  rate: float

  @nn.compact
  def __call__(self, h, x, *, train: bool):
    a = nn.relu(nn.Dense(self.hidden)(h) + nn.Dense(self.hidden, use_bias=False)(x))
    a = nn.Dropout(self.rate, deterministic=not train)(a)   # self.make_rng("dropout")
    return h + 0.25 * jnp.tanh(nn.Dense(self.d)(a))


def linen_step(cell: LinenCell):
  """A per-example keyed step: one row's state, input and key (uint32 [2])."""

  def step(variables, h, x, key):
    return cell.apply(variables, h, x, train=True,
                      rngs={"dropout": jax.random.wrap_key_data(key)})

  return step


# ---------------------------------------------------------------------------
# 1b. Flax NNX, per example: nnx.Dropout given an Rngs at call time.


class NnxCell(nnx.Module):
  """The same cell as an NNX module; dropout only when called with `rngs`."""

  def __init__(self, d: int, hidden: int, rate: float, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(d, hidden, rngs=rngs)
    self.inp = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(hidden, d, rngs=rngs)
    # No RNG stream of its own: a stream stored in the module would be
    # mutated inside iterate's trace (TraceContextError). The caller's
    # Rngs, built from the per-row key inside the step, is used instead.
    self.drop = nnx.Dropout(rate)

  def __call__(self, h, x, *, rngs: nnx.Rngs | None = None):
    a = nnx.relu(self.up(h) + self.inp(x))
    a = self.drop(a, deterministic=rngs is None, rngs=rngs)
    return h + 0.25 * jnp.tanh(self.down(a))


def nnx_step(graphdef):
  """A per-example keyed step from the module's graphdef (params split off)."""

  def step(params, h, x, key):
    cell = nnx.merge(graphdef, params)
    return cell(h, x, rngs=nnx.Rngs(dropout=jax.random.wrap_key_data(key)))

  return step


# ---------------------------------------------------------------------------
# 2. linen on the whole tile: the per-row keys as an argument.


class TileCell(nn.Module):
  """The cell on [rows, d], dropout from `pallas_loop.random` (any implementation)."""

  d: int
  hidden: int
  rate: float

  @nn.compact
  def __call__(self, h, x, keys):
    a = nn.relu(nn.Dense(self.hidden)(h) + nn.Dense(self.hidden, use_bias=False)(x))
    a = pallas_loop.random.dropout(keys, a, self.rate)        # keys: uint32 [rows, 2]
    return h + 0.25 * jnp.tanh(nn.Dense(self.d)(a))


def tile_step(cell: TileCell):
  """A keyed step on a tile of rows (`per_example=False`)."""
  return lambda variables, h, x, key: cell.apply(variables, h, x, key)


# ---------------------------------------------------------------------------


def train(name, step, params, data, *, per_example, implementation, n_steps, lr=0.2) -> bool:
  """SGD through iterate; checks the first gradient against the reference."""
  h0, x, n, target, key, max_iters = data
  # The reference takes a step on all rows: vmap a per-example step.
  ref_step = step
  if per_example:
    ref_step = lambda p, h, x, key: jax.vmap(step, in_axes=(None, 0, 0, 0))(p, h, x, key)

  def loss_fn(params, k):
    h = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=max_iters, key=k,
                            per_example=per_example,
                            options=pallas_loop.Options(implementation=implementation))
    return jnp.mean(jnp.square(h - target))

  def ref_loss_fn(params, k):
    h = reference.iterate(ref_step, params, h0, x, iters=n, max_iters=max_iters, key=k)
    return jnp.mean(jnp.square(h - target))

  @jax.jit
  def train_step(params, k):
    loss, grads = jax.value_and_grad(loss_fn)(params, k)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads

  _, first_loss, grads = train_step(params, key)
  want = jax.grad(ref_loss_fn)(params, key)
  grad_err = max(float(jnp.max(jnp.abs(a - b)))
                 for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))
  grad_scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want))
  loss = first_loss
  for i in range(n_steps):
    params, loss, _ = train_step(params, jax.random.fold_in(key, i))   # new masks each step
  ok = grad_err <= 1e-5 * max(1.0, grad_scale) and float(loss) < 0.8 * float(first_loss)
  print(f"{name:<34} max |grad - reference| = {grad_err:.1e} (scale {grad_scale:.1e}); "
        f"loss {float(first_loss):.5f} -> {float(loss):.5f}  {'ok' if ok else 'MISMATCH'}")
  return ok


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
  parser.add_argument("--implementation", default=None, choices=[None, "pallas", "xla"])
  args = parser.parse_args(argv)
  batch, d, hidden, max_iters, n_steps = (24, 8, 16, 5, 20) if args.quick else (256, 32, 128, 12, 100)
  rate = 0.1

  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (batch, d))
  h0 = jnp.zeros((batch, d))
  n = jax.random.randint(keys[1], (batch,), 1, max_iters + 1)   # per-row depth
  # Target: what a differently initialised cell computes without dropout.
  teacher = LinenCell(d, hidden, rate)
  t_vars = teacher.init(jax.random.key(1), h0[0], x[0], train=False)
  t_step = jax.vmap(lambda v, h, x: teacher.apply(v, h, x, train=False), in_axes=(None, 0, 0))
  target = reference.iterate(t_step, t_vars, h0, x, iters=n, max_iters=max_iters)
  data = (h0, x, n, target, keys[2], max_iters)
  print(f"{batch} rows, D={d}, hidden={hidden}, depth 1..{max_iters} per row, dropout {rate}, "
        f"{n_steps} SGD steps")

  per_example_impl = args.implementation if args.implementation != "pallas" else "xla"
  linen = LinenCell(d, hidden, rate)
  ok = train("linen, per example (make_rng)", linen_step(linen),
             linen.init(jax.random.key(2), h0[0], x[0], train=False), data,
             per_example=True, implementation=per_example_impl, n_steps=n_steps)

  graphdef, params = nnx.split(NnxCell(d, hidden, rate, rngs=nnx.Rngs(2)), nnx.Param)
  ok &= train("nnx, per example (nnx.Rngs)", nnx_step(graphdef), params, data,
              per_example=True, implementation=per_example_impl, n_steps=n_steps)

  tile = TileCell(d, hidden, rate)
  tile_keys = jnp.zeros((1, 2), jnp.uint32)
  ok &= train("linen, tile (pallas_loop.random)", tile_step(tile),
              tile.init(jax.random.key(2), h0[:1], x[:1], tile_keys), data,
              per_example=False, implementation=args.implementation, n_steps=n_steps)
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
