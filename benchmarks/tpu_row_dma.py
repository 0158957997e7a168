"""Can a TPU kernel move rows into count order itself? Per-row DMAs and vector loads against XLA's gather.

The group kernel's rows travel into count order by an XLA gather before it
and back by another after it (about 0.09 ms each at B=32768, D=128 on a v5e,
RESULTS.md "The row permutation"), more than a quarter of the loop's own time
with ragged counts. A kernel can instead start one DMA per row, reading row
`order[r]` of the caller's array from HBM into row r of its VMEM block (a
gather), or writing row r of its block to row `order[r]` in HBM (a scatter).
Whether that pays depends on how fast the core issues the DMAs: this script
measures it, beside XLA's gather of the same array, each chained inside one
`jit` (`device_timing.chained_seconds`), the jitted call's floor left out.
A kernel whose rows are already in VMEM can also move them with vector
loads and stores, one sublane a row, addressed by a scalar from SMEM (no DMA
issued): the `vld_*` variants measure that.

    python -m benchmarks.tpu_row_dma [--out rows.jsonl] [--batch 32768]

Variants (each row a JSON line: what, variant, dtype, group, ms, ns_per_row):
  xla_gather          `jnp.take(x, order, axis=0)`
  xla_scatter         `zeros.at[order].set(x)`
  block_copy          the kernel's pipeline reading and writing its blocks in
                      order (no permutation: what any row-blocked kernel pays)
  dma_gather/wait=all one DMA a row HBM -> VMEM block, one wait for the block
  dma_gather/wait=row the same, one wait a row
  dma_scatter         one DMA a row VMEM block -> HBM (output in HBM), one wait
  vld_gather/rows     the whole [B, D] array in VMEM; out[r] = x[order[r]] by a
                      one-row load and a one-row store a row
  vld_gather/tile     the same, eight loaded rows joined into one (8, D) store
  vld_scatter         out[order[r]] = x[r], the output whole in VMEM, a
                      one-row load and a one-row store a row
Rows are float32 [B, 128] (512 B), uint32 [B, 64] (a bfloat16 row's pairs as
words) and bfloat16 [B, 128] (two rows to a sublane: may not lower).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from benchmarks import device_timing


def _order_spec(group: int) -> pl.BlockSpec:
  # int32 [G]: this program's slice of the order, in SMEM (scalars the DMAs index by).
  return pl.BlockSpec((group,), lambda g: (g,), memory_space=pltpu.SMEM)


def dma_gather(x: jax.Array, order: jax.Array, *, group: int, wait: str = "all",
               unroll: int = 8) -> jax.Array:
  """out[r] = x[order[r]], by one DMA a row inside a Pallas TPU kernel.

  Args:
    x: [B, D] in HBM (never blocked: the kernel reads its rows itself).
    order: int32 [B], a permutation of range(B).
    group: rows a program gathers (B a multiple of it).
    wait: "all" (one wait sized as the whole block: the semaphore counts
      bytes) or "row" (one wait a row).
    unroll: the issuing loop's unroll.
  """
  batch, width = x.shape

  def kernel(order_ref, x_hbm, out_ref, sem):
    # order_ref: SMEM int32 [G]; x_hbm: [B, D] (HBM); out_ref: VMEM [G, D]
    def start(r, carry):
      pltpu.make_async_copy(x_hbm.at[pl.ds(order_ref[r], 1)], out_ref.at[pl.ds(r, 1)],
                            sem).start()
      return carry

    lax.fori_loop(0, group, start, 0, unroll=unroll)
    if wait == "all":
      pltpu.make_async_copy(x_hbm.at[pl.ds(0, group)], out_ref, sem).wait()
    else:
      def done(r, carry):
        pltpu.make_async_copy(x_hbm.at[pl.ds(0, 1)], out_ref.at[pl.ds(r, 1)], sem).wait()
        return carry
      lax.fori_loop(0, group, done, 0, unroll=unroll)

  return pl.pallas_call(
      kernel, grid=(batch // group,),
      in_specs=[_order_spec(group), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((group, width), lambda g: (g, 0)),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_shapes=[pltpu.SemaphoreType.DMA],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
  )(order, x)


def dma_scatter(x: jax.Array, order: jax.Array, *, group: int, unroll: int = 8) -> jax.Array:
  """out[order[r]] = x[r], by one DMA a row from the kernel's VMEM block to HBM."""
  batch, width = x.shape

  def kernel(order_ref, x_ref, out_hbm, sem):
    # order_ref: SMEM int32 [G]; x_ref: VMEM [G, D]; out_hbm: [B, D] (HBM)
    def start(r, carry):
      pltpu.make_async_copy(x_ref.at[pl.ds(r, 1)], out_hbm.at[pl.ds(order_ref[r], 1)],
                            sem).start()
      return carry

    lax.fori_loop(0, group, start, 0, unroll=unroll)
    pltpu.make_async_copy(x_ref, out_hbm.at[pl.ds(0, group)], sem).wait()

  return pl.pallas_call(
      kernel, grid=(batch // group,),
      in_specs=[_order_spec(group), pl.BlockSpec((group, width), lambda g: (g, 0))],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_shapes=[pltpu.SemaphoreType.DMA],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
  )(order, x)


def _whole(batch: int, width: int) -> pl.BlockSpec:
  # The whole [B, D] array, one block every program sees (VMEM-resident).
  return pl.BlockSpec((batch, width), lambda g: (0, 0))


def _vmem_params(x: jax.Array, group: int) -> pltpu.CompilerParams:
  # The whole array double-buffered, the row blocks double-buffered, headroom.
  whole = x.size * x.dtype.itemsize
  need = 2 * whole + 4 * group * x.shape[1] * x.dtype.itemsize + (8 << 20)
  return pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                              vmem_limit_bytes=min(need, 120 << 20))


