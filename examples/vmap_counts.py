"""Per-example iteration counts under `jax.vmap`: what fails in plain JAX, and one call that works.

    python examples/vmap_counts.py [--quick] [--implementation {xla,pallas}]

The user's question: double a vector 1, 2 and 3 times, one count per example,
under `vmap`. In plain JAX:

  * `lax.scan(..., length=n)` with a per-example `n` raises a
    ConcretizationTypeError: under `vmap` (or `jit`) `n` is a tracer and
    `length` must be a concrete Python int. (A widely copied answer says this
    works; it does not.)
  * `vmap(lax.while_loop)` runs, but has no reverse-mode gradient.

`pallas_loop.iterate` takes the count as data, so the same per-example
function works under `vmap` (and without it, on the batch), and is
differentiable. The script prints the errors JAX raises, then the doubled
rows and their gradients, and checks them against `reference.iterate`. The
full mode also runs a larger batch (4096 examples, counts up to 64) through
`jit(vmap(...))` and checks it against the reference.
"""

from __future__ import annotations

import argparse
import sys

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference


def _first_lines(err: Exception, n: int = 2) -> str:
  """The head of an exception's message (the rest names tracer ids and lines)."""
  lines = [line for line in str(err).splitlines() if line.strip()]
  return "\n    ".join(lines[:n])


def double(params, h, x):
  """The block: h -> 2 h (rows independent; params and x unused)."""
  del params, x
  return h * 2


def scan_per_example(n):
  """What the user wrote first: one example, a scan of length n."""
  return lax.scan(lambda h, _: (h * 2, None), jnp.ones((5,)), length=n)[0]


def while_per_example(h0, n):
  """vmap(while_loop): runs, but reverse-mode autodiff is not defined for it."""
  return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2), (0, h0))[1]


def make_iterate_per_example(implementation):
  """One example (no row axis), its own count: what a vmap user writes."""

  def per_example(h0, n):
    # iterate wants a row axis: this example is a batch of one row.
    return pallas_loop.iterate(double, None, h0[None], iters=n, max_iters=3,
                               options=pallas_loop.Options(implementation=implementation))[0]

  return per_example


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="skip the large batch (used by the tests)")
  parser.add_argument("--implementation", default=None, choices=["pallas", "xla"],
                      help="default: the kernel on GPU/TPU, XLA on CPU")
  args = parser.parse_args(argv)
  ok = True

  counts = jnp.array([1, 2, 3], dtype=jnp.int32)
  print(f"counts = {counts.tolist()}; block: h -> 2 h on a vector of five ones\n")

  print("1. jax.vmap(lambda n: lax.scan(body, init, length=n)) (the answer the user was given):")
  try:
    jax.vmap(scan_per_example)(counts)
    print("    ran (unexpected: this JAX accepts a traced scan length)")
    ok = False
  except jax.errors.ConcretizationTypeError as err:
    print(f"    {type(err).__name__}: {_first_lines(err)}")

  print("\n2. jax.vmap(lax.while_loop) runs forward, but jax.grad of it:")
  h0 = jnp.ones((3, 5))
  print(f"    forward: {np.asarray(jax.vmap(while_per_example)(h0, counts))[:, 0].tolist()}")
  try:
    jax.grad(lambda h: jnp.sum(jax.vmap(while_per_example)(h, counts)))(h0)
    print("    grad ran (unexpected)")
    ok = False
  except ValueError as err:
    print(f"    {type(err).__name__}: {_first_lines(err, 1)}")

  print("\n3. pallas_loop.iterate under jax.vmap, one count per example:")
  per_example = make_iterate_per_example(args.implementation)
  out = jax.jit(jax.vmap(per_example))(h0, counts)
  print("    " + str(np.asarray(out)).replace("\n", "\n    "))
  grads = jax.grad(lambda h: jnp.sum(jax.vmap(per_example)(h, counts)))(h0)
  print(f"    d sum(out) / d h0, per example: {np.asarray(grads)[:, 0].tolist()} (= 2**n)")
  batched = pallas_loop.iterate(double, None, h0, iters=counts, max_iters=3,
                                options=pallas_loop.Options(implementation=args.implementation))
  print(f"    the same without vmap (rows = examples): {np.asarray(batched)[:, 0].tolist()}")
  want = reference.iterate(double, None, h0, iters=counts, max_iters=3)
  expected = np.broadcast_to(np.array([[2.0], [4.0], [8.0]]), (3, 5))
  ok &= bool(np.array_equal(out, expected) and np.array_equal(batched, expected)
             and np.array_equal(want, expected)
             and np.array_equal(grads, expected))

  if not args.quick:
    batch, d, max_iters = 4096, 64, 64
    k_h, k_n = jax.random.split(jax.random.key(0))
    hb = jax.random.normal(k_h, (batch, d))
    nb = jax.random.randint(k_n, (batch,), 0, max_iters + 1)

    def tanh_block(w, h, x):
      del x
      return jnp.tanh(h @ w)

    w = jax.random.normal(jax.random.key(1), (d, d)) / np.sqrt(d)
    run = jax.jit(jax.vmap(lambda h, n: pallas_loop.iterate(
        tanh_block, w, h[None], iters=n, max_iters=max_iters,
        options=pallas_loop.Options(implementation=args.implementation))[0]))
    got = run(hb, nb)
    ref = reference.iterate(tanh_block, w, hb, iters=nb, max_iters=max_iters)
    err = float(jnp.max(jnp.abs(got - ref)))
    print(f"\n4. jit(vmap(iterate)) on {batch} examples, D={d}, counts 0..{max_iters}: "
          f"max |out - reference| = {err:.1e}")
    ok &= err <= 1e-5

  print("\nOK" if ok else "\nMISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
