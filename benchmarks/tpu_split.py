"""Where the TPU forward's time goes: the loop, the row permutation around it.

The group kernel runs rows in count order; with ragged counts XLA sorts the
rows into that order before the kernel and back after it. This script times,
for the tanh RNN (D=128, bfloat16; `--block` another) inside one `jit` as `gpu_check` does
(`device_timing.chained_seconds`, the floor left out), per application:

  masked_scan   the baseline (every row pays every step)
  whole         `iterate`'s forward, rows in a random order
  sorted        the same rows already in count order, traced as known in
                order (`validation.same_count_every_row` patched true for
                every `sorted` variant, the path one count takes): no row
                sorted or moved, so this is the loop and the kernel's own
                reads and writes
  permutation   the permutation alone: `tiling.in_tiles` with the group
                kernel's flags and row moves around a loop that does nothing
  whole, XLA's row gathers  the forward with its rows moved by XLA's
                gathers and put back by the inverse permutation's
                (`kernel_tpu_rows.KERNELS` False: before those kernels;
                `grad whole, XLA's row gathers` with `--grad`)
  whole, row kernels without the order's view  the row kernels reading each
                row's index at its own offset, 64 rows a loop body
                (`kernel_tpu_rows.SMEM_VIEW` False: before the view)
  sorted G=.., C=..  the sorted forward with the group kernel's groups per
                batch (`GROUPS`) or chunk (`LARGEST_CHUNK`) changed
  whole/sorted C=..  (`--chunks`) the forward at other chunk heights
                (`Options(block_rows=C)`)
  whole/sorted no pieces  (`--pieces`) the partial chunk always at the
                chunk's height (`kernel_tpu_groups.SMALLEST_PIECE` out of reach)
  parts: ...    (`--parts`) pieces of the work around the loop, each alone:
                the sort, the inverse permutation by a sort and by a
                scatter, the active-rows table by `searchsorted` and by
                comparing every count with every step, a rank by counting
                (`counting_rank`) with and without the table from a
                histogram (each with only the counts in its chain); and the forward
                (whole, sorted) with the table searched
                (`kernel_tpu_groups.COMPARE_ALL_LIMIT` 0), and the batch as one
                slab (`kernel_tpu_groups.SLABS_FROM_BYTES` out of reach: one
                permutation of every row, however many bytes they take); the
                inverse permutation by a scatter told its indices are unique, and
                the forward with its rows put back by such a scatter (no inverse)
  whole, one count  constant counts given as `iters=T` (`whole`: the [B]
                array): nothing sorted, known at trace time

With `--grad`: `jax.grad` of the output's sum w.r.t. (params, h0), as
`gpu_check` times it (`harness._make_fn`: constant counts as `iters=T`; the
[B] array too, `grad whole, counts as an array`), for the masked scan, `whole` and
`sorted` (both the forward's and the backward's permutations skipped): the
difference is what the two permutations cost a training step.

    python -m benchmarks.tpu_split [--out split.jsonl] [--batches 32768,4096]

Each line: case, variant, ms, ns per useful row-step, chain, floor_ms. With
sorted counts every application sees the same counts; they pass through a
`minimum` with the loop index, so nothing about them is loop-invariant.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import blocks
from benchmarks import cases
from benchmarks import device_timing
from benchmarks import harness
from benchmarks import tpu_design


def _added(h, v):
  """h (a pytree of [B, ...] leaves) with v (a scalar or [B]) added to every
  leaf, so that v is computed."""
  v = jnp.asarray(v)
  return jax.tree.map(
      lambda a: a + v.reshape(v.shape + (1,) * (a.ndim - v.ndim)).astype(a.dtype), h)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None)
  parser.add_argument("--batches", default="32768,4096")
  parser.add_argument("--block", default="tanh_rnn",
                      help="a block of benchmarks.blocks (the tanh RNN by default)")
  parser.add_argument("--counts", default="uniform,recurrent_depth,constant")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--variants", action="store_true",
                      help="also the sorted forward with other groups and chunks")
  parser.add_argument("--chunks", default="",
                      help="comma-separated chunk heights: the forward at each (whole and sorted)")
  parser.add_argument("--pieces", action="store_true",
                      help="also the forward with the partial chunk always at the chunk's height")
  parser.add_argument("--parts", action="store_true",
                      help="also the pieces of the work around the loop, each alone")
  parser.add_argument("--grad", action="store_true",
                      help="time jax.grad (masked scan, whole, sorted) instead of the forward")
  parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                      help="time only the variants whose name starts with this (repeatable)")
  args = parser.parse_args(argv)
  write = device_timing.json_lines(args.out)

  import pallas_loop  # pylint: disable=g-import-not-at-top
  from pallas_loop._src import tiling  # pylint: disable=g-import-not-at-top
  from pallas_loop._src import validation  # pylint: disable=g-import-not-at-top
  from pallas_loop._src.kernels import kernel_tpu_groups  # pylint: disable=g-import-not-at-top
  from pallas_loop._src.kernels import kernel_tpu_rows  # pylint: disable=g-import-not-at-top

  for batch in (int(b) for b in args.batches.split(",")):
    for dist in args.counts.split(","):
      case = cases._case(args.block, batch, 128, dist, dtype="bfloat16")  # pylint: disable=protected-access
      step, params, h0, x = blocks.make(case.block, batch, 128, jnp.bfloat16, jax.random.key(0))
      counts = cases.count_distribution(dist, batch, case.max_iters, 0)
      order = np.argsort(-counts, kind="stable")
      sorted_counts = jnp.asarray(counts[order])
      useful = int(counts.sum())
      floor = device_timing.floor_seconds(h0, args.repeats)
      masked = harness._make_fn(case, "masked_scan", step, {})  # pylint: disable=protected-access
      pallas = lambda p, h, x_, k: pallas_loop.iterate(step, p, h, x_, iters=k,
                                                       max_iters=case.max_iters)
      inputs = {"x": x, "iters": jnp.asarray(counts), "ramp": jnp.arange(batch, dtype=jnp.int32)}

      def sorted_iters(r):
        # The sorted counts, not loop-invariant (ramp[0] differs per application, >= 0).
        return jnp.minimum(sorted_counts, case.max_iters + r["ramp"][0])

      def in_order(fn):
        # fn traced with its counts known in order, as for one count: the
        # kernels sort and move no row (the rows given are in order).
        return lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
            validation, {"same_count_every_row": lambda iters: True}, fn, h, r)

      def permutation(h, r):  # as the group forward moves its rows (`kernel_tpu_groups.run`)
        run = lambda per_row, c: (per_row[0], None)
        return tiling.in_tiles(run, (h, r["x"], None), r["iters"], rows=batch, sort=True,
                               must_be_finite=False, invert_by_sort=True,
                               # Interpreted off the chip (this diagnostic's CPU test).
                               moves=kernel_tpu_rows.moves(
                                   jax.default_backend() != "tpu"))[0]

      if args.grad:
        gcase = cases._case(args.block, batch, 128, dist, dtype="bfloat16", grad="full")  # pylint: disable=protected-access
        grads = {n: harness._chained(gcase, harness._make_fn(gcase, n, step, {}), params)  # pylint: disable=protected-access
                 for n in ("masked_scan", "pallas")}
        variants = {
            "grad masked_scan": grads["masked_scan"],
            "grad whole": grads["pallas"],
            "grad sorted": in_order(lambda h, r: grads["pallas"](h, dict(r, iters=sorted_iters(r)))),
        }
        # The rows moved by XLA's gathers (before `kernel_tpu_rows`).
        variants["grad whole, XLA's row gathers"] = lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
            kernel_tpu_rows, {"KERNELS": False}, grads["pallas"], h, r)
        if dist == "constant":  # `grad whole` is given iters=T: nothing to sort
          del variants["grad sorted"], variants["grad whole, XLA's row gathers"]
        if args.pieces:
          variants["grad whole no pieces"] = lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
              kernel_tpu_groups, {"SMALLEST_PIECE": 1 << 30}, grads["pallas"], h, r)
        # The [B] counts as given (`grad whole` gets iters=T for constant counts).
        grad_array = grads["pallas"]
        if dist == "constant":
          grad_array = variants["grad whole, counts as an array"] = harness._chained(  # pylint: disable=protected-access
              gcase, harness._make_fn(gcase, "pallas", step, {}, one_count=False), params)  # pylint: disable=protected-access
        if args.parts:
          variants["grad whole, active rows searched"] = lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
              kernel_tpu_groups, {"COMPARE_ALL_LIMIT": 0}, grad_array, h, r)
          # A batch of slabs as one slab, forward and backward.
          variants["grad whole, one slab"] = lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
              kernel_tpu_groups, {"SLABS_FROM_BYTES": 1 << 62}, grad_array, h, r)
        _time(variants, case, h0, inputs, useful, floor, args.repeats, write, args.only)
        continue
      variants = {
          "masked_scan": lambda h, r: masked(params, h, r["x"], r["iters"]),
          # Every row T steps, written as one count (the forward's `whole`
          # gets the [B] counts).
          **({"whole, one count": lambda h, r: pallas(params, h, r["x"], case.max_iters)}
             if dist == "constant" else {}),
          "whole": lambda h, r: pallas(params, h, r["x"], r["iters"]),
          "sorted": in_order(lambda h, r: pallas(params, h, r["x"], sorted_iters(r))),
          "permutation": permutation,
          # The rows moved by XLA's gathers, put back by the inverse
          # permutation's (before `kernel_tpu_rows`).
          "whole, XLA's row gathers": lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
              kernel_tpu_rows, {"KERNELS": False}, pallas, params, h, r["x"], r["iters"]),
          # The row kernels as before `SMEM_VIEW` (each row's index read at
          # its own offset, 64 rows a loop body).
          "whole, row kernels without the order's view": lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
              kernel_tpu_rows, {"SMEM_VIEW": False, "GATHER_ROWS_A_TRIP": 64,
                                "SCATTER_ROWS_A_TRIP": 64}, pallas, params, h, r["x"], r["iters"]),
      }
      if args.variants and dist == "uniform":
        # The sort that orders the rows: JAX's two-operand sort (the library's
        # today) against one int32 key (count and row index packed).
        iota = jnp.arange(batch, dtype=jnp.int32)
        bits = int(np.ceil(np.log2(batch)))

        def sort_pairs(h, r):
          _, o = jax.lax.sort((-r["iters"], iota), num_keys=1)
          return _added(h, o)

        def sort_packed(h, r):
          key = jax.lax.sort(((case.max_iters - r["iters"]) << bits) | iota)
          return _added(h, key & ((1 << bits) - 1))

        variants["sort pairs"] = sort_pairs
        variants["sort packed"] = sort_packed
      for chunk in (int(c) for c in args.chunks.split(",") if c):
        opts = pallas_loop.Options(block_rows=chunk)
        run_at = (lambda p, h, x_, k, opts=opts: pallas_loop.iterate(
            step, p, h, x_, iters=k, max_iters=case.max_iters, options=opts))
        variants[f"whole C={chunk}"] = (lambda h, r, f=run_at: f(params, h, r["x"], r["iters"]))
        variants[f"sorted C={chunk}"] = in_order(lambda h, r, f=run_at: f(params, h, r["x"],
                                                                         sorted_iters(r)))
      if args.parts:
        # The pieces alone read only the counts: their chains do not carry
        # the inputs (a chain of 256 stacked copies of x is 2 GiB at B=32768).
        counts_only = {k: inputs[k] for k in ("iters", "ramp")}
        _time(_parts(batch, case.max_iters), case, h0, counts_only, useful, floor,
              args.repeats, write, args.only)
        # A batch of slabs as one slab (before the slabs): one permutation
        # of every row.
        variants["whole, one slab"] = ({"SLABS_FROM_BYTES": 1 << 62}, False)
        # The rows put back by a scatter told its indices are unique, with no
        # inverse permutation (the library: a sort for the inverse, a gather).
        variants["whole, put back by unique scatter"] = (
            lambda h, r: tpu_design._traced_with(  # pylint: disable=protected-access
                kernel_tpu_rows, {"moves": _scattered_back}, pallas, params, h, r["x"],
                r["iters"]))
        # The forward with the active-rows table searched (before it compared).
        variants["whole, active rows searched"] = ({"COMPARE_ALL_LIMIT": 0}, False)
        variants["sorted, active rows searched"] = ({"COMPARE_ALL_LIMIT": 0}, True)
      if args.pieces:
        variants["whole no pieces"] = ({"SMALLEST_PIECE": 1 << 30}, False)
        variants["sorted no pieces"] = ({"SMALLEST_PIECE": 1 << 30}, True)
      if args.variants:
        for groups in (1, 2, 8):
          variants[f"sorted G={groups}"] = ({"GROUPS": groups}, True)
        for chunk in (1024,):
          variants[f"sorted C={chunk}"] = ({"LARGEST_CHUNK": chunk}, True)
      for name, fn in variants.items():
        if isinstance(fn, tuple):  # the group kernel's constants patched while traced
          values, given_sorted = fn
          patched = (lambda h, r, values=values, given_sorted=given_sorted: tpu_design._traced_with(  # pylint: disable=protected-access
              kernel_tpu_groups, values, pallas, params, h, r["x"],
              sorted_iters(r) if given_sorted else r["iters"]))
          variants[name] = in_order(patched) if given_sorted else patched
      _time(variants, case, h0, inputs, useful, floor, args.repeats, write, args.only)
  return 0


def _scattered_back(interpret):
  """`kernel_tpu_rows.moves` for a `--parts` variant: the rows moved into
  count order by XLA's gather and put back by XLA's scatter told its indices
  are unique (a permutation's), with no inverse permutation (the library
  before `kernel_tpu_rows`: the inverse's sort and a gather)."""
  from pallas_loop._src import tiling  # pylint: disable=g-import-not-at-top
  del interpret

  def put_back(tree, order):
    return jax.tree.map(lambda a: jnp.zeros_like(a).at[order].set(a, unique_indices=True),
                        tree)

  return tiling.RowMoves(tiling.take_rows, put_back)


def counting_rank(counts: jax.Array, max_iters: int) -> jax.Array:
  """int32 [B]: each row's place in descending count order (stable), without
  a sort: the inverse of `tiling.sorted_descending`'s order. One-hot counts;
  the rows of the same count before a row within its 128-row block by one
  product with a strictly lower triangle, those of earlier blocks and of
  larger counts by cumulative sums of the histograms. B a multiple of 128.

  Example:
    >>> counting_rank(jnp.array([1, 3, 2, 3] * 32), 3)[:4]
    Array([96,  0, 64,  1], dtype=int32)
  """
  batch = counts.shape[0]
  span = max_iters + 1
  onehot = (counts[:, None] == jnp.arange(span)[None, :]).astype(jnp.bfloat16)
  blocks_ = onehot.reshape(batch // 128, 128, span)
  lower = jnp.tri(128, k=-1, dtype=jnp.bfloat16)
  within = jnp.einsum("ij,bjt->bit", lower, blocks_, preferred_element_type=jnp.float32)
  per_block = jnp.sum(blocks_.astype(jnp.float32), axis=1)
  earlier = jnp.cumsum(per_block, axis=0) - per_block
  hist = jnp.sum(per_block, axis=0)
  larger = jnp.cumsum(hist[::-1])[::-1] - hist
  place = within + earlier[:, None, :] + larger[None, None, :]
  return jnp.sum(blocks_.astype(jnp.float32) * place, axis=2).reshape(batch).astype(jnp.int32)


def _parts(batch: int, max_iters: int) -> dict:
  """apply(h, inputs) -> h for each piece of the work around the loop alone
  (its result folded into h, so that it is computed)."""
  from pallas_loop._src import tiling  # pylint: disable=g-import-not-at-top
  from pallas_loop._src.kernels import kernel_tpu_groups  # pylint: disable=g-import-not-at-top
  # Folded into h by a comparison XLA cannot decide (x * 0 it folds away, and
  # the piece with it), so each piece is computed; the counts are an
  # application's own (rolled), so no piece is computed once for the chain.
  fold = lambda h, v: _added(h, jnp.sum(v) == jnp.iinfo(jnp.int32).min)
  groups = max(1, batch // 8192)

  def sort(h, r):
    counts, order = tiling.sorted_descending(r["iters"])
    return fold(h, counts + order)

  def inverse(by_sort):
    def run(h, r):
      _, order = tiling.sorted_descending(r["iters"])
      return fold(h, tiling.inverse_permutation(order, by_sort=by_sort))
    return run

  def active(compare_all):
    def run(h, r):
      counts, _ = tiling.sorted_descending(r["iters"])
      with tpu_design.patched(kernel_tpu_groups,
                              COMPARE_ALL_LIMIT=1 << 62 if compare_all else 0):
        table = kernel_tpu_groups.active_rows(counts, groups, max_iters)
      return fold(h, table)
    return run

  def inverse_unique(h, r):
    # A scatter told its indices are unique (a permutation's are): XLA need
    # not order colliding writes.
    _, order = tiling.sorted_descending(r["iters"])
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(batch, dtype=order.dtype),
                                              unique_indices=True)
    return fold(h, inv)

  def rank_by_counting(h, r):
    return fold(h, counting_rank(r["iters"], max_iters))

  def rank_and_active_by_counting(h, r):
    # The active-rows table of one group from the same histogram: the rows
    # with a count above t.
    rank = counting_rank(r["iters"], max_iters)
    hist = jnp.zeros((max_iters + 1,), jnp.int32).at[r["iters"]].add(1)
    active = jnp.cumsum(hist[::-1])[::-1][1:]
    return fold(fold(h, rank), active)

  return {"parts: sort": sort, "parts: rank by counting": rank_by_counting,
          "parts: rank and active rows by counting": rank_and_active_by_counting,
          "parts: inverse by sort": inverse(True),
          "parts: inverse by scatter": inverse(False),
          "parts: inverse by unique scatter": inverse_unique,
          "parts: sort + active_rows (searchsorted)": active(False),
          "parts: sort + active_rows (compare all)": active(True)}


def _time(variants, case, h0, inputs, useful, floor, repeats, write, only=()) -> None:
  """Times each variant (apply(h, inputs) -> h), a JSON line each; with
  `only`, those whose name starts with one of its prefixes."""
  device_timing.time_variants(variants, h0, inputs, useful=useful, floor=floor,
                              repeats=repeats, write=write, only=only,
                              record={"what": "split", "case": case.label})


if __name__ == "__main__":
  sys.exit(main())
