"""Loop designs for the TPU, measured on single-purpose kernels.

Before the library's Mosaic kernel was redesigned, these prototypes (the tanh
RNN `h <- tanh(h W + xU)` only, forward only, `xU = x U + b` computed before
the kernel, rows already sorted by descending count) measured which loop the
chip wants, inside one `jit` (`device_timing.chained_seconds`):

  step_outer  the whole batch's state and xU in VMEM for the call; one loop
              over steps; at step t only the leading `active[t]` rows (a
              scalar-prefetched table: sorted rows make the running rows a
              prefix) are computed, in chunks of C rows; only the last,
              partial chunk is masked (or every chunk, `mask="all"`).
  tile_outer  a grid of TB-row tiles, each looping to its own largest count
              (the library's design until then), masked by `row < active`.

and, at B=32768, what the row permutation around the loop costs piece by
piece. `python -m benchmarks.tpu_design --out FILE` writes one JSON line per
measurement as it goes (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from benchmarks import cases
from benchmarks import device_timing

D = 128
# On a CPU (`--smoke`) the prototypes run in Pallas' TPU interpret mode.
INTERPRET = pltpu.InterpretParams() if jax.default_backend() == "cpu" else False


def active_table(sorted_counts: np.ndarray, trips: int) -> np.ndarray:
  """int32 [trips]: how many rows (a prefix, rows sorted by descending count)
  still run at step t."""
  return np.array([(sorted_counts > t).sum() for t in range(trips)], np.int32)


def step_outer(h0, xu, w, active, *, chunk: int, mask: str = "partial", pair: bool = False,
               vmem_mb: int = 100):
  """The step-outer prototype. h0 bf16 [B, D], xu [B, D] (f32 or bf16),
  w bf16 [D, D], active int32 [T]; B a multiple of `chunk`."""
  batch = h0.shape[0]
  trips = active.shape[0]

  def kernel(active_ref, h0_ref, xu_ref, w_ref, out_ref):
    # active_ref: SMEM int32 [T]; h0_ref, out_ref: [B, D] bf16; xu_ref [B, D];
    # w_ref [D, D] bf16.
    out_ref[...] = h0_ref[...]
    w = w_ref[...]

    def update(start, rows_left=None):
      r = pl.multiple_of(start, chunk)
      h = out_ref[pl.ds(r, chunk), :]
      z = jnp.dot(h, w, preferred_element_type=jnp.float32) + xu_ref[pl.ds(r, chunk), :].astype(
          jnp.float32)
      new = jnp.tanh(z)
      if rows_left is not None:
        row = lax.broadcasted_iota(jnp.int32, (chunk, D), 0)
        new = jnp.where(row < rows_left, new, h.astype(jnp.float32))
      out_ref[pl.ds(r, chunk), :] = new.astype(out_ref.dtype)

    def one_step(t, carry):
      n = active_ref[t]
      if mask == "all":
        def body(c, carry):
          update(c * chunk, n - c * chunk)
          return carry
        lax.fori_loop(0, (n + chunk - 1) // chunk, body, 0)
        return carry
      full = n // chunk
      if pair:
        def body2(c, carry):
          update(2 * c * chunk)
          update((2 * c + 1) * chunk)
          return carry
        lax.fori_loop(0, full // 2, body2, 0)

        @pl.when(full % 2 == 1)
        def _():
          update((full - 1) * chunk)
      else:
        def body(c, carry):
          update(c * chunk)
          return carry
        lax.fori_loop(0, full, body, 0)
      rest = n - full * chunk

      @pl.when(rest > 0)
      def _():
        update(full * chunk, rest)
      return carry

    lax.fori_loop(0, trips, one_step, 0)

  whole = lambda a: pl.BlockSpec(a.shape, lambda i, act: (0,) * a.ndim)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(1,),
          in_specs=[whole(h0), whole(xu), whole(w)], out_specs=whole(h0)),
      out_shape=jax.ShapeDtypeStruct(h0.shape, h0.dtype),
      compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_mb << 20),
      interpret=INTERPRET,
      name="tpu_design_step_outer",
  )(active, h0, xu, w)


def tile_outer(h0, xu, w, tile_active, *, tile: int):
  """The tile-outer prototype: grid of `tile`-row tiles; tile_active int32
  [tiles, T] (rows of the tile still running at step t, a prefix)."""
  tiles, trips = tile_active.shape

  def kernel(act_ref, h0_ref, xu_ref, w_ref, out_ref):
    i = pl.program_id(0)
    w = w_ref[...]
    xu = xu_ref[...].astype(jnp.float32)
    row = lax.broadcasted_iota(jnp.int32, (tile, D), 0)

    def cond(carry):
      t, _ = carry
      return (t < trips) & (act_ref[i, jnp.minimum(t, trips - 1)] > 0)

    def body(carry):
      t, h = carry
      new = jnp.tanh(jnp.dot(h, w, preferred_element_type=jnp.float32) + xu)
      new = jnp.where(row < act_ref[i, t], new, h.astype(jnp.float32))
      return t + 1, new.astype(h.dtype)

    out_ref[...] = lax.while_loop(cond, body, (0, h0_ref[...]))[1]

  rows = lambda a: pl.BlockSpec((tile, D), lambda i, act: (i, 0))
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(tiles,),
          in_specs=[rows(h0), rows(xu), pl.BlockSpec((D, D), lambda i, act: (0, 0))],
          out_specs=rows(h0)),
      out_shape=jax.ShapeDtypeStruct(h0.shape, h0.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                           vmem_limit_bytes=64 << 20),
      interpret=INTERPRET,
      name="tpu_design_tile_outer",
  )(tile_active, h0, xu, w)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="append JSON lines here")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--chain", type=int, default=32)
  p.add_argument("--smoke", action="store_true", help="tiny sizes (interpret mode on CPU)")
  p.add_argument("--sections", default="baselines,loops,permutation",
                 help="comma-separated: baselines (whole forwards and the library's "
                      "variants), loops (the prototypes), permutation")
  args = p.parse_args(argv)
  kind = jax.devices()[0].device_kind
  write = device_timing.json_lines(args.out)

  sections = args.sections.split(",")
  if "baselines" in sections:
    baselines(write, args)
  bound = device_timing.bound_ns_per_row_step(2 * D * D, kind)
  batches = (256,) if args.smoke else (32768, 4096)
  for batch in batches if "loops" in sections else ():
    floor = device_timing.floor_seconds(jnp.zeros((batch, D), jnp.bfloat16), args.repeats)
    write({"what": "floor", "batch": batch, "ms": floor * 1e3})
    for dist in ("constant", "uniform", "recurrent_depth"):
      t_max = cases.DEFAULT_MAX_ITERS[dist]
      counts = np.sort(cases.count_distribution(dist, batch, t_max))[::-1].copy()
      key = jax.random.key(0)
      k1, k2, k3 = jax.random.split(key, 3)
      h0 = (0.5 * jax.random.normal(k1, (batch, D))).astype(jnp.bfloat16)
      xu32 = jax.random.normal(k2, (batch, D), jnp.float32)
      w = (jax.random.normal(k3, (D, D)) * 0.9 / np.sqrt(D)).astype(jnp.bfloat16)
      trips = int(counts.max())
      active = jnp.asarray(active_table(counts, trips))
      want = None
      variants = []
      for chunk in ((256, 512, 1024, 2048) if not args.smoke else (64,)):
        for xu_dtype in ("float32", "bfloat16"):
          variants.append((f"step_outer C={chunk} xu={xu_dtype}", functools.partial(
              step_outer, chunk=chunk), xu_dtype))
      for chunk in ((512, 1024) if not args.smoke else (64,)):
        variants.append((f"step_outer C={chunk} pair", functools.partial(
            step_outer, chunk=chunk, pair=True), "float32"))
        variants.append((f"step_outer C={chunk} mask=all", functools.partial(
            step_outer, chunk=chunk, mask="all"), "float32"))
      for tile in ((512, 1024, 2048) if not args.smoke else (64,)):
        tiles = batch // tile
        tile_act = np.stack([active_table(counts[i * tile:(i + 1) * tile], trips)
                             for i in range(tiles)])
        variants.append((f"tile_outer TB={tile}",
                         functools.partial(tile_outer, tile=tile), "float32", tile_act))
      for name, fn, xu_dtype, *extra in variants:
        table = jnp.asarray(extra[0]) if extra else active
        try:
          apply = lambda h, xu, fn=fn, table=table, dt=xu_dtype: fn(
              h, xu.astype(dt), w, table)
          got = jax.jit(apply)(h0, xu32)
          if want is None:
            want = reference_loop(h0, xu32, w, counts)
          err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
          # xU in bf16 is another computation: only the f32 ones are held to the oracle.
          ok = err <= 0.02 or xu_dtype == "bfloat16"
          if args.smoke:
            secs = float("nan")  # interpret mode: correctness only
          else:
            secs = device_timing.chained_seconds(apply, h0, xu32, chain=args.chain,
                                                 repeats=args.repeats, floor=floor)[0]
          ns = device_timing.ns_per_row_step(secs, counts)
          write({"what": "loop", "variant": name, "batch": batch, "counts": dist,
                 "max_iters": t_max, "ms": secs * 1e3, "ns_per_row_step": ns,
                 "of_bound": None if bound is None else ns / bound, "max_err": err, "ok": ok})
        except Exception as e:  # a variant the compiler rejects is a result too
          write({"what": "loop", "variant": name, "batch": batch, "counts": dist,
                 "error": f"{type(e).__name__}: {str(e)[:400]}"})
  if not args.smoke and "permutation" in sections:
    permutation_pieces(write, args)
  return 0


def _traced_with(module, values, fn, *args, **kwargs):
  with patched(module, **values):
    return fn(*args, **kwargs)


def prototype_forward(h, x, counts, params, *, max_iters: int, chunk: int = 1024):
  """The step-outer prototype with what goes around it: order rows by count,
  gather x and h, compute x U + b after the gather, the active table, the
  loop, and the scatter back."""
  w, u, b = params
  batch = counts.shape[0]
  order = jnp.argsort(-counts, stable=True).astype(jnp.int32)
  xu = jnp.dot(jnp.take(x, order, axis=0), u, preferred_element_type=jnp.float32) + b.astype(
      jnp.float32)
  hs = jnp.take(h, order, axis=0)
  active = jnp.sum((counts[:, None] > jnp.arange(max_iters)[None, :]).astype(jnp.int32), axis=0)
  out = step_outer(hs, xu, w, active, chunk=min(chunk, batch))
  return jnp.zeros_like(h).at[order].set(out)


@contextlib.contextmanager
def patched(module, **values):
  """Module attributes set while a function is traced (a design variant)."""
  old = {k: getattr(module, k) for k in values}
  for k, v in values.items():
    setattr(module, k, v)
  try:
    yield
  finally:
    for k, v in old.items():
      setattr(module, k, v)


def baselines(write, args) -> None:
  """The tanh RNN's whole forward, every implementation a user has, side by
  side: the masked scan, the hoisted scan, vmap(while_loop), iterate's
  default and XLA implementations, and the prototype's whole forward."""
  import pallas_loop
  from pallas_loop import _reference as reference
  from pallas_loop._src.kernels import backend_mosaic_tpu
  from pallas_loop._src.kernels import kernel_tpu_groups
  from benchmarks import blocks
  from benchmarks import harness

  kind = jax.devices()[0].device_kind
  bound = device_timing.bound_ns_per_row_step(2 * D * D, kind)
  for batch in ((256,) if args.smoke else (32768, 4096)):
    for dist in ("constant", "uniform", "recurrent_depth"):
      t_max = cases.DEFAULT_MAX_ITERS[dist]
      step, params, h0, x = blocks.make("tanh_rnn", batch, D, jnp.bfloat16, jax.random.key(0))
      counts = jnp.asarray(cases.count_distribution(dist, batch, t_max))
      pre, hoisted_step = blocks.BLOCKS["tanh_rnn"].hoisted
      impls = {
          "masked_scan": lambda h, r: reference.iterate(
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max),
          "hoisted_scan": lambda h, r: reference.iterate(
              hoisted_step, params, h, pre(params, r["x"]), iters=r["counts"],
              max_iters=t_max),
          "vmap_while": lambda h, r: harness.vmap_while(
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max),
          "iterate": lambda h, r: pallas_loop.iterate(
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max),
          "iterate C=1024": lambda h, r: pallas_loop.iterate(
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max,
              options=pallas_loop.Options(block_rows=1024)),
          "iterate C=4096": lambda h, r: pallas_loop.iterate(
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max,
              options=pallas_loop.Options(block_rows=4096)),
          "iterate one group": lambda h, r: _traced_with(
              kernel_tpu_groups, dict(GROUPS=1), pallas_loop.iterate,
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max),
          "iterate tile kernel (before)": lambda h, r: _traced_with(
              backend_mosaic_tpu, dict(MOSAIC_TPU=dataclasses.replace(
                  backend_mosaic_tpu.MOSAIC_TPU, plan_forward=None)), pallas_loop.iterate,
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max),
          "iterate_xla": lambda h, r: pallas_loop.iterate(
              step, params, h, r["x"], iters=r["counts"], max_iters=t_max,
              options=pallas_loop.Options(implementation="xla")),
          "prototype_forward": lambda h, r: prototype_forward(
              h, r["x"], r["counts"], params, max_iters=t_max),
      }
      floor = device_timing.floor_seconds(h0, args.repeats)
      inputs = {"x": x, "counts": counts}
      want = jax.jit(impls["masked_scan"])(h0, inputs)
      base = {}
      for name, fn in impls.items():
        try:
          err = float(harness.max_error(jax.jit(fn)(h0, inputs), want))
          secs = (float("nan") if args.smoke else device_timing.chained_seconds(
              fn, h0, inputs, chain=args.chain, repeats=args.repeats, floor=floor)[0])
          base[name] = secs
          ns = device_timing.ns_per_row_step(secs, np.asarray(counts))
          write({"what": "forward", "impl": name, "block": "tanh_rnn", "batch": batch,
                 "counts": dist, "max_iters": t_max, "ms": secs * 1e3, "floor_ms": floor * 1e3,
                 "speedup_vs_masked_scan": base["masked_scan"] / secs,
                 "ns_per_row_step": ns, "of_bound": None if bound is None else ns / bound,
                 "max_err": err, "ok": err <= harness.tolerance("bfloat16", t_max)})
        except Exception as e:
          write({"what": "forward", "impl": name, "batch": batch, "counts": dist,
                 "error": f"{type(e).__name__}: {str(e)[:400]}"})


