"""What a row permutation costs on the TPU: XLA's gathers of one leaf, of two, of two joined.

The TPU kernels run rows in count order: before each kernel XLA gathers each
leaf of the rows' state and inputs into that order, and after it gathers the
outputs back (`tiling.in_tiles`). At B=32768 those gathers cost more than the
loop with ragged counts (RESULTS.md, "Where the forward's time goes"). This
script times, for rows of D=128, inside one `jit` as `gpu_check` does
(`device_timing.chained_seconds`, the jitted call's floor left out), each
application with its own random permutation:

  take bf16 [B, 128]         one bfloat16 leaf
  take f32 [B, 128]          one float32 leaf (a float32 input gradient)
  take bf16 [B, 256]         one leaf of twice the width
  two takes bf16             the state and the input, a gather each (what the
                             forward does now)
  joined take bf16           the two joined along their last axis, one gather of
                             [B, 256], split after
  sort                       `tiling.sorted_descending` of int32 counts in [1, 64]

    python -m benchmarks.tpu_gathers [--out gathers.jsonl] [--batch 32768]

Each line: variant, batch, ms, ns a row, chain, floor_ms.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_timing
from pallas_loop._src import tiling


def _variants(batch: int, d: int):
  """(name, apply(carry, inputs) -> carry, carry0) per variant; inputs hold
  `order` (a permutation of the rows) and `counts`."""
  rng = np.random.default_rng(0)
  bf16 = lambda width: jnp.asarray(rng.standard_normal((batch, width)), jnp.bfloat16)
  take = lambda a, order: jnp.take(a, order, axis=0, mode="clip")

  def joined(carry, inputs):
    h, x = carry
    both = take(jnp.concatenate([h, x], axis=1), inputs["order"])
    return both[:, :d], both[:, d:]

  def sort(carry, inputs):
    counts, order = tiling.sorted_descending(inputs["counts"])
    return carry + counts[:1].astype(carry.dtype) + order[:1].astype(carry.dtype)

  return [
      ("take bf16 [B, 128]", lambda h, i: take(h, i["order"]), bf16(d)),
      ("take f32 [B, 128]", lambda h, i: take(h, i["order"]),
       jnp.asarray(rng.standard_normal((batch, d)), jnp.float32)),
      ("take bf16 [B, 256]", lambda h, i: take(h, i["order"]), bf16(2 * d)),
      ("two takes bf16", lambda c, i: (take(c[0], i["order"]), take(c[1], i["order"])),
       (bf16(d), bf16(d))),
      ("joined take bf16", joined, (bf16(d), bf16(d))),
      ("sort", sort, jnp.zeros((1,), jnp.int32)),
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="JSON lines, one per variant")
  parser.add_argument("--batch", type=int, default=32768)
  parser.add_argument("--d", type=int, default=128)
  args = parser.parse_args(argv)
  write = device_timing.json_lines(args.out)
  rng = np.random.default_rng(1)
  inputs = {"order": jnp.asarray(rng.permutation(args.batch), jnp.int32)[:, None],
            "counts": jnp.asarray(rng.integers(1, 65, args.batch), jnp.int32)[:, None]}
  # `chained_seconds` rolls [B, ...] inputs per application; take them as [B].
  flat = lambda i: {k: v[:, 0] for k, v in i.items()}
  for name, apply, carry in _variants(args.batch, args.d):
    floor = device_timing.floor_seconds(carry)
    seconds, chain = device_timing.chained_seconds(
        lambda c, i, apply=apply: apply(c, flat(i)), carry, inputs, floor=floor)
    write({"variant": name, "batch": args.batch, "ms": seconds * 1e3,
           "ns_per_row": seconds * 1e9 / args.batch, "chain": chain, "floor_ms": floor * 1e3})
  return 0


if __name__ == "__main__":
  sys.exit(main())
