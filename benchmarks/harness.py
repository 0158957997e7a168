"""What the benchmark scripts share: the implementations, timing, checking.

Every implementation a JAX user has today runs in the same process on the
same inputs, so the printed figures are ratios within one run:

  masked_scan   `reference.iterate`: lax.scan over max_iters, jnp.where masking
                (what the user's second question does; every row pays max_iters)
  hoisted_scan  the same scan with the block's state-independent work (`x U +
                b`) computed once before it, by hand (`blocks.Block.hoisted`):
                what a careful user writes instead (blocks that have such work)
  vmap_while    jax.vmap of a per-row lax.while_loop (pays for the slowest row;
                no reverse-mode gradient)
  xla           pallas_loop.iterate(options=Options(implementation="xla"))
  pallas        pallas_loop.iterate(options=Options(implementation="pallas"))
                (interpret mode on CPU: a correctness vehicle there, not a
                speed claim)

Timing measures the device, not the host (`device_timing.py`): each
implementation is applied `chain` times inside one jit, the state fed back
and each application on its own (rolled) inputs, and the per-call floor
divided by the chain (a jitted call's host round trip, measured beside) is
subtracted; the floor is reported with every row.

Per case: median time, speedup vs the masked scan and vs vmap(while_loop),
ns per useful row-step and its ratio to the matrix unit's bound for the
block (on a chip whose bf16 peak is known), the ideal speedup, the fraction
of it achieved, and the work efficiency (useful row-steps / row-steps
computed, `rows_computed`). Forward+backward
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
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import kernel_tpu_groups
from pallas_loop._src.kernels import backend_triton
from pallas_loop._src.xla import xla_backward
from pallas_loop._src.xla import xla_forward
from pallas_loop import _reference as reference
from benchmarks import blocks
from benchmarks import cases
from benchmarks import device_timing


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


def hoisted_scan(step, params, h0, x, **kwargs):
  """The masked scan of `step` hoisted by hand (`blocks.Block.hoisted`): its
  state-independent inputs computed once, then the scan of the step that
  takes them."""
  pre, hoisted_step = blocks.hoisted_form(step)
  return reference.iterate(hoisted_step, params, h0, pre(params, x), **kwargs)


IMPLEMENTATIONS: dict[str, Callable] = {
    "masked_scan": reference.iterate,
    "hoisted_scan": hoisted_scan,
    "vmap_while": vmap_while,
    "xla": lambda *a, **k: pallas_loop.iterate(
        *a, **k, options=pallas_loop.Options(implementation="xla")),
    "pallas": lambda *a, **k: pallas_loop.iterate(
        *a, **k, options=pallas_loop.Options(implementation="pallas")),
}


Case = cases.Case
count_distribution = cases.count_distribution


# One timing routine for the library's tuner and the call-by-call benchmarks.
median_seconds = tuning.median_seconds

# Applications per timed jit call: `device_timing` says why.
CHAIN = device_timing.CHAIN
CPU_CHAIN = device_timing.CPU_CHAIN
default_chain = device_timing.default_chain


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
    return kernel_tpu_groups.default_chunk_rows(batch)
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


def chunked_rows_computed(steps, chunk: int) -> int:
  """Row-steps the TPU's group kernel computes: at trip t the a_t rows still
  running (a prefix of the sorted rows) in whole chunks of `chunk` rows
  (groups ignored: at most a chunk a group more).

  Example:
    >>> chunked_rows_computed(np.array([3, 1, 1, 2]), 2)
    8
  """
  steps = np.asarray(steps).reshape(-1)
  if steps.size == 0:
    return 0
  hist = np.bincount(steps, minlength=int(steps.max()) + 1)
  active = steps.size - np.cumsum(hist)[:-1]
  return int(sum(-(-int(a) // chunk) * chunk for a in active))


def rows_computed(impl: str, counts: np.ndarray, steps: np.ndarray, max_iters: int,
                  block_rows: int) -> int:
  """Row-steps an implementation computes (the denominator of work efficiency).

  masked_scan (and hoisted_scan): every row, every one of max_iters steps. vmap_while: every row
  until the slowest is done (a batched while_loop). xla: the bucketed stages
  (`bucketed_rows_computed`). pallas: each tile of `block_rows` rows, after
  ordering by descending count, runs until its slowest row is done.
  """
  batch = counts.size
  if impl in ("masked_scan", "hoisted_scan"):
    return batch * max_iters
  if impl == "vmap_while":
    return batch * int(steps.max(initial=0))
  if impl == "xla":
    return bucketed_rows_computed(steps)
  if impl == "pallas" and jax.default_backend() == "tpu":
    return chunked_rows_computed(steps, block_rows)
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
  if blocks.BLOCKS[case.block].hoisted is None:  # nothing to hoist by hand
    names = [n for n in names if n != "hoisted_scan"]
  return names


def _make_fn(case: Case, name: str, step, halting, one_count: bool | None = None):
  """fn(params, h0, x, iters) -> the output (forward) or the gradients
  w.r.t. (params, h0) of the sum of the output (`case.grad`). `one_count`:
  `iterate` is given `iters=T`, not the [B] counts (None: for constant
  counts)."""
  impl = IMPLEMENTATIONS[name]
  extra = {}
  if case.grad is not None and name in ("xla", "pallas"):
    extra["grad"] = case.grad
  # Equal counts are given to `iterate` as one count, as a user writes "every
  # row T steps" (`iters=T`): it then knows at trace time that no row moves.
  if one_count is None:
    one_count = case.counts == "constant" and name in ("xla", "pallas")
  run = lambda p, h, x_, k: impl(step, p, h, x_, iters=case.max_iters if one_count else k,
                                 max_iters=case.max_iters, **halting, **extra)
  if case.grad is None:
    return run
  loss = lambda p, h, x_, k: sum(jnp.sum(a.astype(jnp.float32))
                                 for a in jax.tree.leaves(run(p, h, x_, k)))
  return jax.grad(loss, argnums=(0, 1))


def _chained(case: Case, fn, params):
  """apply(h, inputs) -> h for `device_timing.chained_seconds`: one
  application of `fn` on `inputs` ({"x", "iters"}), its result folded into
  the next application's state. A gradient is folded in multiplied by 0
  (not simplified away for floats), so the whole gradient is computed."""
  if case.grad is None:
    return lambda h, r: fn(params, h, r["x"], r["iters"])

  def apply(h, r):
    g_params, g_h = fn(params, h, r["x"], r["iters"])
    return device_timing.folded_gradient(h, g_h, g_params)

  return apply


def _grouped_row_steps(steps, group: int) -> int:
  """Row-steps when rows, ordered by count, run in groups of `group` rows,
  each to its own largest count."""
  ordered = np.sort(np.asarray(steps).reshape(-1))[::-1]
  return int(sum(group * int(ordered[i]) for i in range(0, ordered.size, group)))


def run_case(case: Case, impls=None, repeats: int = 5, seed: int = 0,
             chain: int | None = None) -> list[dict]:
  """Times and checks the implementations on one case; one dict per impl.

  Every output (the gradients, for a fwd+bwd case) is checked against the
  masked scan's, from one call of each. Times are per application, inside
  one jit (`device_timing.chained_seconds`, `chain` applications, default
  `default_chain()`), the floor subtracted; medians of `repeats` calls.
  """
  names = [n for n in _applicable(case) if impls is None or n in impls]
  names = ["masked_scan"] + [n for n in names if n != "masked_scan"]
  chain = default_chain() if chain is None else chain
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
  block = blocks.BLOCKS[case.block]
  flops = useful * block.flops_per_row_step(case.d)
  if case.grad is not None:
    flops *= 3  # backward ~ 2x forward, plus the forward
  kind = jax.devices()[0].device_kind
  loop_flops = (block.loop_flops_per_row_step or block.flops_per_row_step)(case.d)
  bound_ns = device_timing.bound_ns_per_row_step(loop_flops * (3 if case.grad else 1), kind)
  block_rows = pallas_block_rows(case.batch)
  fns, compile_seconds = {}, {}
  for n in names:
    # Lowering (tracing included) + compilation, as a user's first call pays.
    start = time.perf_counter()
    fns[n] = jax.jit(_make_fn(case, n, step, halting)).lower(params, h0, x, iters).compile()
    compile_seconds[n] = time.perf_counter() - start
  outs = {n: jax.block_until_ready(fn(params, h0, x, iters)) for n, fn in fns.items()}
  floor = device_timing.floor_seconds(h0, repeats)
  times, chains = {}, {}
  for n in names:
    times[n], chains[n] = device_timing.chained_seconds(
        _chained(case, _make_fn(case, n, step, halting), params), h0, {"x": x, "iters": iters},
        chain=chain, repeats=repeats, floor=floor)
  tol = tolerance(case.dtype, case.max_iters)  # errors scaled (`max_error`): gradients too
  results = []
  for n in names:
    err = max_error(outs[n], outs["masked_scan"])
    computed = rows_computed(n, counts, steps, case.max_iters, block_rows)
    if case.grad is not None and n not in ("masked_scan", "hoisted_scan"):
      # grad="full" recomputes the forward and runs the reverse loop: 2 row-
      # steps per row and step, over row groups (XLA) or tiles (pallas)
      # ordered by count, each to its own largest count.
      group = (block_rows if n == "pallas" else
               -(-case.batch // xla_backward.group_count(case.batch)))
      computed += 2 * _grouped_row_steps(steps, group)
    elif case.grad is not None:  # autodiff of the scan: reverse over every step
      computed *= 2
    seconds = times[n]
    ns = device_timing.ns_per_row_step(seconds, steps)
    results.append(dict(
        case=case.label, block=case.block, batch=case.batch, d=case.d,
        max_iters=case.max_iters, counts=case.counts, dtype=case.dtype, tol=case.tol,
        grad=case.grad, impl=n, seconds=seconds, floor_seconds=floor, chain=chains[n],
        ns_per_row_step=ns, bound_ns_per_row_step=bound_ns,
        of_bound=None if bound_ns is None else ns / bound_ns,
        max_error=err, ok=bool(err <= tol), ideal_speedup=ideal,
        compile_seconds=compile_seconds[n],
        work_efficiency=useful * (2 if case.grad else 1) / max(computed, 1), useful_gflop=flops / 1e9,
        block_rows=block_rows if n == "pallas" else None))
  base = {r["impl"]: r["seconds"] for r in results}
  for r in results:
    r["speedup_vs_masked_scan"] = base["masked_scan"] / r["seconds"]
    r["speedup_vs_hoisted_scan"] = (base["hoisted_scan"] / r["seconds"]
                                    if "hoisted_scan" in base else None)
    r["speedup_vs_vmap_while"] = (base["vmap_while"] / r["seconds"]
                                  if "vmap_while" in base else None)
    r["fraction_of_ideal"] = r["speedup_vs_masked_scan"] / ideal
    r["gflops"] = r["useful_gflop"] / r["seconds"]
    peak = peak_tflops(kind, case.dtype)
    r["fraction_of_peak"] = None if peak is None else r["gflops"] / (peak * 1e3)
  return results


# What the columns of `print_table` mean, printed with it.
COLUMNS = """\
  ms         one application on the device, inside one jit (many applications
             chained, each on its own rolled rows), the jitted call's floor
             (the host's round trip, printed below the table) left out; the
             forward, or the jax.grad of the sum for fwd+bwd
  vs scan    speedup over the masked scan (lax.scan over max_iters, masked: every
             row pays max_iters steps), >1 = faster
  vs hoisted speedup over that scan with the step's state-independent part
             (x U + b) computed once before the loop by hand (n/a: the block
             has no such part)
  vs vmapW   speedup over jax.vmap of a per-row lax.while_loop (pays for the
             slowest row; no reverse-mode gradient, so n/a with fwd+bwd)
  ns/rs      ns per useful row-step (a row's step it asked for)
  x bound    ns/rs over the matrix unit's bound: the step's state-dependent
             matmul FLOPs at the chip's bf16 peak (- where the peak is unknown)
  ideal      B*max_iters/sum(n_i): the speedup over the masked scan if rows that
             are done cost nothing (n_i: the steps row i takes)
  of ideal   vs scan / ideal (1.0 = finished rows cost nothing)
  work eff   useful row-steps / row-steps computed (padding, tiles and stages
             that run past a row's count lower it)
  max err    largest difference from the masked scan's output (gradients with
             fwd+bwd), scaled by each leaf's magnitude
  compile s  lowering + compile: what a first call pays"""

_COLUMN_HEADER = (f"{'case':56s} {'impl':18s} {'ms':>9s} {'vs scan':>8s} {'vs hoisted':>10s} "
                  f"{'vs vmapW':>8s} {'ns/rs':>7s} {'x bound':>7s} {'ideal':>6s} {'of ideal':>8s} "
                  f"{'work eff':>8s} {'max err':>9s} {'compile s':>9s}")


def print_header() -> None:
  """Prints the table's column header (and, on a CPU, what 'pallas' means)."""
  if jax.default_backend() == "cpu":
    print("note: CPU run: 'pallas' is the kernel in Pallas INTERPRET mode "
          "(a correctness vehicle, not the compiled kernel's speed).")
  print(_COLUMN_HEADER)
  print("-" * len(_COLUMN_HEADER))


def print_rows(results: list[dict]) -> None:
  """Prints one row per (case, implementation), as `run_case` returns them,
  then the per-call floor and chain lengths their times leave out."""
  pallas = "pallas (interpret)" if jax.default_backend() == "cpu" else "pallas"
  ratio = lambda v, w: f"{v:{w - 1}.2f}x" if v is not None else f"{'n/a':>{w}s}"
  for r in results:
    name = pallas if r["impl"] == "pallas" else r["impl"]
    bound = "-" if r.get("of_bound") is None else f"{r['of_bound']:.2f}"
    print(f"{r['case']:56s} {name:18s} {r['seconds'] * 1e3:9.3f} "
          f"{ratio(r['speedup_vs_masked_scan'], 8)} {ratio(r.get('speedup_vs_hoisted_scan'), 10)} "
          f"{ratio(r.get('speedup_vs_vmap_while'), 8)} {r['ns_per_row_step']:7.3f} "
          f"{bound:>7s} "
          f"{r['ideal_speedup']:5.2f}x {r['fraction_of_ideal']:8.2f} "
          f"{r['work_efficiency']:8.3f} "
          f"{r['max_error']:9.2e} {r.get('compile_seconds', float('nan')):9.2f}"
          f"{'' if r['ok'] else '  MISMATCH'}", flush=True)
  floors = sorted({round(r["floor_seconds"] * 1e3, 3) for r in results if "floor_seconds" in r})
  chains = sorted({r["chain"] for r in results if "chain" in r})
  if floors:
    print(f"  (floor left out: {'/'.join(map(str, floors))} ms a call; "
          f"{'/'.join(map(str, chains))} applications chained a call)", flush=True)


def print_table(results: list[dict]) -> None:
  """Prints the header, then one row per (case, implementation)."""
  print_header()
  print_rows(results)
