"""Timing the device, not the host: many applications inside one `jit`.

A model calls `iterate` inside its own jitted step, so the figure that matters
is what one application costs on the device. One jitted call plus a sync costs
about 0.6 ms of host round trip on the TPU machine, more than the whole loop
at B=4096; timed call by call, every implementation looks alike. So
`chained_seconds` jits one function that applies the implementation `chain`
times in a loop, the state of one application fed as `h0` to the next, each
application on its own inputs (rows rolled, so nothing can be computed once
for all of them: no loop-invariant code), and divides by `chain`. What that leaves in is the call's floor divided by `chain`; the floor
itself (the same jit with a trivial body) is measured by `floor_seconds` and
printed beside the figures.

Per useful row-step: `ns_per_row_step` divides by the row-steps the rows
asked for (sum of the counts), not those an implementation computed, and
`bound_ns_per_row_step` is the matrix unit's bound for the block's
state-dependent products (their FLOPs over the chip's bf16 peak).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Dense bf16 matrix-unit peaks (TFLOP/s) from the vendors' data sheets, by
# device-kind substring: the denominator of the bound.
BF16_PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v6 lite": 918.0,
                    "TPU v6e": 918.0, "TPU v4": 275.0, "H200": 989.0, "H100": 989.0,
                    "A100": 312.0}


# Applications per timed jit call (`chained_seconds`): on an accelerator a
# jitted call's host round trip (~0.6 ms on the TPU v5e) is more than a whole
# loop at B=4096, so many applications share one call; on a CPU the round
# trip is tens of microseconds against milliseconds of work, so two do (the
# chain still grows while a call is under ten floors).
CHAIN = 16
CPU_CHAIN = 2


def default_chain() -> int:
  """`CHAIN` on an accelerator, `CPU_CHAIN` on a CPU."""
  return CPU_CHAIN if jax.default_backend() == "cpu" else CHAIN


def peak_tflops(device_kind: str) -> float | None:
  """The data-sheet bf16 peak of a device kind, or None when unknown.

  Example:
    >>> peak_tflops("TPU v5 lite"), peak_tflops("cpu")
    (197.0, None)
  """
  return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device_kind), None)


def rolled_inputs(per_row: Any, chain: int) -> list[Any]:
  """`chain` versions of a pytree of [B, ...] arrays (and [B] counts), version
  k with its rows rolled by k * B // chain: the same distribution, other rows
  in each place, so no application's inputs equal another's."""
  leaves = jax.tree.leaves(per_row)
  batch = leaves[0].shape[0] if leaves else 1
  return [jax.tree.map(lambda a, k=k: jnp.roll(a, k * batch // max(chain, 1), axis=0),
                       per_row) for k in range(chain)]


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile and warm
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def chained_seconds(apply: Callable[[Any, Any], Any], h0: Any, per_row: Any, *,
                    chain: int = 16, repeats: int = 7, floor: float = 0.0,
                    max_chain: int = 256) -> tuple[float, int]:
  """Median seconds of one application of `apply`, inside one jit.

  The applications run in a `lax.fori_loop` (one compiled body, however long
  the chain), application k reading its own inputs, `rolled_inputs(per_row,
  chain)[k]`: nothing an application computes from its inputs is the same as
  another's, so nothing is computed once for the whole chain. A chain whose
  call takes less than 10 floors is lengthened (up to `max_chain`), so that
  the floor is a small part of what is measured.

  Args:
    apply: apply(h, inputs) -> h (the state's structure, shapes, dtypes).
    h0: the first application's state.
    per_row: the inputs, a pytree of [B, ...] arrays.
    chain: applications per call (at least).
    repeats: timed calls (after one that compiles); the median is taken.
    floor: seconds of a trivial jitted call (`floor_seconds`): its share,
      floor / chain, is subtracted.
    max_chain: the longest chain.

  Returns:
    (seconds per application with the floor's share left out, the chain).
  """
  while True:
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *rolled_inputs(per_row, chain))

    @jax.jit
    def many(h, stacked, chain=chain):
      return lax.fori_loop(0, chain, lambda k, h: apply(h, jax.tree.map(lambda a: a[k], stacked)),
                           h)

    total = _median_seconds(lambda: many(h0, stacked), repeats)
    if total >= 10 * floor or chain >= max_chain:
      return (total - floor) / chain, chain
    chain = min(max_chain, chain * max(2, int(10 * floor / max(total, 1e-9)) + 1))


def folded_gradient(h: Any, g_h: Any, others: Any) -> Any:
  """h with a gradient folded in for the next chained application: `g_h`
  (h's structure) multiplied by 0, which XLA does not simplify away for
  floats, plus one element of every leaf of `others` (the other gradients),
  so that the whole gradient is computed each time while h keeps its value.

  Example:
    >>> folded_gradient(jnp.ones(2), jnp.full(2, 5.0), {"w": jnp.ones((2, 2))}).tolist()
    [1.0, 1.0]
  """
  touch = sum(jnp.ravel(a)[0].astype(jnp.float32) for a in jax.tree.leaves(others))
  return jax.tree.map(lambda a, g: a + (0 * (g.astype(jnp.float32) + touch)).astype(a.dtype),
                      h, g_h)


def floor_seconds(h0: Any, repeats: int = 7) -> float:
  """Seconds of one jitted call with a trivial body plus its sync: the
  host's share that `chained_seconds` divides by the chain length."""
  trivial = jax.jit(lambda h: jax.tree.map(lambda a: a + jnp.ones((), a.dtype), h))
  return _median_seconds(lambda: trivial(h0), repeats)


def ns_per_row_step(seconds: float, counts: np.ndarray) -> float:
  """Nanoseconds per useful row-step: seconds over the sum of the counts."""
  return seconds * 1e9 / max(int(np.sum(counts)), 1)


def bound_ns_per_row_step(flops_per_row_step: float, device_kind: str) -> float | None:
  """The matrix unit's bound: a row-step's state-dependent FLOPs at the
  chip's bf16 peak, in ns (None where the peak is unknown).

  Example:
    >>> round(bound_ns_per_row_step(2 * 128 * 128, "TPU v5 lite"), 3)
    0.166
  """
  peak = peak_tflops(device_kind)
  return None if peak is None else flops_per_row_step / (peak * 1e12) * 1e9


def time_variants(variants: dict, h0: Any, per_row: Any, *, useful: int, floor: float,
                  repeats: int, write: Callable[[dict], None], record: dict,
                  only: Sequence[str] = ()) -> None:
  """Times each variant `apply(h, per_row) -> h` of `variants` (name -> apply)
  with `chained_seconds`, and writes a record for each as it finishes:
  `record` with the variant's name, ms, ns per useful row-step (`useful`
  row-steps an application), chain and floor_ms, or the error a variant
  raised (a variant that fails is a finding, not the end of the run). With
  `only`, just the variants whose name starts with one of its prefixes."""
  for name, fn in variants.items():
    if only and not any(name.startswith(prefix) for prefix in only):
      continue
    rec = {**record, "variant": name}
    try:
      secs, chain = chained_seconds(fn, h0, per_row, repeats=repeats, floor=floor)
      rec.update(ms=secs * 1e3, ns_per_row_step=secs * 1e9 / max(useful, 1), chain=chain,
                 floor_ms=floor * 1e3)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a finding
      rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    write(rec)


def json_lines(path: str | None) -> Callable[[dict], None]:
  """write(record): prints the record as a JSON line, stamped with the date,
  the device kind and the JAX version, and appends it to `path` (if given),
  flushed at once: a device run cut short keeps every line it wrote (the file
  is opened and closed for each line: nothing is left open)."""
  stamp = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
           "jax": jax.__version__}

  def write(record: dict) -> None:
    line = json.dumps({**stamp, **record}, default=float)
    print(line, flush=True)
    if path:
      with open(path, "a") as out:
        out.write(line + "\n")

  return write
