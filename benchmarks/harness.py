"""What the benchmark scripts share: the implementations, timing, checking.

Every implementation a JAX user has today runs in the same process on the
same inputs, so the printed figures are ratios within one run:

  masked_scan   `reference.iterate`: lax.scan over max_iters, jnp.where masking
                (what the user's second question does; every row pays max_iters)
  vmap_while    jax.vmap of a per-row lax.while_loop (pays for the slowest row;
                no reverse-mode gradient)
  xla           pallas_loop.iterate(implementation="xla")
  pallas        pallas_loop.iterate(implementation="pallas") (interpret mode on
                CPU: a correctness vehicle there, not a speed claim)

Per case: median time, speedup vs the masked scan and vs vmap(while_loop),
the ideal speedup, the fraction of it achieved, and the work efficiency
(useful row-steps / row-steps computed, `rows_computed`). Forward+backward
cases (`Case.grad`) time jax.grad of the sum of the output; vmap(while_loop)
has no reverse-mode gradient and is left out there.

The ideal speedup over the masked scan is B*max_iters/sum(n_i): what an
implementation where finished rows cost nothing would reach.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import tuning
from pallas_loop._src import backend as backend_lib
from pallas_loop._src import backend_mosaic_tpu
from pallas_loop._src import backend_triton
from pallas_loop._src import xla_backward
from pallas_loop._src import xla_forward
from pallas_loop import _reference as reference
from benchmarks import blocks
from benchmarks import cases


# Dense bf16 tensor-core peak (TFLOP/s) from the vendor's data sheet, not measured:
# the denominator of "of peak" (useful FLOPs / time / peak) on a GPU. Matched
# against `device_kind` by substring.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(device_kind: str, dtype: str) -> float | None:
  """The data-sheet bf16 tensor-core peak for a known GPU, else None.

  Example:
    >>> peak_tflops("NVIDIA H200", "bfloat16"), peak_tflops("cpu", "bfloat16")
    (989.0, None)
  """
  if dtype != "bfloat16":
    return None
  return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device_kind), None)


def vmap_while(step, params, h0, x, *, iters, max_iters, tol=None):
  """jax.vmap of a per-row while_loop: the other baseline users reach for.

  With `tol`, a row's loop also ends once rms(h_new - h) <= tol.
  """
  n = jnp.clip(jnp.broadcast_to(iters, (jax.tree.leaves(h0)[0].shape[0],)), 0, max_iters)

  def one_row(h, x_row, n_row):
    def body(carry):
      t, h, _ = carry
      h_new = step(params, jax.tree.map(lambda a: a[None], h),
                   jax.tree.map(lambda a: a[None], x_row))
      h_new = jax.tree.map(lambda a: a[0], h_new)
      done = jnp.bool_(False)
      if tol is not None:
        diffs = [jnp.ravel(a.astype(jnp.float32) - b.astype(jnp.float32))
                 for a, b in zip(jax.tree.leaves(h_new), jax.tree.leaves(h))]
        done = jnp.sqrt(jnp.mean(jnp.square(jnp.concatenate(diffs)))) <= tol
      return t + 1, h_new, done
    cond = lambda c: (c[0] < n_row) & ~c[2]
    return lax.while_loop(cond, body, (0, h, jnp.bool_(False)))[1]

  return jax.vmap(one_row)(h0, x, n)


IMPLEMENTATIONS: dict[str, Callable] = {
    "masked_scan": reference.iterate,
    "vmap_while": vmap_while,
    "xla": lambda *a, **k: pallas_loop.iterate(*a, implementation="xla", **k),
    "pallas": lambda *a, **k: pallas_loop.iterate(*a, implementation="pallas", **k),
}


Case = cases.Case
count_distribution = cases.count_distribution


# One timing routine for the library's tuner and the benchmarks.
median_seconds = tuning.median_seconds


def max_error(got, want) -> float:
  """The largest |got - want| over the leaves, each leaf's scaled by
  1 / max(1, max|want|): an O(1) state is judged absolutely, a gradient
  summed over thousands of rows (a bf16 one with a unit in the last place
  of 32 at 4096) on its own scale.

  Example:
    >>> import jax.numpy as jnp
    >>> max_error([jnp.array([0.5]), jnp.array([4000.0])],
    ...           [jnp.array([0.25]), jnp.array([4032.0])])
    0.25
  """
  errors = []
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
    scale = jnp.maximum(1.0, jnp.max(jnp.abs(w)))
    errors.append(float(jnp.max(jnp.abs(g - w)) / scale))
  return max(errors)


def tolerance(dtype: str, max_iters: int) -> float:
  """Allowed max |impl - masked_scan|: a few ulps per step of the dtype."""
  return (1e-5 if dtype == "float32" else 2.0 ** -6) * max(1, max_iters) ** 0.5 * 4


def pallas_block_rows(batch: int) -> int:
  """The kernel's default rows per tile on this machine's backend."""
  platform = jax.default_backend()
  if platform == "gpu":
    return backend_triton.TRITON.default_block_rows(batch)
  if platform == "tpu":
    return backend_mosaic_tpu.MOSAIC_TPU.default_block_rows(batch)
  return backend_lib.INTERPRET.default_block_rows(batch)


def bucket_for(active: int, sizes: tuple[int, ...]) -> int:
  """The ladder size a step with `active` running rows runs at (0 if none)."""
  if active <= 0:
    return 0
  return min(s for s in sizes if s >= active)


def bucketed_rows_computed(steps, sizes: tuple[int, ...] | None = None) -> int:
  """Row-steps the bucketed loop computes, given each row's applied steps.

  A row runs at trip t iff t < steps[row] (it stops for good once it stops),
  so a_t = #{steps > t} rows run at trip t, on a bucket of `bucket_for(a_t)`
  rows. Used by the benchmarks for the work efficiency.

  Args:
    steps: int [B], the steps each row applied (`IterateInfo.steps`).
    sizes: the ladder (default `bucket_sizes(B)`).

  Returns:
    sum over trips t of the bucket size at t.
  """
  steps = np.asarray(steps).reshape(-1)
  sizes = xla_forward.bucket_sizes(steps.size) if sizes is None else sizes
  if steps.size == 0:
    return 0
  # a_t for t = 0 .. max-1: rows with steps > t.
  hist = np.bincount(steps, minlength=int(steps.max()) + 1)
  active = steps.size - np.cumsum(hist)[:-1]
  return int(sum(bucket_for(int(a), sizes) for a in active))


def rows_computed(impl: str, counts: np.ndarray, steps: np.ndarray, max_iters: int,
                  block_rows: int) -> int:
  """Row-steps an implementation computes (the denominator of work efficiency).

  masked_scan: every row, every one of max_iters steps. vmap_while: every row
  until the slowest is done (a batched while_loop). xla: the bucketed stages
  (`bucketed_rows_computed`). pallas: each tile of `block_rows` rows, after
  ordering by descending count, runs until its slowest row is done.
  """
  batch = counts.size
  if impl == "masked_scan":
    return batch * max_iters
  if impl == "vmap_while":
    return batch * int(steps.max(initial=0))
  if impl == "xla":
    return bucketed_rows_computed(steps)
  if impl == "pallas":
    order = np.argsort(-counts, kind="stable")
    s = steps[order]
    pad = -batch % block_rows
    s = np.concatenate([s, np.zeros(pad, s.dtype)]).reshape(-1, block_rows)
    return int(block_rows * s.max(axis=1).sum())
  raise ValueError(impl)


def _applicable(case: Case) -> list[str]:
  names = list(case.impls or IMPLEMENTATIONS)
  if case.grad is not None:  # vmap(while_loop) has no reverse-mode gradient
    names = [n for n in names if n != "vmap_while"]
  return names


def _make_fn(case: Case, name: str, step, halting):
  impl = IMPLEMENTATIONS[name]
  extra = {}
  if case.grad is not None and name in ("xla", "pallas"):
    extra["grad"] = case.grad
  run = lambda p, h, x_, k: impl(step, p, h, x_, iters=k, max_iters=case.max_iters,
                                 **halting, **extra)
  if case.grad is None:
    return jax.jit(run)
  loss = lambda p, h, x_, k: sum(jnp.sum(a.astype(jnp.float32))
                                 for a in jax.tree.leaves(run(p, h, x_, k)))
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _grouped_row_steps(steps, group: int) -> int:
  """Row-steps when rows, ordered by count, run in groups of `group` rows,
  each to its own largest count."""
  ordered = np.sort(np.asarray(steps).reshape(-1))[::-1]
  return int(sum(group * int(ordered[i]) for i in range(0, ordered.size, group)))


def run_case(case: Case, impls=None, repeats: int = 5, seed: int = 0) -> list[dict]:
  """Times and checks the implementations on one case; one dict per impl.

  The implementations are timed round-robin (one call of each per round,
  `repeats` rounds) so a burst of load on a shared machine hits them alike;
  times are medians. Every output (the gradients, for a fwd+bwd case) is
  checked against the masked scan's.
  """
  names = [n for n in _applicable(case) if impls is None or n in impls]
  names = ["masked_scan"] + [n for n in names if n != "masked_scan"]
  step, params, h0, x = blocks.make(case.block, case.batch, case.d, jnp.dtype(case.dtype),
                                    jax.random.key(seed))
  counts = count_distribution(case.counts, case.batch, case.max_iters, seed)
  iters = jnp.asarray(counts)
  halting = {} if case.tol is None else dict(tol=case.tol)
  steps = np.asarray(reference.iterate(step, params, h0, x, iters=iters,
                                       max_iters=case.max_iters, return_info=True,
                                       **halting)[1].steps)
  useful = int(steps.sum())  # with halting: the steps rows took to converge
  ideal = case.batch * case.max_iters / max(useful, 1)
  flops = useful * blocks.BLOCKS[case.block].flops_per_row_step(case.d)
  if case.grad is not None:
    flops *= 3  # backward ~ 2x forward, plus the forward
  block_rows = pallas_block_rows(case.batch)
  fns, compile_seconds = {}, {}
  for n in names:
    # Lowering (tracing included) + compilation, as a user's first call pays.
    start = time.perf_counter()
    fns[n] = _make_fn(case, n, step, halting).lower(params, h0, x, iters).compile()
    compile_seconds[n] = time.perf_counter() - start
  outs = {n: jax.block_until_ready(fn(params, h0, x, iters)) for n, fn in fns.items()}
  times = {n: [] for n in names}
  for _ in range(max(1, repeats)):
    for n, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(params, h0, x, iters))
      times[n].append(time.perf_counter() - start)
  tol = tolerance(case.dtype, case.max_iters)  # errors scaled (`max_error`): gradients too
  results = []
  for n in names:
    err = max_error(outs[n], outs["masked_scan"])
    computed = rows_computed(n, counts, steps, case.max_iters, block_rows)
    if case.grad is not None and n != "masked_scan":
      # grad="full" recomputes the forward and runs the reverse loop: 2 row-
      # steps per row and step, over row groups (XLA) or tiles (pallas)
      # ordered by count, each to its own largest count.
      group = (block_rows if n == "pallas" else
               -(-case.batch // xla_backward.group_count(case.batch)))
      computed += 2 * _grouped_row_steps(steps, group)
    elif case.grad is not None:  # autodiff of the scan: reverse over every step
      computed *= 2
    seconds = statistics.median(times[n])
    results.append(dict(
        case=case.label, block=case.block, batch=case.batch, d=case.d,
        max_iters=case.max_iters, counts=case.counts, dtype=case.dtype, tol=case.tol,
        grad=case.grad, impl=n, seconds=seconds, min_seconds=min(times[n]),
        max_error=err, ok=bool(err <= tol), ideal_speedup=ideal,
        compile_seconds=compile_seconds[n],
        work_efficiency=useful * (2 if case.grad else 1) / max(computed, 1), useful_gflop=flops / 1e9,
        block_rows=block_rows if n == "pallas" else None))
  base = {r["impl"]: r["seconds"] for r in results}
  for r in results:
    r["speedup_vs_masked_scan"] = base["masked_scan"] / r["seconds"]
    r["speedup_vs_vmap_while"] = (base["vmap_while"] / r["seconds"]
                                  if "vmap_while" in base else None)
    r["fraction_of_ideal"] = r["speedup_vs_masked_scan"] / ideal
    r["gflops"] = r["useful_gflop"] / r["seconds"]
    peak = peak_tflops(jax.devices()[0].device_kind, case.dtype)
    r["fraction_of_peak"] = None if peak is None else r["gflops"] / (peak * 1e3)
  return results


# What the columns of `print_table` mean, printed with it.
COLUMNS = """\
  median ms  median time of one call (forward; the jax.grad of the sum for fwd+bwd)
  vs scan    speedup over the masked scan (lax.scan over max_iters, masked: every
             row pays max_iters steps), >1 = faster
  vs vmapW   speedup over jax.vmap of a per-row lax.while_loop (pays for the
             slowest row; no reverse-mode gradient, so n/a with fwd+bwd)
  ideal      B*max_iters/sum(n_i): the speedup over the masked scan if rows that
             are done cost nothing (n_i: the steps row i takes)
  of ideal   vs scan / ideal (1.0 = finished rows cost nothing)
  work eff   useful row-steps / row-steps computed (padding, tiles and stages
             that run past a row's count lower it)
  GFLOP/s    the useful steps' FLOPs / median time
  max err    largest difference from the masked scan's output (gradients with
             fwd+bwd), scaled by each leaf's magnitude
  compile s  lowering + compile: what a first call pays"""

_COLUMN_HEADER = (f"{'case':56s} {'impl':18s} {'median ms':>10s} {'vs scan':>8s} "
                  f"{'vs vmapW':>8s} {'ideal':>6s} {'of ideal':>8s} {'work eff':>8s} "
                  f"{'GFLOP/s':>8s} {'max err':>9s} {'compile s':>9s}")


def print_header() -> None:
  """Prints the table's column header (and, on a CPU, what 'pallas' means)."""
  if jax.default_backend() == "cpu":
    print("note: CPU run: 'pallas' is the kernel in Pallas INTERPRET mode "
          "(a correctness vehicle, not the compiled kernel's speed).")
  print(_COLUMN_HEADER)
  print("-" * len(_COLUMN_HEADER))


