"""What moving a halting loop's stopped rows out of its way would cost on a TPU: the pieces, timed.

A loop that halts on a tolerance runs each chunk of rows until its slowest
row stops (RESULTS.md, "Where a halting loop's time goes"): at B=4096 the
DEQ's forward computes 2-3x the row-steps it uses. Compaction inside the
group kernel would, every so often, move the rows still running to the front
of the group, so that the step runs only on them. This script times the
pieces such a kernel would need, on one group of G rows held in VMEM (a
float32 [G, 128] state, an int32 [G, 1] column standing for the per-row
columns, and the running flags as an int32 [G, 1] column, as the kernel keeps
them):

  copy          the kernel's own reads and writes (the state and the column
                in and out): what every variant pays
  flags         + the flags made lane-dense (128 rows at a time: broadcast
                to [128, 128] and transposed) and copied to SMEM by a local
                DMA, where the core's scalar unit can read them
  partition     + a scalar loop over the rows swapping each running row with
                the first stopped one (the state's rows, the column's, and a
                permutation in SMEM that records where each row went): a
                branch a row
  scatter       + no branch: each row stored into a second buffer, a running
                row at the front (the next free slot), a stopped one at the
                back (from the end), the slot picked by a scalar select; the
                loop's body unrolled over `UNROLL` rows; the buffer copied
                back
  ranked        each row's slot computed on the vector unit instead (running
                rows: how many running rows precede it; stopped ones: after
                all running rows, in their order), as prefix sums by products
                with a triangle of ones on the matrix unit, copied to SMEM
                with the flags; then the scatter's loop with no dependence
                from one row to the next (`buf[slot[j]] = h[j]`)
  ranked rows   `ranked` with no scalar stored in the loop: only the state's
                and the column's rows move (the column, holding each row's
                index, records where the rows went); the SMEM permutation
                stays the identity

for a share of running rows (`--running`). Each line: variant, running, ms
per application, ns per row of the group, chain, floor_ms; timed inside one
`jit` (`device_timing.chained_seconds`, the floor of a jitted call left out).
Every variant's result is checked against numpy's (`mismatch` on a line
where it is not).

    python -m benchmarks.tpu_compaction [--rows 4096] [--running 0.1,0.4,0.7] [--out c.jsonl]

Off a TPU it runs in Pallas' TPU interpret mode (a check, not a timing).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from benchmarks import device_timing

VARIANTS = ("copy", "flags", "partition", "scatter", "ranked", "ranked rows")
# Rows a trip of the scalar loops handles (their bodies unrolled).
UNROLL = 16
# The loops read row j's flag (or slot) at [j >> 7, j & 127]: with `//` and
# `%` (floor division of a signed index) the ranked rows' body took 227
# bundles for 16 rows compiled for a v5e (libtpu 0.0.42.1), with shifts 83.


def _slots(dense: jax.Array) -> jax.Array:
  """int32 [R, 128]: each row's slot after a stable partition, running rows
  first (row r of the group at [r // 128, r % 128]; `dense` its 0/1 flags).

  Prefix sums as products with triangles of ones (bfloat16 0/1 and counts of
  at most 128 are exact; float32 accumulation is exact below 2**24)."""
  r = dense.shape[0]
  flags = dense.astype(jnp.bfloat16)
  lane_i = lax.broadcasted_iota(jnp.int32, (128, 128), 0)
  lane_j = lax.broadcasted_iota(jnp.int32, (128, 128), 1)
  upper = (lane_i <= lane_j).astype(jnp.bfloat16)  # [128, 128]: i <= j
  within = jnp.dot(flags, upper, preferred_element_type=jnp.float32)  # inclusive, per dense row
  totals = within[:, 127:128]  # [R, 1]
  row_i = lax.broadcasted_iota(jnp.int32, (r, r), 0)
  row_j = lax.broadcasted_iota(jnp.int32, (r, r), 1)
  lower = (row_j < row_i).astype(jnp.bfloat16)  # [R, R]: the rows before
  before = jnp.dot(lower, jnp.broadcast_to(totals, (r, 128)).astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)  # [R, 128], every lane alike
  running_before = (within + before).astype(jnp.int32) - dense  # exclusive
  n_running = jnp.sum(totals).astype(jnp.int32)
  index = (lax.broadcasted_iota(jnp.int32, (r, 128), 0) * 128
           + lax.broadcasted_iota(jnp.int32, (r, 128), 1))
  return jnp.where(dense > 0, running_before, n_running + index - running_before)


def _kernel(h_ref, col_ref, flag_ref, h_out, col_out, perm_out, dense_ref, flags_smem,
            perm_ref, h_buf, col_buf, perm_buf, sem, *, rows: int, variant: str):
  """h_ref, h_out, h_buf: f32 [G, 128]; col_ref, col_out, col_buf, flag_ref:
  i32 [G, 1]; perm_out: SMEM i32 [G] (slot -> the row it holds); dense_ref:
  i32 [G/128, 128] (VMEM); flags_smem: SMEM i32 [G/128, 128]; perm_ref,
  perm_buf: SMEM i32 [G]."""
  h_out[...] = h_ref[...]
  col_out[...] = col_ref[...]

  def identity(i, carry):
    perm_ref[i] = i
    return carry

  lax.fori_loop(0, rows, identity, 0, unroll=UNROLL)
  if variant != "copy":
    # Row r of the group is lane r % 128 of dense row r // 128: a [128, 1]
    # column broadcast along lanes and transposed puts it on lanes.
    for i in range(rows // 128):
      column = flag_ref[pl.ds(i * 128, 128), :].astype(jnp.float32)  # [128, 1]
      wide = jnp.broadcast_to(column, (128, 128))
      dense_ref[pl.ds(i, 1), :] = wide.T[0:1, :].astype(jnp.int32)
    if variant.startswith("ranked"):  # the slots travel to SMEM instead of the flags
      dense_ref[...] = _slots(dense_ref[...])
    copy = pltpu.make_async_copy(dense_ref, flags_smem, sem)
    copy.start()
    copy.wait()
  if variant == "partition":
    def swap(j, k):
      running = flags_smem[j >> 7, j & 127]

      @pl.when(running > 0)
      def _():
        for ref in (h_out, col_out):
          a, b = ref[pl.ds(j, 1), :], ref[pl.ds(k, 1), :]
          ref[pl.ds(k, 1), :] = a
          ref[pl.ds(j, 1), :] = b
        held = perm_ref[j]
        perm_ref[j] = perm_ref[k]
        perm_ref[k] = held

      return k + jnp.where(running > 0, 1, 0)

    lax.fori_loop(0, rows, swap, jnp.int32(0))
  if variant == "scatter":
    def place(j, free):
      front, back = free
      running = flags_smem[j >> 7, j & 127]
      slot = jnp.where(running > 0, front, back)
      h_buf[pl.ds(slot, 1), :] = h_out[pl.ds(j, 1), :]
      col_buf[pl.ds(slot, 1), :] = col_out[pl.ds(j, 1), :]
      perm_buf[slot] = perm_ref[j]
      return front + running, back - 1 + running

    lax.fori_loop(0, rows, place, (jnp.int32(0), jnp.int32(rows - 1)), unroll=UNROLL)
  if variant.startswith("ranked"):
    def put(j, carry):
      slot = flags_smem[j >> 7, j & 127]
      h_buf[pl.ds(slot, 1), :] = h_out[pl.ds(j, 1), :]
      col_buf[pl.ds(slot, 1), :] = col_out[pl.ds(j, 1), :]
      if variant == "ranked":
        perm_buf[slot] = perm_ref[j]
      return carry

    lax.fori_loop(0, rows, put, 0, unroll=UNROLL)
  if variant in ("scatter", "ranked", "ranked rows"):
    h_out[...] = h_buf[...]
    col_out[...] = col_buf[...]
  if variant in ("scatter", "ranked"):
    def back(i, carry):
      perm_ref[i] = perm_buf[i]
      return carry

    lax.fori_loop(0, rows, back, 0, unroll=UNROLL)

  def out(i, carry):
    perm_out[i] = perm_ref[i]
    return carry

  lax.fori_loop(0, rows, out, 0, unroll=UNROLL)


def compact(h: jax.Array, col: jax.Array, flags: jax.Array, *, variant: str,
            interpret=False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(state, column, permutation) after `variant` (`VARIANTS`) on one group.

  Args:
    h: float32 [G, 128], G a multiple of 128.
    col: int32 [G, 1].
    flags: int32 [G, 1], 1 where a row still runs.
    variant: one of `VARIANTS`.
    interpret: Pallas' `interpret=`.

  Returns:
    numpy's `expected`: for "partition", "scatter", "ranked" and "ranked
    rows", (h[perm], col[perm], perm) with the running rows first in their
    order and the stopped ones after ("partition": as its swaps leave them;
    "scatter": last first), perm returned as the identity by "ranked rows"
    (its column records the moves); for "copy" and "flags", (h, col, the
    identity).
  """
  rows = h.shape[0]
  whole = lambda shape: pl.BlockSpec(shape, lambda: (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(_kernel, rows=rows, variant=variant),
      out_shape=(jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(col.shape, col.dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.int32)),
      in_specs=[whole(h.shape), whole(col.shape), whole(flags.shape)],
      out_specs=(whole(h.shape), whole(col.shape), pl.BlockSpec(memory_space=pltpu.SMEM)),
      scratch_shapes=[pltpu.VMEM((rows // 128, 128), jnp.int32),
                      pltpu.SMEM((rows // 128, 128), jnp.int32),
                      pltpu.SMEM((rows,), jnp.int32),
                      pltpu.VMEM(h.shape, h.dtype), pltpu.VMEM(col.shape, col.dtype),
                      pltpu.SMEM((rows,), jnp.int32), pltpu.SemaphoreType.DMA(())],
      interpret=interpret,
      name=f"compaction_{variant}")(h, col, flags)


def expected(h: np.ndarray, col: np.ndarray, flags: np.ndarray, variant: str):
  """numpy's (state, column, permutation) for `compact`."""
  if variant in ("scatter", "ranked", "ranked rows"):  # scatter: the stopped rows last first
    f = flags[:, 0] > 0
    stopped = np.flatnonzero(~f)
    perm = np.concatenate([np.flatnonzero(f), stopped[::-1] if variant == "scatter" else stopped])
    return h[perm], col[perm], perm if variant != "ranked rows" else np.arange(h.shape[0])
  if variant != "partition":
    return h, col, np.arange(h.shape[0])
  perm = np.arange(h.shape[0])
  k = 0
  for j in range(h.shape[0]):
    if flags[j, 0]:
      perm[[j, k]] = perm[[k, j]]
      k += 1
  return h[perm], col[perm], perm


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--running", default="0.1,0.4,0.7")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  write = device_timing.json_lines(args.out)
  on_tpu = jax.default_backend() == "tpu"
  interpret = False if on_tpu else pltpu.InterpretParams()
  rows = args.rows
  h = jnp.arange(rows * 128, dtype=jnp.float32).reshape(rows, 128)
  col = jnp.arange(rows, dtype=jnp.int32)[:, None]
  floor = device_timing.floor_seconds(h, args.repeats) if on_tpu else 0.0
  failed = False
  for share in (float(s) for s in args.running.split(",")):
    flags = (jax.random.uniform(jax.random.key(0), (rows, 1)) < share).astype(jnp.int32)
    for variant in VARIANTS:
      record = {"what": "tpu_compaction", "rows": rows, "running": share, "variant": variant}
      got = jax.jit(functools.partial(compact, variant=variant, interpret=interpret))(
          h, col, flags)
      want = expected(np.asarray(h), np.asarray(col), np.asarray(flags), variant)
      if not all(np.array_equal(np.asarray(a), b) for a, b in zip(got, want)):
        write({**record, "mismatch": True})
        failed = True
        continue
      if not on_tpu:
        write({**record, "checked": True})
        continue
      apply = lambda h_, r, variant=variant: compact(h_, r["col"], r["flags"], variant=variant)[0]
      seconds, chain = device_timing.chained_seconds(apply, h, {"col": col, "flags": flags},
                                                     repeats=args.repeats, floor=floor)
      write({**record, "ms": seconds * 1e3, "ns_per_row": seconds * 1e9 / rows, "chain": chain,
             "floor_ms": floor * 1e3})
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
