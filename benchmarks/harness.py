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

The ideal speedup over the masked scan is B*max_iters/sum(n_i): what an
implementation where finished rows cost nothing would reach.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import pallas_loop
import reference
from benchmarks import blocks


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


def count_distribution(name: str, batch: int, max_iters: int, seed: int = 0) -> np.ndarray:
  """int32 [batch] counts: 'constant', 'uniform' in [1, max], 'bimodal'."""
  rng = np.random.default_rng(seed)
  if name == "constant":
    return np.full(batch, max_iters, np.int32)
  if name == "uniform":
    return rng.integers(1, max_iters + 1, batch).astype(np.int32)
  if name == "bimodal":  # 80% short, 20% at the budget
    short = rng.integers(1, max(2, max_iters // 8) + 1, batch)
    return np.where(rng.random(batch) < 0.8, short, max_iters).astype(np.int32)
  raise ValueError(f"unknown count distribution {name!r}")


@dataclasses.dataclass(frozen=True)
class Case:
  """A workload. With `tol`, rows also halt on convergence (counts = budgets)."""

  block: str
  batch: int
  d: int
  max_iters: int
  counts: str
  dtype: str = "float32"
  tol: float | None = None

  @property
  def label(self) -> str:
    halting = f" tol={self.tol:g}" if self.tol is not None else ""
    return (f"{self.block} B={self.batch} D={self.d} T={self.max_iters} "
            f"{self.counts}{halting} {self.dtype}")


def median_seconds(fn, *args, repeats: int = 5) -> float:
  """Median wall time of `fn(*args)` (already compiled), blocking on results."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def max_error(got, want) -> float:
  return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def tolerance(dtype: str, max_iters: int) -> float:
  """Allowed max |impl - masked_scan|: a few ulps per step of the dtype."""
  return (1e-5 if dtype == "float32" else 2.0 ** -6) * max(1, max_iters) ** 0.5 * 4


def run_case(case: Case, impls, repeats: int, seed: int = 0) -> list[dict]:
  """Times and checks every implementation on one case; one dict per impl."""
  step, params, h0, x = blocks.make(case.block, case.batch, case.d, jnp.dtype(case.dtype),
                                    jax.random.key(seed))
  n = count_distribution(case.counts, case.batch, case.max_iters, seed)
  iters = jnp.asarray(n)
  halting = {} if case.tol is None else dict(tol=case.tol)
  if case.tol is not None:  # the useful work is the steps rows take to converge
    n = np.asarray(reference.iterate(step, params, h0, x, iters=iters, max_iters=case.max_iters,
                                     return_info=True, **halting)[1].steps)
  useful = int(n.sum())
  ideal = case.batch * case.max_iters / max(useful, 1)
  flops = useful * blocks.BLOCKS[case.block].flops_per_row_step(case.d)
  want = None
  results = []
  for name in impls:
    fn = jax.jit(lambda p, h, x_, k, impl=IMPLEMENTATIONS[name]: impl(
        step, p, h, x_, iters=k, max_iters=case.max_iters, **halting))
    out = fn(params, h0, x, iters)
    if want is None:
      assert name == "masked_scan", "the reference runs first"
      want = out
    err = max_error(out, want)
    seconds = median_seconds(fn, params, h0, x, iters, repeats=repeats)
    results.append(dict(case=case.label, impl=name, seconds=seconds, max_error=err,
                        ok=bool(err <= tolerance(case.dtype, case.max_iters)),
                        ideal_speedup=ideal, useful_gflop=flops / 1e9))
  base = {r["impl"]: r["seconds"] for r in results}
  for r in results:
    r["speedup_vs_masked_scan"] = base["masked_scan"] / r["seconds"]
    if "vmap_while" in base:
      r["speedup_vs_vmap_while"] = base["vmap_while"] / r["seconds"]
    r["fraction_of_ideal"] = r["speedup_vs_masked_scan"] / ideal
    r["gflops"] = r["useful_gflop"] / r["seconds"]
  return results


def print_table(results: list[dict]) -> None:
  header = (f"{'case':48s} {'impl':12s} {'median ms':>10s} {'vs scan':>8s} "
            f"{'vs vmapW':>8s} {'ideal':>6s} {'of ideal':>8s} {'GFLOP/s':>8s} {'max err':>9s}")
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['case']:48s} {r['impl']:12s} {r['seconds'] * 1e3:10.3f} "
          f"{r['speedup_vs_masked_scan']:7.2f}x {r.get('speedup_vs_vmap_while', float('nan')):7.2f}x "
          f"{r['ideal_speedup']:5.2f}x {r['fraction_of_ideal']:8.2f} {r['gflops']:8.2f} "
          f"{r['max_error']:9.2e}{'' if r['ok'] else '  MISMATCH'}")
