"""A Haiku module as the block: `hk.transform`, then `apply` inside the step.

    pip install dm-haiku    # not a dependency of pallas_loop; not run in CI
    python examples/haiku_block.py [--quick]

`hk.transform(f)` turns a function that builds modules into a pair of pure
functions: `init(rng, *args) -> params` and `apply(params, rng, *args)`. The
params are a plain dict pytree, so they are `iterate`'s `params` and the step
is `apply` (rng None for a deterministic cell):

    model = hk.transform(lambda h, x: Cell(d, hidden)(h, x))
    params = model.init(key, h0, x)
    step = lambda params, h, x: model.apply(params, None, h, x)

For dropout, `hk.dropout(hk.next_rng_key(), rate, a)` draws from the rng
given to `apply`: write the step per example (`per_example=True`) and pass
that row's key, `model.apply(params, jax.random.wrap_key_data(key), h, x)`
(XLA implementation; jax.random does not lower inside a compiled Pallas
kernel). The script trains both for a few SGD steps, checks the first
gradient against `reference.iterate` and prints OK.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

try:
  import haiku as hk
except ImportError:  # pragma: no cover
  hk = None

import pallas_loop

from pallas_loop import _reference as reference

INSTALL_HINT = "examples/haiku_block.py needs Haiku: pip install dm-haiku"


def cell(d: int, hidden: int, rate: float = 0.0):
  """The residual MLP cell as a Haiku function of (h, x); dropout if rate > 0."""

  def f(h, x):
    a = jax.nn.relu(hk.Linear(hidden)(h) + hk.Linear(hidden, with_bias=False)(x))
    if rate:
      a = hk.dropout(hk.next_rng_key(), rate, a)
    return h + 0.25 * jnp.tanh(hk.Linear(d)(a))

  return f


def train(name, step, params, data, *, keyed, n_steps, lr=0.2) -> bool:
  """SGD through iterate; checks the first gradient against the reference."""
  h0, x, n, target, key, max_iters = data
  kw = dict(key=key, per_example=True) if keyed else {}
  ref_step = step
  if keyed:
    ref_step = lambda p, h, x, key: jax.vmap(step, in_axes=(None, 0, 0, 0))(p, h, x, key)

  def loss_fn(params, iterate, step, **kw):
    h = iterate(step, params, h0, x, iters=n, max_iters=max_iters, **kw)
    return jnp.mean(jnp.square(h - target))

  @jax.jit
  def train_step(params):
    loss, grads = jax.value_and_grad(loss_fn)(params, pallas_loop.iterate, step, **kw)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads

  _, first_loss, grads = train_step(params)
  want = jax.grad(loss_fn)(params, reference.iterate, ref_step,
                           **({"key": key} if keyed else {}))
  grad_err = max(float(jnp.max(jnp.abs(a - b)))
                 for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)))
  grad_scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(want))
  loss = first_loss
  for _ in range(n_steps):
    params, loss, _ = train_step(params)
  ok = grad_err <= 1e-5 * max(1.0, grad_scale) and float(loss) < 0.8 * float(first_loss)
  print(f"{name:<26} max |grad - reference| = {grad_err:.1e} (scale {grad_scale:.1e}); "
        f"loss {float(first_loss):.5f} -> {float(loss):.5f}  {'ok' if ok else 'MISMATCH'}")
  return ok


def main(argv=None) -> int:
  if hk is None:
    print(INSTALL_HINT)
    return 1
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
  args = parser.parse_args(argv)
  batch, d, hidden, max_iters, n_steps = (24, 8, 16, 5, 20) if args.quick else (256, 32, 128, 12, 100)

  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (batch, d))
  h0 = jnp.zeros((batch, d))
  n = jax.random.randint(keys[1], (batch,), 1, max_iters + 1)   # per-row depth
  teacher = hk.transform(cell(d, hidden))
  t_params = teacher.init(jax.random.key(1), h0, x)
  target = reference.iterate(lambda p, h, x: teacher.apply(p, None, h, x), t_params, h0, x,
                             iters=n, max_iters=max_iters)
  data = (h0, x, n, target, keys[2], max_iters)
  print(f"{batch} rows, D={d}, hidden={hidden}, depth 1..{max_iters} per row, "
        f"{n_steps} SGD steps (Haiku {hk.__version__}, JAX {jax.__version__})")

  model = hk.transform(cell(d, hidden))
  ok = train("haiku, deterministic", lambda p, h, x: model.apply(p, None, h, x),
             model.init(jax.random.key(2), h0, x), data, keyed=False, n_steps=n_steps)
  dropout = hk.transform(cell(d, hidden, rate=0.1))
  step = lambda p, h, x, key: dropout.apply(p, jax.random.wrap_key_data(key), h, x)
  ok &= train("haiku, dropout per example", step,
              dropout.init(jax.random.key(2), h0, x), data, keyed=True, n_steps=n_steps)
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
