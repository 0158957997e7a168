"""The one script for an H200 (or any GPU/TPU): check the compiled kernels, then time them.

    python -m benchmarks.gpu_check --out gpu.jsonl          # on the accelerator
    python -m benchmarks.gpu_check --smoke --out smoke.jsonl  # tiny, any machine

Device time is scarce, so the run is ordered by what matters most and writes
one JSON line per item the moment it finishes (a run cut short keeps what it
did):

1. Correctness: for each of the four compile-check blocks (tanh RNN, GRU,
   LSTM, residual MLP with layer norm; B=4096, D=128, bfloat16) the forward
   and `grad` with the default `implementation=None` (what a user gets: the
   kernel, or XLA with the warning) and with `"pallas"`, against
   `reference.iterate`, padded rows poisoned with NaN. Compile seconds are
   recorded per item.
2. Timing, D=128 first: pallas vs the masked scan vs vmap(lax.while_loop) vs
   the XLA implementation on `cases.gpu_suite()` (every count distribution;
   forward, and forward+backward on recurrent-depth counts); ratios within
   this run, medians.
3. The gradient modes (forward kernel + fused backward kernel vs jit(grad)
   of the masked scan) and the block_rows 16 / 32 / 64 sweep.
4. D=256 timing.

`--budget` (seconds, default 420: the 8-minute device allowance less start-up)
stops starting new items once spent; skipped items are written as such.
Sized from the deviceless compile check (2-12 s per block's forward+backward
compile on the H200 at D=128). Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
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
    return pallas_loop.iterate(*a, implementation=implementation, **k)

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
  # The error of the bf16 reference from a float32 run bounds what a bf16
  # recurrence may differ by; gradients get the harness's looser factor.
  tol = harness.tolerance("bfloat16", max_iters)
  out["ok"] = (out["forward_finite"] and out["grad_finite"]
               and out["forward_max_error"] <= tol and out["grad_max_error"] <= 100 * tol)
  return out


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
  suite = list(cases.smoke_suite() if args.smoke else cases.gpu_suite())
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
  yield "gradient modes", lambda: [dict(r, item="grad_modes") for r in grad_modes.run_all(
      ["xla", "pallas"], repeats, cases=grad_cases)]
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
  bad, timing_rows = [], []
  for name, run in _items(args):
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
    print(f"{name}: {time.time() - t0:.1f} s, "
          f"{'ok' if all(l.get('ok', True) for l in lines) else 'MISMATCH'}", flush=True)
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
