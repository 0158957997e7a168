"""Static cycle counts of the Mosaic (TPU) kernels' loops, without a TPU.

libtpu compiles a kernel deviceless (`compile_check.py`'s recipe) and, asked
with `--xla_jf_dump_to` / `--xla_jf_dump_llo_text`, writes the final VLIW
bundles of every program it compiled. A TPU core issues one bundle a cycle
(stalls aside), so the bundles of a loop body are its static cycle count: the
loop of a kernel that runs T steps over C-row chunks costs about
T * chunks * bundles cycles. This module reads those dumps:

  * `loops(text)`: each loop of a final-bundles dump (its depth, first
    address, bundle count) with a histogram of the operations in it;
  * `compile_and_dump(fn, args, out_dir)`: compiles `jax.jit(fn)` for a v5e
    deviceless with the dump on (it must run in a process whose libtpu has
    not started yet: the flags are read once);
  * `python -m benchmarks.tpu_bundles`: the loops of the library's forward
    kernel for the tanh RNN, GRU, LSTM and residual MLP (D=128, bf16), with
    the matrix unit's cycles beside them (a v5e core: 4 MXUs of 128x128, one
    16-row bf16 push each 16 cycles).

The v5e's clock is 1.5 GHz (197 TFLOP/s / (4 MXUs * 128 * 128 * 2)), so a
loop of N bundles per C-row chunk is N / C / 1.5 ns per row-step, stalls
aside: the first TPU runs compare that with what the chip measures.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import sys

CLOCK_GHZ = 1.5  # v5e: 197e12 / (4 * 128 * 128 * 2)

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+)\s+(\w\w)?:?\s*(>*)\s*\{(.*)\}")
_OP = re.compile(r"= ([a-z_]+(?:\.[a-z0-9_]+)*)")


@dataclasses.dataclass
class Loop:
  """A loop of a final-bundles dump: nesting depth, first bundle's address,
  bundles (cycles a trip, stalls aside), and the operations it issues."""

  depth: int
  start: int
  bundles: int
  ops: collections.Counter

  def summary(self) -> str:
    top = ", ".join(f"{n} {k}" for k, n in self.ops.most_common(8))
    return f"depth {self.depth} @0x{self.start:x}: {self.bundles} bundles ({top})"


def loops(text: str) -> list[Loop]:
  """The loops of a final-bundles dump, outermost first.

  A bundle line reads `0x82a LB: >> { op ;; op ... }`: `LB` marks a loop
  body's first bundle and the `>`s its depth; the body runs on while the
  depth stays at least that deep.
  """
  rows = []
  for line in text.splitlines():
    m = _BUNDLE.match(line)
    if m:
      rows.append((int(m.group(1), 16), m.group(2) or "", len(m.group(3)), m.group(4)))
  found = []
  for i, (addr, mark, depth, _) in enumerate(rows):
    if mark != "LB":
      continue
    ops: collections.Counter = collections.Counter()
    j = i
    while j < len(rows) and rows[j][2] >= depth:
      ops.update(_OP.findall(rows[j][3]))
      j += 1
    found.append(Loop(depth, addr, j - i, ops))
  return found


def kernel_dumps(out_dir: str, name: str) -> list[str]:
  """The final-bundles dumps of the programs whose name contains `name`."""
  return sorted(glob.glob(os.path.join(out_dir, f"*{name}*final_bundles.txt")))


def dump_flags(out_dir: str) -> str:
  """LIBTPU_INIT_ARGS that make libtpu dump its final bundles to `out_dir`."""
  return f"--xla_jf_dump_to={out_dir} --xla_jf_dump_llo_text=true"


def compile_and_dump(fn, args, out_dir: str, topology: str = "v5e:2x2"):
  """Compiles `jax.jit(fn)(*args)` deviceless for a TPU (`args`: shape/dtype
  structs or arrays; their shapes and dtypes are used) with the bundle dump
  on. LIBTPU_INIT_ARGS must already hold `dump_flags(out_dir)` when libtpu
  starts: run this in a fresh process (see `main`)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  mesh = Mesh(topo.devices[:1], ("x",))
  structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())), args)
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*structs).compile()


def main(argv=None) -> int:
  import argparse  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--blocks", default="tanh_rnn,gru,lstm,residual_mlp")
  p.add_argument("--batch", type=int, default=32768)
  p.add_argument("--d", type=int, default=128)
  p.add_argument("--max-iters", type=int, default=64)
  p.add_argument("--kernel", default="pallas_loop_iterate_fwd",
                 help="a substring of the kernel's name")
  p.add_argument("--dump", default=None, help="keep the dumps here (default: a temp dir)")
  args = p.parse_args(argv)
  out_dir = args.dump or tempfile.mkdtemp(prefix="tpu_bundles_")
  if "jax" in sys.modules:
    raise RuntimeError("run `python -m benchmarks.tpu_bundles` in a fresh process")
  os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                    + dump_flags(out_dir)).strip()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pallas_loop  # pylint: disable=g-import-not-at-top
  from benchmarks import blocks  # pylint: disable=g-import-not-at-top

  for name in args.blocks.split(","):
    extra: dict = {}
    if name.startswith("attention_"):  # multi-head attention as a library writes it
      from benchmarks import attention  # pylint: disable=g-import-not-at-top
      step, params, h0, x, extra = attention.make(name[len("attention_"):], args.batch, args.d,
                                                  jnp.bfloat16)
    else:
      step, params, h0, x = blocks.make(name, args.batch, args.d, jnp.bfloat16)
    counts = jnp.full((args.batch,), args.max_iters, jnp.int32)
    sub = os.path.join(out_dir, name)
    os.environ["LIBTPU_INIT_ARGS"] = os.environ["LIBTPU_INIT_ARGS"]  # the first compile fixes it
    fn = lambda p, h, x_, n, step=step, extra=extra: pallas_loop.iterate(
        step, p, h, x_, iters=n, max_iters=args.max_iters,
        options=pallas_loop.Options(implementation="pallas"), **extra)
    compile_and_dump(fn, (params, h0, x, counts), sub)
    # libtpu writes every program to the directory it was started with.
    dumps = kernel_dumps(out_dir, args.kernel)
    if not dumps:
      print(f"{name}: no dump of a kernel named like {args.kernel!r} in {out_dir}")
      continue
    with open(dumps[-1]) as f:
      found = loops(f.read())
    mxu = blocks.BLOCKS[name].loop_flops_per_row_step if name in blocks.BLOCKS else None
    print(f"{name} (D={args.d}, bf16): {len(found)} loops in {os.path.basename(dumps[-1])}")
    for loop in found:
      print("  " + loop.summary())
    if mxu is not None:
      # 4 MXUs, 128x128 MACs a cycle each.
      per_row = mxu(args.d) / 2 / (4 * 128 * 128)
      print(f"  matrix unit: {per_row:.3f} cycles a row-step "
            f"({per_row / CLOCK_GHZ:.3f} ns at {CLOCK_GHZ} GHz)")
    for f in dumps:
      os.remove(f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
