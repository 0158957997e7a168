"""Forward+backward per gradient mode: time and memory vs the masked scan.

    python -m benchmarks.grad_modes            # CPU-safe default
    python -m benchmarks.grad_modes --json out.json
    python -m benchmarks.grad_modes --batch 32768 --d 128   # an accelerator's scale

For each mode, `jax.grad(loss)` of `pallas_loop.iterate` against
`jax.grad(loss)` of the masked-scan reference (which stores every step for
autodiff), in one run: the time ratio and the compiled temporary memory
(`memory_analysis().temp_size_in_bytes`) ratio. Times are the device's: the
gradient applied many times inside one `jit`, each application on its own
rows, the state fed back (`device_timing.chained_seconds`: `device_timing.CHAIN`
applications on an accelerator, `device_timing.CPU_CHAIN` on a CPU), the floor of a
jitted call measured beside and left out; medians of `--repeats` calls. The modes that are
exact (`Full`, `Truncated` vs the reference's own truncation) are checked
against the reference; a mismatch exits non-zero. With `tol` halting, a row
within rounding of the tolerance may halt a step apart in two implementations:
such cases are checked against the reference run for the implementation's own
halting steps, and the steps may differ by one on at most 1% of the rows. `Phantom` and `Implicit`
are approximations by design: their gradients are reported, not checked, here
(tests/test_grad_modes.py checks them against their own oracles).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from benchmarks import device_timing


@dataclasses.dataclass(frozen=True)
class GradCase:
  block: str
  batch: int
  d: int
  max_iters: int
  mode: object
  tol: float | None = None
  counts: str = "uniform"  # or "constant": every row gets max_iters

  @property
  def name(self) -> str:
    return f"{self.block} B={self.batch} D={self.d} T={self.max_iters} {self.mode}"


_DEQ = dict(tol=1e-5, counts="constant")  # every row runs to convergence
DEFAULT_CASES = (
    GradCase("tanh_rnn", 256, 64, 32, "full"),
    GradCase("tanh_rnn", 256, 64, 32, pallas_loop.Full(checkpoint_every=1)),
    GradCase("tanh_rnn", 256, 64, 32, pallas_loop.Truncated(8)),
    # Fixed-point modes on a deep-equilibrium layer, against full backprop:
    GradCase("deq", 256, 64, 64, "full", **_DEQ),
    GradCase("deq", 256, 64, 64, pallas_loop.Implicit(tol=1e-6, max_iters=64), **_DEQ),
    GradCase("deq", 256, 64, 64, pallas_loop.Phantom(4), **_DEQ),
)


def chained_gradient(grad, params):
  """apply(h, rows) -> h for `device_timing.chained_seconds`: `grad` (params,
  h, x) -> gradients w.r.t. all three, at `rows["x"]`, its gradients folded
  into the next application's `h` (`device_timing.folded_gradient`: h keeps
  its value)."""

  def apply(h, rows):
    g_params, g_h, g_x = grad(params, h, rows["x"])
    return device_timing.folded_gradient(h, g_h, (g_params, g_x))

  return apply


def device_seconds(grad, args, *, repeats: int, floor: float) -> tuple[float, int]:
  """(seconds of one application of `grad` on the device, the chain): `grad`
  (params, h0, x) applied inside one `jit` (`device_timing.chained_seconds`,
  `chained_gradient`)."""
  params, h0, x = args
  return device_timing.chained_seconds(chained_gradient(grad, params), h0, {"x": x},
                                       chain=device_timing.default_chain(),
                                       repeats=repeats, floor=floor)


def run_case(case: GradCase, impls, repeats: int):
  step, params, h0, x = blocks.make(case.block, case.batch, case.d, jnp.float32,
                                    jax.random.key(0))
  rng = np.random.default_rng(0)
  if case.counts == "constant":
    n = jnp.full((case.batch,), case.max_iters, jnp.int32)
  else:
    n = jnp.asarray(rng.integers(1, case.max_iters + 1, case.batch), jnp.int32)
  cot = jax.random.normal(jax.random.key(1), h0.shape)
  kw = dict(iters=n, max_iters=case.max_iters, tol=case.tol)
  exact = not isinstance(case.mode, (pallas_loop.Phantom, pallas_loop.Implicit))
  # The oracle's own truncation argument computes Truncated(k)'s gradient.
  ref_kw = {"truncate": case.mode.k} if isinstance(case.mode, pallas_loop.Truncated) else {}

  def grad_fn(run, **extra):
    loss = lambda p, h, x_: jnp.sum(cot * run(step, p, h, x_, **kw, **extra))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  def steps_of(run, **extra):
    return np.asarray(jax.jit(lambda p, h, x_: run(step, p, h, x_, return_info=True, **kw,
                                                   **extra)[1].steps)(params, h0, x))

  def error(got, want):
    return max(float(jnp.max(jnp.abs(a - b)) / (1 + jnp.max(jnp.abs(b))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))

  ref = grad_fn(reference.iterate, **ref_kw)
  args = (params, h0, x)
  ref_steps = steps_of(reference.iterate) if case.tol is not None else None
  floor = device_timing.floor_seconds(h0, repeats)
  ref_time, ref_chain = device_seconds(ref, args, repeats=repeats, floor=floor)
  ref_mem = ref.lower(*args).compile().memory_analysis().temp_size_in_bytes
  want = ref(*args)
  rows = []
  for impl in impls:
    options = pallas_loop.Options(implementation=impl)
    f = grad_fn(pallas_loop.iterate, grad=case.mode, options=options)
    got = f(*args)
    err = error(got, want)
    mem = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    t, chain = device_seconds(f, args, repeats=repeats, floor=floor)
    ok = (not exact) or err < 1e-4
    halting = {}
    if ref_steps is not None:
      # A row whose rms lands within rounding of `tol` may halt a step apart
      # in two implementations, and every gradient summed over rows then
      # differs by that row's step. Halting keeps the step that met `tol`, so
      # the oracle run for exactly the implementation's own steps (no `tol`)
      # is the exact check; the steps themselves may differ by at most one,
      # on at most 1% of the rows.
      got_steps = steps_of(pallas_loop.iterate, options=options)
      loss_at = lambda p, h, x_: jnp.sum(cot * reference.iterate(
          step, p, h, x_, iters=jnp.asarray(got_steps), max_iters=case.max_iters, **ref_kw))
      err_at_steps = error(got, jax.jit(jax.grad(loss_at, argnums=(0, 1, 2)))(*args))
      elsewhere = int(np.sum(got_steps != ref_steps))
      step_gap = int(np.max(np.abs(got_steps - ref_steps)))
      halting = dict(rows_halting_elsewhere=elsewhere, max_step_gap=step_gap,
                     rel_diff_vs_ref_at_own_steps=err_at_steps)
      ok = (not exact) or (err_at_steps < 1e-4 and step_gap <= 1
                           and elsewhere <= case.batch // 100)
    rows.append(dict(case=case.name, impl=impl, time_s=t, speedup_vs_scan_grad=ref_time / t,
                     scan_time_s=ref_time, floor_seconds=floor, chain=chain,
                     temp_bytes=mem, memory_vs_scan_grad=mem / ref_mem if ref_mem else None,
                     rel_diff_vs_ref=err, checked=exact, ok=ok, **halting))
  return rows


_HEADER = (f"{'case':<58} {'impl':<7} {'median':>9} {'vs scan':>8} {'temp MiB':>9} "
           f"{'vs scan':>8} {'rel.diff':>9}")


def print_header():
  print(_HEADER)


def print_rows(rows):
  for r in rows:
    diff = f"{r['rel_diff_vs_ref']:.1e}" + ("" if r["checked"] else "*")
    if r.get("rows_halting_elsewhere"):
      diff += (f" ({r['rows_halting_elsewhere']} rows halt up to {r['max_step_gap']} step"
               f" apart; {r['rel_diff_vs_ref_at_own_steps']:.1e} against the oracle"
               " at this implementation's steps)")
    print(f"{r['case']:<58} {r['impl']:<7} {r['time_s'] * 1e3:>7.1f}ms "
          f"{r['speedup_vs_scan_grad']:>7.2f}x {r['temp_bytes'] / 2**20:>9.2f} "
          + (f"{r['memory_vs_scan_grad']:>7.2f}x" if r["memory_vs_scan_grad"] is not None
             else f"{'n/a':>8s}") + f" {diff:>9}", flush=True)


def print_legend():
  print("median: one application's device time (chained inside one jit, the floor "
        "of a jitted call left out). vs scan: jit(grad) of the masked-scan reference "
        "in the same run (time: speedup; memory: compiled temporaries ratio). rel.diff: the gradient's "
        "relative difference from the exact one; * = approximate mode, difference "
        "reported, not checked.")


def print_table(rows):
  print_header()
  print_rows(rows)
  print_legend()


def scaled_cases(batch: int, d: int):
  """`DEFAULT_CASES` at another batch size and width (e.g. the GPU check's)."""
  return tuple(dataclasses.replace(c, batch=batch, d=d) for c in DEFAULT_CASES)


def run_all(impls, repeats: int, cases=DEFAULT_CASES, on_row=None):
  """Every case of `cases` on `impls`; the rows `print_table` prints.
  `on_row(row)` is called on each row as its case finishes (a run cut short
  keeps what it measured)."""
  rows = []
  for case in cases:
    new = run_case(case, impls, repeats)
    for r in new:
      if on_row is not None:
        on_row(r)
    rows += new
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--impls", default="xla,pallas")
  parser.add_argument("--batch", type=int, default=None,
                      help="every case at this batch (and --d): an accelerator's scale")
  parser.add_argument("--d", type=int, default=None, help="every case at this width")
  parser.add_argument("--precision", default=None,
                      help="jax.default_matmul_precision for the run (e.g. highest: the "
                           "float32 checks at 1e-4 on a TPU, whose default is one bf16 pass)")
  parser.add_argument("--out", default=None, help="also append each row here as a JSON line")
  args = parser.parse_args(argv)
  cases = DEFAULT_CASES
  if args.batch is not None or args.d is not None:
    cases = tuple(dataclasses.replace(c, batch=args.batch or c.batch, d=args.d or c.d)
                  for c in DEFAULT_CASES)
  print(f"pallas_loop gradient modes: JAX {jax.__version__}, device "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()})")
  if jax.default_backend() == "cpu":
    print("note: on CPU the Pallas kernels (forward and fused backward) run in "
          "interpret mode; medians of", args.repeats)
  write = device_timing.json_lines(args.out) if args.out else None
  with jax.default_matmul_precision(args.precision) if args.precision else contextlib.nullcontext():
    rows = run_all(args.impls.split(","), args.repeats, cases,
                   on_row=None if write is None else
                   (lambda r: write(dict(r, matmul_precision=args.precision))))
  print_table(rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, results=rows), f, indent=1)
  bad = [r for r in rows if not r["ok"]]
  for r in bad:
    print(f"MISMATCH: {r['impl']} on {r['case']}: {r['rel_diff_vs_ref']:.3e}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