def print_rows(results: list[dict]) -> None:
  """Prints one row per (case, implementation), as `run_case` returns them."""
  pallas = "pallas (interpret)" if jax.default_backend() == "cpu" else "pallas"
  for r in results:
    vs_vmap = r.get("speedup_vs_vmap_while")
    vs_vmap = f"{vs_vmap:7.2f}x" if vs_vmap is not None else f"{'n/a':>8s}"
    name = pallas if r["impl"] == "pallas" else r["impl"]
    print(f"{r['case']:56s} {name:18s} {r['seconds'] * 1e3:10.3f} "
          f"{r['speedup_vs_masked_scan']:7.2f}x {vs_vmap} "
          f"{r['ideal_speedup']:5.2f}x {r['fraction_of_ideal']:8.2f} "
          f"{r['work_efficiency']:8.3f} {r['gflops']:8.2f} "
          f"{r['max_error']:9.2e} {r.get('compile_seconds', float('nan')):9.2f}"
          f"{'' if r['ok'] else '  MISMATCH'}"
          + (f"  {r['fraction_of_peak']:.3f} of bf16 peak"
             if r.get("fraction_of_peak") is not None else ""), flush=True)


def print_table(results: list[dict]) -> None:
  """Prints the header, then one row per (case, implementation)."""
  print_header()
  print_rows(results)
