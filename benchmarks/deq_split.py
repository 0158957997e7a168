"""Where a deep equilibrium layer's time goes: the forward's halting, the gradient modes.

The fixed-point gradient modes (`Implicit`, `Phantom`) cost a forward that
halts on a tolerance plus a backward; this script times, for
`benchmarks.grad_modes`' deep-equilibrium case (`blocks.deq`,
`h <- tanh(h W + x U)`, float32, rows whose input scale grows along the batch,
so that their convergence speed does; `--order shuffled` puts the rows in a
random order, as a data set would) inside one `jit` as `grad_modes` does
(`device_timing.chained_seconds`, the floor of a jitted call left out; the
state is kept at h0 from one application to the next, so every application
solves from the same start), per application:

  forward tol          `iterate(..., tol=)` as `grad_modes` calls it: every
                       row's budget T, halting at rms(update) <= tol
  forward tol C=..     the same at another chunk height (`--chunks`; the
                       gradients `grad Implicit C=..`, `grad Phantom(4) C=..`)
  forward at its steps each row given the steps it halted at as its count, no
                       tolerance: the loop when the counts are known before it
                       (rows sorted by them, nothing tracked)
  grad Full/Implicit/Phantom(4)  `jax.grad` of the output's sum w.r.t.
                       (params, h0, x), as `grad_modes` times it
  ..., whole chunks    `forward tol`, `grad Implicit`, `grad Phantom(4)` and
                       `adjoint tol` with every chunk that holds a running
                       row run whole (`kernel_tpu_groups.WINDOW` False), not
                       cut after the last row still running
  grad Implicit, caller's order  the adjoint solved with the rows in the
                       caller's order (`grad_modes.ADJOINT_IN_STEP_ORDER`
                       False), not in the order of their forward steps
  adjoint tol          `Implicit`'s adjoint loop alone, as an `iterate` call:
                       u <- g + u df/dh(h*) from u = g (g = ones, the cotangent
                       of the output's sum), at the forward's fixed point h*,
                       halting at rms(update) <= Implicit's tol, every row's
                       budget T, the rows in the caller's order
  adjoint at its steps the same loop, each row given the steps it halted at
                       as its count, no tolerance: what compaction of the
                       halted rows could bring the adjoint towards
                       (its ns_per_row_step counts the adjoint's steps)

Each line: case, variant, ms, ns_per_row_step (per useful row-step: the steps
the rows halted at), chain, floor_ms; the first line of a case gives the halting
steps' mean, max and the work efficiency of chunks of 2048 rows run to
their slowest row.

    python -m benchmarks.deq_split [--out deq.jsonl] [--batch 4096] [--d 128]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import blocks
from benchmarks import device_timing
from benchmarks import grad_modes as grad_modes_bench
from benchmarks import tpu_design


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--max-iters", type=int, default=64)
  parser.add_argument("--tol", type=float, default=1e-5)
  parser.add_argument("--order", default="ordered", help="ordered,shuffled")
  parser.add_argument("--chunks", default="", help="comma-separated chunk heights")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--precision", default="highest")
  parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                      help="time only the variants whose name starts with this (repeatable)")
  args = parser.parse_args(argv)
  write = device_timing.json_lines(args.out)
  with (jax.default_matmul_precision(args.precision) if args.precision
        else contextlib.nullcontext()):
    for order in args.order.split(","):
      _case(args, order, write)
  return 0


def _case(args, order: str, write) -> None:
  import pallas_loop  # pylint: disable=g-import-not-at-top
  from pallas_loop._src import grad_modes  # pylint: disable=g-import-not-at-top

  batch, t_max, tol = args.batch, args.max_iters, args.tol
  step, params, h0, x = blocks.make("deq", batch, args.d, jnp.float32, jax.random.key(0))
  if order == "shuffled":
    x = x[np.random.default_rng(0).permutation(batch)]
  label = f"deq B={batch} D={args.d} T={t_max} tol={tol} {order}"
  budget = jnp.full((batch,), t_max, jnp.int32)  # as grad_modes gives it
  kw = dict(max_iters=t_max)
  h_star, info = jax.jit(lambda p, h, x_: pallas_loop.iterate(
      step, p, h, x_, iters=budget, tol=tol, return_info=True, **kw))(params, h0, x)
  steps = np.asarray(info.steps)
  useful = int(steps.sum())
  chunks = steps[:batch // 2048 * 2048].reshape(-1, 2048)  # whole chunks of 2048 rows
  write({"what": "deq_split", "case": label, "steps_mean": float(steps.mean()),
         "steps_max": int(steps.max()), "steps_min": int(steps.min()),
         "efficiency_2048": (float(chunks.sum() / (chunks.max(1).sum() * 2048))
                             if chunks.size else None)})
  floor = device_timing.floor_seconds(h0, args.repeats)
  keep = lambda h, out: device_timing.folded_gradient(h, out, ())  # h stays h0

  def forward(**extra):
    return lambda h, r: keep(h, pallas_loop.iterate(step, params, h, r["x"], iters=budget,
                                                    tol=tol, **kw, **extra))

  def grad(mode, **extra):
    loss = lambda p, h, x_: jnp.sum(pallas_loop.iterate(step, p, h, x_, iters=budget, tol=tol,
                                                        grad=mode, **kw, **extra))
    return grad_modes_bench.chained_gradient(jax.grad(loss, argnums=(0, 1, 2)), params)

  at_chunks = {chunk: pallas_loop.Options(block_rows=chunk)
               for chunk in (int(c) for c in args.chunks.split(",") if c)}
  fixed_point = {"Implicit": pallas_loop.Implicit(tol=1e-6, max_iters=t_max),
                 "Phantom(4)": pallas_loop.Phantom(4)}
  variants = {
      "forward tol": forward(),
      "forward at its steps": lambda h, r: keep(h, pallas_loop.iterate(
          step, params, h, r["x"], iters=r["steps"], **kw)),
  }
  for chunk, options in at_chunks.items():
    variants[f"forward tol C={chunk}"] = forward(options=options)
  variants["grad Full"] = grad("full")
  for name, mode in fixed_point.items():
    variants[f"grad {name}"] = grad(mode)
  for chunk, options in at_chunks.items():
    for name, mode in fixed_point.items():
      variants[f"grad {name} C={chunk}"] = grad(mode, options=options)
  variants["grad Implicit, caller's order"] = lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
      grad_modes, {"ADJOINT_IN_STEP_ORDER": False}, variants["grad Implicit"], h, r)
  for name in ("forward tol", "grad Implicit", "grad Phantom(4)"):
    variants[f"{name}, whole chunks"] = _whole_chunks(variants[name])
  inputs = {"x": x, "steps": jnp.asarray(steps)}
  record = {"what": "deq_split", "case": label, "precision": args.precision}
  device_timing.time_variants(variants, h0, inputs, useful=useful, floor=floor,
                              repeats=args.repeats, write=write, only=args.only, record=record)
  _adjoint_variants(args, step, params, h0, x, h_star, budget, fixed_point["Implicit"].tol,
                    floor, write, record)


def _adjoint_variants(args, step, params, h0, x, h_star, budget, tol, floor, write,
                      record) -> None:
  """`adjoint tol` and `adjoint at its steps` (the module's docstring), at
  the forward's fixed point `h_star`, timed per useful adjoint row-step."""
  import pallas_loop  # pylint: disable=g-import-not-at-top
  from pallas_loop._src import implicit_adjoint  # pylint: disable=g-import-not-at-top

  if args.only and not any(name.startswith(prefix) for prefix in args.only
                           for name in ("adjoint tol", "adjoint at its steps",
                                        "adjoint tol, whole chunks")):
    return
  kw = dict(max_iters=args.max_iters)
  adjoint = implicit_adjoint.adjoint_step(step)
  g = jnp.ones_like(h_star)
  _, info = jax.jit(lambda p, u, rows: pallas_loop.iterate(
      adjoint, p, u, rows, iters=budget, tol=tol, return_info=True, **kw))(
          params, g, (h_star, x, g))
  steps = np.asarray(info.steps)
  write({**record, "adjoint_steps_mean": float(steps.mean()),
         "adjoint_steps_max": int(steps.max()), "adjoint_steps_min": int(steps.min())})
  # u starts at g; `0 * h` keeps each application chained to the last.
  start = lambda h: g + 0 * h
  keep = lambda h, out: device_timing.folded_gradient(h, out, ())
  variants = {
      "adjoint tol": lambda h, r: keep(h, pallas_loop.iterate(
          adjoint, params, start(h), (r["h_star"], r["x"], g), iters=budget, tol=tol, **kw)),
      "adjoint at its steps": lambda h, r: keep(h, pallas_loop.iterate(
          adjoint, params, start(h), (r["h_star"], r["x"], g), iters=r["steps"], **kw)),
  }
  variants["adjoint tol, whole chunks"] = _whole_chunks(variants["adjoint tol"])
  device_timing.time_variants(variants, h0, {"x": x, "h_star": h_star,
                                             "steps": jnp.asarray(steps)},
                              useful=int(steps.sum()), floor=floor, repeats=args.repeats,
                              write=write, only=args.only, record=record)


def _whole_chunks(variant):
  """`variant` traced with `kernel_tpu_groups.WINDOW` False."""
  from pallas_loop._src.kernels import kernel_tpu_groups  # pylint: disable=g-import-not-at-top

  return lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
      kernel_tpu_groups, {"WINDOW": False}, variant, h, r)


if __name__ == "__main__":
  sys.exit(main())
