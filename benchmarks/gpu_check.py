"""The one script for an H200 (or any GPU/TPU): check the compiled kernels, then time them.

    python -m benchmarks.gpu_check --out gpu.jsonl          # on the accelerator
    python -m benchmarks.gpu_check --smoke --out smoke.jsonl  # tiny, any machine

Device time is scarce, so the run is ordered by what matters most and writes
one JSON line per item the moment it finishes (a run cut short keeps what it
did):

1. Correctness: for each of the four compile-check blocks (tanh RNN, GRU,
   LSTM, residual MLP with layer norm; B=4096, D=128, bfloat16) the forward
   and `grad` with the default `Options()` (what a user gets: the
   kernel, or XLA with the warning) and with `"pallas"`, against
   `reference.iterate`, padded rows poisoned with NaN. Compile seconds are
   recorded per item.
   Then every feature that changes what the kernels do (gradient modes,
   halting, keys, the step index, per-step outputs, hoisting, an int32
   leaf, pytree state, unsorted rows) through
   `pallas_loop.testing.check_against_reference` (`feature_check.py`). On
   a TPU, next, the tile-height sweep (`tiles.tpu_sweep`: 128 to 2048 rows
   beside the masked scan), the TPU's first design question.
2. Which design wins (`design_variants`): the fused kernel with and without
   loop-invariant hoisting (`Options(hoist=True/False)`), with libdevice's
   tanh in place of the hardware's (`approx_tanh=False`), and under each tile
   schedule (`schedule="grid"/"persistent"`) against the masked scan and
   vmap(lax.while_loop), tanh RNN and GRU, D=128 bfloat16, counts uniform in
   [1, 64], B=4096 and B=32768 forward, then B=4096 forward+backward
   (hoisting and tanh only); compile seconds recorded. An option this checkout's
   `pallas_loop.Options` lacks is a skipped line with the reason.
3. Timing, D=128 first: pallas vs the masked scan vs vmap(lax.while_loop) vs
   the XLA implementation on `cases.gpu_suite()` (every count distribution;
   forward, and forward+backward on recurrent-depth counts); ratios within
   this run, medians.
4. The gradient modes (forward kernel + fused backward kernel vs jit(grad)
   of the masked scan, float32 at "highest" matmul precision) and, on a GPU,
   the block_rows 16 / 32 / 64 sweep.
5. D=256 timing.

`--budget` (seconds, default 420: the 8-minute device allowance less start-up)
stops starting new items once spent; skipped items are written as such.
Sized from the deviceless compile check (2-12 s per block's forward+backward
compile on the H200 at D=128). Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import json
import statistics
import sys
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from benchmarks import cases
from benchmarks import feature_check
from benchmarks import grad_modes
from benchmarks import harness
from benchmarks import tiles

CHECK_BLOCKS = ("tanh_rnn", "gru", "lstm", "residual_mlp_ln")


def check_block(block: str, batch: int, d: int, max_iters: int, implementation) -> dict:
  """Forward and parameter gradient of one block against the reference."""
  dtype = jnp.bfloat16
  # Three extra rows: the last tile is partial, so padding is exercised.
  step, params, h0, x = blocks.make(block, batch + 3, d, dtype, jax.random.key(11))
  n = jnp.asarray(harness.count_distribution("recurrent_depth", batch + 3, max_iters, 11))

  def forward(run, p):
    return run(step, p, h0, x, iters=n, max_iters=max_iters)

  def loss(run, p):
    return sum(jnp.sum(jnp.tanh(a.astype(jnp.float32))) for a in jax.tree.leaves(forward(run, p)))

  def ours(*a, **k):
    return pallas_loop.iterate(*a, **k, options=pallas_loop.Options(implementation=implementation))

  out: dict = {"item": "correctness", "block": block, "batch": batch, "d": d,
               "dtype": "bfloat16", "implementation": implementation}
  fns = {"forward": lambda run: jax.jit(lambda p: forward(run, p)),
         "grad": lambda run: jax.jit(jax.grad(lambda p: loss(run, p)))}
  for what, make in fns.items():
    with pallas_loop.testing.poisoned_padding():
      fn = make(ours)
      start = time.perf_counter()
      compiled = fn.lower(params).compile()
      out[f"{what}_compile_s"] = time.perf_counter() - start
      got = compiled(params)
    want = make(reference.iterate)(params)
    out[f"{what}_max_error"] = harness.max_error(got, want)
    out[f"{what}_finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all()
                                     for a in jax.tree.leaves(got)))
  # Errors are scaled by each leaf's magnitude (`harness.max_error`), so the
  # parameter gradients (sums over thousands of bf16 rows) are held to the
  # forward's tolerance: the 100x an absolute error once needed would now
  # pass any finite gradient.
  tol = harness.tolerance("bfloat16", max_iters)
  out["ok"] = (out["forward_finite"] and out["grad_finite"]
               and out["forward_max_error"] <= tol and out["grad_max_error"] <= tol)
  return out


# The design question the first device answers: the fused kernel with and
# without loop-invariant hoisting and under each tile schedule, against the
# masked scan and vmap(lax.while_loop). (name, fields of the kernel's
# pallas_loop.Options); the baselines have none.
DESIGN_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("masked_scan", {}),
    ("vmap_while", {}),
    ("pallas hoist=True", {"hoist": True}),
    ("pallas hoist=False", {"hoist": False}),
    # libdevice's tanh in place of the hardware's (a bf16 state's default)
    ("pallas approx_tanh=False", {"approx_tanh": False}),
    ("pallas schedule=grid", {"schedule": "grid"}),
    ("pallas schedule=persistent", {"schedule": "persistent"}),
)


def unsupported_keywords(keywords: dict) -> list[str]:
  """The options this checkout's `pallas_loop.Options` has no field for.

  Example:
    >>> unsupported_keywords({"hoist": False, "no_such_option": 1})
    ['no_such_option']
  """
  accepted = {f.name for f in dataclasses.fields(pallas_loop.Options)}
  return [k for k in keywords if k not in accepted]


def design_variants(block: str, batch: int, d: int, max_iters: int, repeats: int,
                    grad: bool = False, dtype=jnp.bfloat16, seed: int = 0) -> list[dict]:
  """Times `DESIGN_VARIANTS` on one block, counts uniform in [1, max_iters].

  Every variant is lowered and compiled (timed: `compile_s`), run once and
  checked against the masked scan, then all are timed round-robin
  (`repeats` rounds, medians). A variant whose option this `Options` does
  not have is a line with `skipped` and the reason; one that fails to
  compile or run is a line with its error (and `ok` False). With `grad`,
  `jax.grad` of sum(tanh(output)) in the parameters (vmap_while has no
  reverse-mode gradient, and the schedules are left to the forward).

  Args:
    block: a name in `blocks.BLOCKS`.
    batch, d, max_iters: rows, state width, the step cap.
    repeats: timed rounds.
    grad: forward+backward instead of forward.
    dtype: parameters' and state's dtype.
    seed: of the parameters and the counts.

  Returns:
    One dict per variant (`item` "design").
  """
  step, params, h0, x = blocks.make(block, batch, d, dtype, jax.random.key(seed))
  iters = jnp.asarray(harness.count_distribution("uniform", batch, max_iters, seed))
  base = {"item": "design", "block": block, "batch": batch, "d": d, "max_iters": max_iters,
          "counts": "uniform", "dtype": jnp.dtype(dtype).name,
          "mode": "fwd+bwd" if grad else "forward"}
  variants = [(n, kw) for n, kw in DESIGN_VARIANTS
              if not grad or (n != "vmap_while" and "schedule" not in kw)]
  lines, fns = [], {}
  for name, kw in variants:
    line = dict(base, variant=name, impl=name, keywords=kw)
    lines.append(line)
    missing = unsupported_keywords(kw)
    if missing:
      line["skipped"] = f"pallas_loop.Options has no {missing} in this checkout"
      continue
    if name == "masked_scan":
      impl = reference.iterate
    elif name == "vmap_while":
      impl = harness.vmap_while
    else:
      impl = functools.partial(pallas_loop.iterate,
                               options=pallas_loop.Options(implementation="pallas", **kw))
    run = functools.partial(impl, step, iters=iters, max_iters=max_iters)
    if grad:
      fn = jax.jit(jax.grad(lambda p, h, x_, run=run: sum(
          jnp.sum(jnp.tanh(a.astype(jnp.float32))) for a in jax.tree.leaves(run(p, h, x_)))))
    else:
      fn = jax.jit(run)
    try:
      start = time.perf_counter()
      fns[name] = fn.lower(params, h0, x).compile()
      line["compile_s"] = time.perf_counter() - start
      line["out"] = jax.block_until_ready(fns[name](params, h0, x))
    except Exception as e:  # pylint: disable=broad-except  # recorded, and fails the run
      fns.pop(name, None)
      line.update(error=f"{type(e).__name__}: {e}"[:2000], ok=False)
  times: dict[str, list[float]] = {n: [] for n in fns}
  for _ in range(max(1, repeats)):
    for n, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(params, h0, x))
      times[n].append(time.perf_counter() - start)
  tol = harness.tolerance(base["dtype"], max_iters)  # errors scaled: gradients too
  want = lines[0].get("out")
  seconds = {n: statistics.median(t) for n, t in times.items()}
  for line in lines:
    got = line.pop("out", None)
    if got is None:
      continue
    line["seconds"] = seconds[line["variant"]]
    line["max_error"] = harness.max_error(got, want) if want is not None else None
    line["ok"] = line["max_error"] is not None and line["max_error"] <= tol
    for ref in ("masked_scan", "vmap_while"):
      if ref in seconds:
        line[f"speedup_vs_{ref}"] = seconds[ref] / line["seconds"]
  return lines


def print_design(lines: list[dict]) -> None:
  """Prints the design comparison: a row per (case, variant)."""
  header = (f"{'case':40s} {'variant':28s} {'median ms':>10s} {'vs scan':>8s} "
            f"{'vs vmapW':>8s} {'compile s':>9s} {'max err':>9s}")
  print(header)
  print("-" * len(header))
  for r in lines:
    case = f"{r['block']} B={r['batch']} D={r['d']} T={r['max_iters']} {r['mode']}"
    if "seconds" not in r:
      print(f"{case:40s} {r['variant']:28s} {r.get('skipped') or r.get('error', '')}"[:200])
      continue
    ratio = lambda k, r=r: f"{r[k]:7.2f}x" if r.get(k) is not None else f"{'n/a':>8s}"
    print(f"{case:40s} {r['variant']:28s} {r['seconds'] * 1e3:10.3f} "
          f"{ratio('speedup_vs_masked_scan')} {ratio('speedup_vs_vmap_while')} "
          f"{r['compile_s']:9.1f} {r['max_error']:9.2e}")


def _items(args) -> Iterator[tuple[str, Callable[[], list[dict]]]]:
  """(name, run) in priority order; run returns the result lines."""
  if args.smoke:
    batch, d, max_iters = 64, 16, 8
    check_blocks = ("tanh_rnn", "gru")
  else:
    batch, d, max_iters = 4096, 128, 16
    check_blocks = CHECK_BLOCKS
  for block in check_blocks:
    for impl in (None, "pallas"):
      yield (f"check {block} implementation={impl}",
             lambda block=block, impl=impl: [check_block(block, batch, d, max_iters, impl)])
  # Every feature that changes what the kernels do, against the oracle.
  feature_sizes = feature_check.sizes(args.smoke)
  for feature in feature_check.FEATURES:
    yield (f"feature {feature.name}",
           lambda feature=feature: [feature_check.run(feature, *feature_sizes)])
  tpu_sweep = jax.default_backend() == "tpu" and not args.smoke
  if tpu_sweep:
    # A TPU core runs tiles one after another: the tile height is its
    # first design question (the GPU's comes with the design variants).
    yield "block_rows sweep (TPU)", lambda: [dict(r, item="block_rows")
                                             for r in tiles.tpu_sweep(args.repeats)]
  # Which design wins: hoisting and schedules against the baselines.
  design_batches, design_d, design_t = ((64, 128), 16, 8) if args.smoke else ((4096, 32768), 128, 64)
  design_repeats = 1 if args.smoke else args.repeats
  for design_batch in design_batches:
    for block in ("tanh_rnn", "gru"):
      yield (f"design {block} B={design_batch} forward",
             lambda block=block, b=design_batch: design_variants(
                 block, b, design_d, design_t, design_repeats))
  for block in ("tanh_rnn", "gru"):
    yield (f"design {block} B={design_batches[0]} fwd+bwd",
           lambda block=block: design_variants(block, design_batches[0], design_d, design_t,
                                               design_repeats, grad=True))
  suite = list(cases.smoke_suite() if args.smoke else
               cases.tpu_suite() if jax.default_backend() == "tpu" else cases.gpu_suite())
  repeats = 1 if args.smoke else args.repeats
  first = [c for c in suite if c.d <= 128]
  later = [c for c in suite if c.d > 128]

  def timing(case):
    def run():
      with pallas_loop.testing.poisoned_padding():
        lines = harness.run_case(case, None, repeats, seed=0)
      return [dict(r, item="timing") for r in lines]
    return run

  for case in first:
    yield f"time {case.label}", timing(case)
  grad_cases = grad_modes.scaled_cases(*((16, 16) if args.smoke else (4096, 128)))
  if args.smoke:  # the first case shows the item runs (the DEQ's: the benchmark's own test)
    grad_cases = grad_cases[:1]

  def gradient_modes():
    # float32 cases checked to 1e-4: at "highest" precision (DEFAULT is one
    # bf16 pass on a TPU, TF32 on a GPU), for the kernels and the scan alike.
    with jax.default_matmul_precision("highest"):
      rows = grad_modes.run_all(["xla", "pallas"], repeats, cases=grad_cases)
    return [dict(r, item="grad_modes", matmul_precision="highest") for r in rows]

  yield "gradient modes", gradient_modes
  if not tpu_sweep:  # the TPU's ran after the correctness checks
    yield "block_rows sweep", lambda: [dict(r, item="block_rows") for r in (
        tiles.sweep(64, 16, jnp.bfloat16, (8, 16), 1) if args.smoke else
        tiles.gpu_sweep(repeats))]
  for case in later:
    yield f"time {case.label}", timing(case)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny cases, runs anywhere")
  parser.add_argument("--out", default=None, help="JSON lines, one per item, written as it goes")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--budget", type=float, default=420.0,
                      help="seconds; no new item starts after this")
  parser.add_argument("--skip", action="append", default=[], metavar="PREFIX",
                      help="leave out the items whose name starts with this (repeatable), "
                           "e.g. a rerun's already measured sweep")
  parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                      help="run only the items whose name starts with this (repeatable)")
  args = parser.parse_args(argv)

  start = time.time()
  device = jax.devices()[0]
  header = {"item": "machine", "jax": jax.__version__, "device": device.device_kind,
            "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d")}
  print(f"gpu_check: JAX {jax.__version__}, {device.device_kind} ({jax.default_backend()}), "
        f"budget {args.budget:.0f} s", flush=True)
  out = open(args.out, "w") if args.out else None

  def write(line: dict):
    if out:
      out.write(json.dumps(line, default=float) + "\n")
      out.flush()

  write(header)
  bad, timing_rows, design_rows = [], [], []
  for name, run in _items(args):
    if any(name.startswith(prefix) for prefix in args.skip):
      write({"item": "skipped", "name": name, "reason": "--skip"})
      continue
    if args.only and not any(name.startswith(prefix) for prefix in args.only):
      write({"item": "skipped", "name": name, "reason": "--only"})
      continue
    elapsed = time.time() - start
    if elapsed > args.budget:
      write({"item": "skipped", "name": name, "reason": f"budget spent ({elapsed:.0f} s)"})
      print(f"skipped (budget): {name}", flush=True)
      continue
    t0 = time.time()
    try:
      lines = run()
    except Exception as e:  # pylint: disable=broad-except
      lines = [{"item": "error", "name": name, "error": f"{type(e).__name__}: {e}"[:2000],
                "ok": False}]
    for line in lines:
      line["item_seconds"] = time.time() - t0
      write(line)
      if not line.get("ok", True):
        bad.append(f"{name}: {line.get('impl', '')} {line.get('case', '')}".strip())
    timing_rows += [l for l in lines if l.get("item") == "timing"]
    design_rows += [l for l in lines if l.get("item") == "design"]
    print(f"{name}: {time.time() - t0:.1f} s, "
          f"{'ok' if all(l.get('ok', True) for l in lines) else 'MISMATCH'}", flush=True)
  if design_rows:
    print_design(design_rows)
  if timing_rows:
    harness.print_table(timing_rows)
  write({"item": "done", "seconds": time.time() - start, "mismatches": bad})
  if out:
    out.close()
  print(f"total {time.time() - start:.0f} s")
  for b in bad:
    print(f"MISMATCH: {b}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