def vld_gather(x: jax.Array, order: jax.Array, *, group: int, tile: bool,
               unroll: int = 8) -> jax.Array:
  """out[r] = x[order[r]] by vector loads from the whole array in VMEM.

  Args:
    x: [B, D] (read whole into VMEM by the pipeline once).
    order: int32 [B], a permutation of range(B).
    group: rows a program writes (B a multiple of it, and of 8).
    tile: join eight loaded rows into one (8, D) store (else a one-row
      store a row).
    unroll: the loop's unroll (in groups of eight rows).
  """
  batch, width = x.shape

  def kernel(order_ref, x_ref, out_ref):
    # order_ref: SMEM int32 [G]; x_ref: VMEM [B, D] (whole); out_ref: VMEM [G, D]
    def eight(i, carry):
      base = pl.multiple_of(i * 8, 8)
      rows = [x_ref[pl.ds(order_ref[base + u], 1), :] for u in range(8)]
      if tile:
        out_ref[pl.ds(base, 8), :] = jnp.concatenate(rows, axis=0)
      else:
        for u, row in enumerate(rows):
          out_ref[pl.ds(base + u, 1), :] = row
      return carry

    lax.fori_loop(0, group // 8, eight, 0, unroll=unroll)

  return pl.pallas_call(
      kernel, grid=(batch // group,),
      in_specs=[_order_spec(group), _whole(batch, width)],
      out_specs=pl.BlockSpec((group, width), lambda g: (g, 0)),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=_vmem_params(x, group),
  )(order, x)


def vld_scatter(x: jax.Array, order: jax.Array, *, group: int, unroll: int = 8) -> jax.Array:
  """out[order[r]] = x[r] by vector stores into the whole output in VMEM
  (written back to HBM once, after the last program)."""
  batch, width = x.shape

  def kernel(order_ref, x_ref, out_ref):
    # order_ref: SMEM int32 [G]; x_ref: VMEM [G, D]; out_ref: VMEM [B, D] (whole)
    def eight(i, carry):
      base = pl.multiple_of(i * 8, 8)
      block = x_ref[pl.ds(base, 8), :]
      for u in range(8):
        out_ref[pl.ds(order_ref[base + u], 1), :] = block[u:u + 1]
      return carry

    lax.fori_loop(0, group // 8, eight, 0, unroll=unroll)

  return pl.pallas_call(
      kernel, grid=(batch // group,),
      in_specs=[_order_spec(group), pl.BlockSpec((group, width), lambda g: (g, 0))],
      out_specs=_whole(batch, width),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=_vmem_params(x, group),
  )(order, x)


def block_copy(x: jax.Array, *, group: int) -> jax.Array:
  """out = x through a row-blocked kernel (the pipeline's own DMAs only)."""
  batch, width = x.shape

  def kernel(x_ref, out_ref):
    out_ref[...] = x_ref[...]

  return pl.pallas_call(
      kernel, grid=(batch // group,),
      in_specs=[pl.BlockSpec((group, width), lambda g: (g, 0))],
      out_specs=pl.BlockSpec((group, width), lambda g: (g, 0)),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
  )(x)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="append JSON lines here too")
  parser.add_argument("--batch", type=int, default=32768)
  parser.add_argument("--groups", default="2048,8192")
  parser.add_argument("--chain", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                      help="the variants whose name starts with PREFIX (repeatable)")
  parser.add_argument("--dtypes", default="float32,uint32,bfloat16")
  parser.add_argument("--check-only", action="store_true",
                      help="check each variant's result once, time nothing")
  args = parser.parse_args(argv)
  write = device_timing.json_lines(args.out)

  batch = args.batch
  order = jax.random.permutation(jax.random.key(0), batch).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)
  base = jax.random.normal(jax.random.key(1), (batch, 128), jnp.float32)
  arrays = {
      "float32": base,
      "uint32": lax.bitcast_convert_type(base.astype(jnp.bfloat16).reshape(batch, 64, 2),
                                         jnp.uint32),
      "bfloat16": base.astype(jnp.bfloat16),
  }
  groups = [int(g) for g in args.groups.split(",")]
  variants = {"xla_gather": lambda h, o, g: jnp.take(h, o, axis=0),
              "xla_scatter": lambda h, o, g: jnp.zeros_like(h).at[o].set(h),
              "block_copy": lambda h, o, g: block_copy(h, group=g)}
  variants["dma_gather/wait=all"] = lambda h, o, g: dma_gather(h, o, group=g, wait="all")
  variants["dma_gather/wait=row"] = lambda h, o, g: dma_gather(h, o, group=g, wait="row")
  variants["dma_scatter"] = lambda h, o, g: dma_scatter(h, o, group=g)
  variants["vld_gather/rows"] = lambda h, o, g: vld_gather(h, o, group=g, tile=False)
  variants["vld_gather/tile"] = lambda h, o, g: vld_gather(h, o, group=g, tile=True)
  variants["vld_scatter"] = lambda h, o, g: vld_scatter(h, o, group=g)
  if args.only:
    variants = {k: v for k, v in variants.items() if k.startswith(tuple(args.only))}
  expected = {"xla_gather": "gather", "dma_gather/wait=all": "gather",
              "dma_gather/wait=row": "gather", "xla_scatter": "scatter",
              "dma_scatter": "scatter", "block_copy": "copy",
              "vld_gather/rows": "gather", "vld_gather/tile": "gather", "vld_scatter": "scatter"}
  for dtype, x in arrays.items():
    if dtype not in args.dtypes.split(","):
      continue
    floor = device_timing.floor_seconds(x, args.repeats)
    want = {"gather": np.asarray(jnp.take(x, order, axis=0)),
            "scatter": np.asarray(jnp.take(x, inverse, axis=0)), "copy": np.asarray(x)}
    for name, fn in variants.items():
      for g in (groups if name.startswith(("dma", "block", "vld")) else [0]):
        rec = {"what": "row_dma", "variant": name, "dtype": dtype, "batch": batch, "group": g}
        try:
          t0 = time.perf_counter()
          got = np.asarray(jax.jit(functools.partial(fn, g=g))(x, order))
          rec["compile_and_run_s"] = round(time.perf_counter() - t0, 2)
          rec["exact"] = bool(np.array_equal(got, want[expected[name]]))
          if not args.check_only:
            secs, chain = device_timing.chained_seconds(
                lambda h, o, fn=fn, g=g: fn(h, o, g), x, order, chain=args.chain,
                repeats=args.repeats, floor=floor)
            rec.update(ms=secs * 1e3, ns_per_row=secs * 1e9 / batch, chain=chain,
                       floor_ms=floor * 1e3)
        except Exception as e:  # noqa: BLE001 - a variant that does not lower is a finding
          rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        write(rec)
  return 0


if __name__ == "__main__":
  sys.exit(main())