def reference_loop(h0, xu, w, counts):
  """The oracle for the prototypes: a masked scan over max(counts) steps."""
  counts = jnp.asarray(counts)

  def body(h, t):
    new = jnp.tanh(jnp.dot(h, w, preferred_element_type=jnp.float32) + xu).astype(h.dtype)
    return jnp.where((t < counts)[:, None], new, h), None

  return lax.scan(body, h0, jnp.arange(int(counts.max())))[0]


def permutation_pieces(write, args) -> None:
  """What the row permutation around the loop costs, piece by piece, at
  B=32768, D=128 (each piece chained inside one jit like the loops)."""
  batch, t_max = 32768, 128
  counts = jnp.asarray(cases.count_distribution("recurrent_depth", batch, t_max))
  x = jax.random.normal(jax.random.key(1), (batch, D)).astype(jnp.bfloat16)
  u = (jax.random.normal(jax.random.key(2), (D, D)) / np.sqrt(D)).astype(jnp.bfloat16)
  b = jnp.zeros((D,), jnp.float32)
  order = jnp.argsort(-counts, stable=True).astype(jnp.int32)
  inputs = {"counts": counts, "x": x, "order": order}
  f32 = jnp.zeros((batch, D), jnp.float32)
  floor = device_timing.floor_seconds(f32, args.repeats)

  def counting_order(c):
    # A counting sort on the bounded counts: position = rows with a larger
    # count + rows of the same count before this one.
    onehot = (c[:, None] == jnp.arange(t_max + 1)[None, :]).astype(jnp.int32)
    per_count = jnp.sum(onehot, axis=0)
    larger = jnp.cumsum(per_count[::-1])[::-1] - per_count  # rows with a larger count
    within = jnp.cumsum(onehot, axis=0) - onehot
    pos = larger[c] + jnp.sum(within * onehot, axis=1)
    return jnp.zeros_like(pos).at[pos].set(jnp.arange(batch, dtype=jnp.int32))

  pieces = {
      "argsort": lambda h, r: h + jnp.argsort(-r["counts"], stable=True)[:, None].astype(h.dtype),
      "counting sort": lambda h, r: h + counting_order(r["counts"])[:, None].astype(h.dtype),
      "inverse by scatter": lambda h, r: h + jnp.zeros_like(r["order"]).at[r["order"]].set(
          jnp.arange(batch, dtype=jnp.int32))[:, None].astype(h.dtype),
      "inverse by argsort": lambda h, r: h + jnp.argsort(r["order"])[:, None].astype(h.dtype),
      "gather x bf16 (promise_in_bounds)": lambda h, r: h + r["x"].at[r["order"]].get(
          mode="promise_in_bounds", unique_indices=True).astype(h.dtype),
      "gather [x, x] bf16 as one": lambda h, r: h + jnp.take(
          jnp.concatenate([r["x"], r["x"]], axis=1), r["order"], axis=0)[:, :D].astype(h.dtype),
      "gather x bf16": lambda h, r: h + jnp.take(r["x"], r["order"], axis=0).astype(h.dtype),
      "x U + b (f32 out)": lambda h, r: h + (jnp.dot(r["x"], u, preferred_element_type=jnp.float32)
                                             + b),
      "gather (x U + b) f32": lambda h, r: h + jnp.take(
          jnp.dot(r["x"], u, preferred_element_type=jnp.float32) + b, r["order"], axis=0),
      "gather x then x U + b": lambda h, r: h + (jnp.dot(
          jnp.take(r["x"], r["order"], axis=0), u, preferred_element_type=jnp.float32) + b),
      "scatter h back (bf16)": lambda h, r: h + jnp.zeros((batch, D), jnp.bfloat16).at[
          r["order"]].set(r["x"]).astype(h.dtype),
      "nothing (h + x)": lambda h, r: h + r["x"].astype(h.dtype),
  }
  for name, fn in pieces.items():
    try:
      secs = device_timing.chained_seconds(fn, f32, inputs, chain=args.chain,
                                           repeats=args.repeats, floor=floor)[0]
      write({"what": "permutation", "piece": name, "batch": batch, "ms": secs * 1e3})
    except Exception as e:
      write({"what": "permutation", "piece": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})


if __name__ == "__main__":
  sys.exit(main())
