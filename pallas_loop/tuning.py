"""Measure the kernel's tile height on the machine at hand.

The default `block_rows` is a heuristic per backend (`Backend.default_block_rows`
in `_src/kernels/backend_*.py`, `_src/kernels/backend.rows_for_tiles`): enough sorted tiles that
rows of similar counts share a tile. What is fastest also depends on the
block, its widths and the accelerator, so `tune_block_rows` times the
candidates on the caller's own workload, says which won and returns the
`Options` that run it (`TuneResult.options`). It measures; it never changes a
default behind the caller's back.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax

from pallas_loop._src import iterate as iterate_lib
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backends
from pallas_loop._src import options as options_lib
from pallas_loop._src import validation
from pallas_loop._src.options import Options


class TuneResult(NamedTuple):
  """What `tune_block_rows` measured, and the options it recommends.

  Attributes:
    best: the fastest `block_rows`.
    seconds: block_rows -> median seconds of one forward call, for the
      candidates that ran.
    rejected: block_rows -> why the kernel could not run with it (the
      backend's block rules, e.g. Triton's dots need >= 16 rows).
    options: the caller's `Options` with `implementation="pallas"` and
      `block_rows=best`: pass it on, `iterate(..., options=result.options)`.
  """

  best: int
  seconds: dict[int, float]
  rejected: dict[int, str]
  options: Options


def default_candidates(batch: int, platform: str | None = None) -> tuple[int, ...]:
  """Powers of two up to the batch rounded up to one, in the range the
  platform's backend gives (`Backend.tile_candidates`): from 8 to 256 on a
  GPU and in interpret mode, from 128 to 2048 on a TPU (a TPU core runs
  tiles one after another, and tiles under 128 rows were 1.2-2.4x slower
  than the fastest on a v5e; RESULTS.md).

  Args:
    batch: B.
    platform: "tpu", "gpu", "cpu", ...; None: this machine's default backend
      (the one `tune_block_rows` times on). A platform no compiled backend
      serves runs interpret mode.

  Examples:
    >>> from pallas_loop.tuning import default_candidates
    >>> default_candidates(100, "cpu"), default_candidates(5000, "tpu")
    ((8, 16, 32, 64, 128), (128, 256, 512, 1024, 2048))
  """
  platform = platform or jax.default_backend()
  backend = backends.for_device_platform(platform) or backend_lib.INTERPRET
  low, high = backend.tile_candidates
  top = min(high, max(low, backend_lib.next_power_of_2(batch)))
  return tuple(1 << k for k in range(low.bit_length() - 1, top.bit_length()))


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int = 5,
                   warmup: bool = True) -> float:
  """Median wall time of `fn(*args)`, blocking on its results.

  Args:
    fn: a callable (typically jitted) returning arrays.
    *args: its arguments.
    repeats: timed calls (>= 1).
    warmup: make one untimed call first (compilation); False when the
      caller has just made it.

  Returns:
    Seconds.

  Examples:
    >>> import jax
    >>> from pallas_loop.tuning import median_seconds
    >>> median_seconds(jax.jit(lambda a: a + 1), 1.0, repeats=3) > 0
    True
  """
  if warmup:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def tune_block_rows(step: Callable[..., Any], params: Any, h0: Any, x: Any = None, *,
                    iters: Any, max_iters: int, candidates: Sequence[int] | None = None,
                    repeats: int = 5, options: Options | None = None,
                    **iterate_kwargs: Any) -> TuneResult:
  """Times `iterate` with `options.replace(implementation="pallas", block_rows=R)`
  for each candidate R.

  Each candidate is compiled once (`jax.jit`), run once to warm up, then
  timed `repeats` times; the median is kept. Candidates the kernel cannot run
  on this backend are reported in `rejected`, not silently skipped. Only the
  forward pass is timed; outputs do not depend on `block_rows` (tested), so
  any candidate is safe to use; `result.options` holds the fastest.

  Args:
    step: as for `pallas_loop.iterate` (the workload to tune on).
    params: as for `iterate`.
    h0: as for `iterate`.
    x: as for `iterate`.
    iters: as for `iterate`; it should look like the real counts.
    max_iters: as for `iterate`.
    candidates: tile heights to try (default `default_candidates(B)`).
    repeats: timed calls per candidate (>= 1).
    options: the rest of how to run (`interpret`, `sort_rows`, `schedule`,
      ...), a `pallas_loop.Options` (None: `Options()`); its
      `implementation` must be None or "pallas" (the kernel is what is
      timed) and its `block_rows` is what the candidates replace.
    **iterate_kwargs: further `iterate` keywords (tol, halt, key, ...).

  Returns:
    A `TuneResult`.

  Raises:
    ValueError: bad `candidates`/`repeats`, `options.implementation="xla"`,
      or no candidate could run (with each reason).
    TypeError: a how-to-run keyword (`interpret=`, `block_rows=`, ...)
      passed by itself instead of in `options`.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> from pallas_loop.tuning import tune_block_rows
    >>> step = lambda p, h, x: jnp.tanh(h @ p)
    >>> r = tune_block_rows(step, jnp.eye(8), jnp.ones((64, 8)), max_iters=4,
    ...                     iters=jnp.arange(64) % 5, candidates=(8, 16),
    ...                     options=pallas_loop.Options(interpret=True))
    >>> r.best in (8, 16), r.options.block_rows == r.best
    (True, True)
    >>> r.options.implementation, r.options.interpret
    ('pallas', True)
  """
  options_lib.reject_keywords(
      "tune_block_rows",
      {k: v for k, v in iterate_kwargs.items() if k in options_lib.FIELDS})
  options = options_lib.check_options(options)
  if options.implementation == "xla":
    raise ValueError("tune_block_rows times the Pallas kernel: options.implementation "
                     "must be None or 'pallas', got 'xla'.")
  options = options.replace(implementation="pallas")
  if not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
  batch = validation.batch_size(h0, x)
  candidates = default_candidates(batch) if candidates is None else tuple(candidates)
  if not candidates or any(not isinstance(c, int) or c < 1 for c in candidates):
    raise ValueError(f"candidates must be positive ints, got {candidates!r}")
  seconds, rejected = {}, {}
  for rows in candidates:
    fn = jax.jit(lambda p, h, x_, n, rows=rows: iterate_lib.iterate(
        step, p, h, x_, iters=n, max_iters=max_iters,
        options=options.replace(block_rows=rows), **iterate_kwargs))
    try:
      jax.block_until_ready(fn(params, h0, x, iters))  # compiles
    except ValueError as e:  # the kernel's block rules for this backend
      rejected[rows] = str(e)
      continue
    seconds[rows] = median_seconds(fn, params, h0, x, iters, repeats=repeats, warmup=False)
  if not seconds:
    reasons = "\n".join(f"  block_rows={r}: {why}" for r, why in rejected.items())
    raise ValueError(f"no block_rows candidate could run:\n{reasons}")
  best = min(seconds, key=lambda r: seconds[r])
  return TuneResult(best=best, seconds=seconds, rejected=rejected,
                    options=options.replace(block_rows=best))
