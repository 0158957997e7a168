"""Where XLA puts the work around the TPU kernels: the compiled program, deviceless.

    python -m benchmarks.tpu_hlo --batch 262144            # the forward
    python -m benchmarks.tpu_hlo --batch 262144 --grad     # jax.grad
    python -m benchmarks.tpu_hlo --block gru --slab-bytes 0   # no slabs

Compiles `jax.jit(iterate)` of a block (`--block`, default the tanh RNN; D=128,
bfloat16, counts uniform in [1, T]) for a TPU v5e with libtpu's compile-only topology
(`deviceless.compiler`: no chip needed, `pip install libtpu`), and prints, for
each sort, gather, fusion, slice, `while` and kernel of the optimized program
(the entry computation and the bodies of its loops), its result's shape, where
the result lives (VMEM: the layout's memory space `S(1)`; else HBM) and the
compiler's estimated cycles where it gives them. The row permutation around the
kernels is XLA's: whether its gathers read and write VMEM or HBM is what this
shows (RESULTS.md, "The streaming batch").

This is a compile-level proof: which memory a buffer is placed in and the
compiler's own estimates, not a timing.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

# One instruction of the optimized HLO text: `%name = shape... opcode(`.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\(")
_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')
_KINDS = ("sort", "gather", "fusion", "custom-call", "while", "dynamic-slice",
          "dynamic-update-slice", "slice-start", "copy-start")


def instructions(hlo_text: str) -> list[dict]:
  """The interesting instructions of the entry computation and of the bodies
  of its `while` loops, in program order: name, opcode (a fusion's kind
  folded in: `gather_fusion` is a gather), result shape, memory
  ("VMEM"/"HBM") and estimated cycles (or None).

  Example:
    >>> text = ('ENTRY %main (p: f32[8]) -> f32[8] {\\n'
    ...         '  %p = f32[8]{0:T(256)} parameter(0)\\n'
    ...         '  ROOT %s = f32[8]{0:T(256)S(1)} sort(%p), dimensions={0}\\n}\\n')
    >>> instructions(text)
    [{'computation': 'main', 'name': 's', 'op': 'sort', 'shape': 'f32[8]', 'memory': 'VMEM', \
'cycles': None}]
  """
  wanted = _wanted_computations(hlo_text)
  out, computation = [], None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
    if head and line.rstrip().endswith("{"):
      computation = head.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m or computation not in wanted:
      continue
    name, shape, op = m.groups()
    if not any(k in op or k in name for k in _KINDS) or op in ("parameter",
                                                                "get-tuple-element"):
      continue
    cycles = _CYCLES.search(line)
    out.append(dict(computation=computation, name=name, op=_op_of(name, op),
                    shape=re.sub(r"\{[^}]*\}", "", shape), memory=_memory(shape),
                    cycles=int(cycles.group(1)) if cycles else None))
  return out


def _wanted_computations(text: str) -> set[str]:
  """The entry computation and the bodies of the `while` loops in it."""
  entry = re.search(r"^ENTRY %([\w.\-]+) ", text, re.M)
  names = {entry.group(1)} if entry else set()
  names |= set(re.findall(r"while\(.*?body=%([\w.\-]+)", text))
  return names


def _op_of(name: str, op: str) -> str:
  if op == "fusion":
    for kind in ("gather", "scatter", "dynamic-slice", "dynamic-update-slice", "reduce"):
      if kind.replace("-", "_") in name or kind in name:
        return f"fusion ({kind})"
  if op == "custom-call" and name.startswith("pallas_loop"):
    return "kernel"
  return op


def _memory(shape: str) -> str:
  """VMEM where the result's layout names memory space 1, else HBM ("-" for
  a tuple: its elements may differ)."""
  if shape.startswith("("):
    return "-"
  return "VMEM" if "S(1)" in shape else "HBM"


def compiled_text(batch: int, max_iters: int, grad: bool, block: str = "tanh_rnn",
                  slab_bytes: int | None = None) -> str:
  """The optimized HLO of `jit(iterate)` (or of its `jax.grad`) compiled for a
  TPU v5e, deviceless; `slab_bytes` replaces `kernel_tpu_groups.SLAB_BYTES`
  and `SLABS_FROM_BYTES` (0: every batch one slab)."""
  import pallas_loop  # pylint: disable=g-import-not-at-top
  from pallas_loop._src.kernels import deviceless  # pylint: disable=g-import-not-at-top
  from pallas_loop._src.kernels import kernel_tpu_groups  # pylint: disable=g-import-not-at-top
  from benchmarks import blocks  # pylint: disable=g-import-not-at-top
  from benchmarks import tpu_design  # pylint: disable=g-import-not-at-top

  mesh, why = deviceless.compiler(deviceless.TARGETS["tpu"])
  if mesh is None:
    raise SystemExit(f"tpu_hlo: cannot compile for a TPU here: {why}")
  slabs = {} if slab_bytes is None else dict(SLAB_BYTES=slab_bytes or 1 << 62,
                                             SLABS_FROM_BYTES=slab_bytes or 1 << 62)
  step, params, h0, x = blocks.make(block, batch, 128, jnp.bfloat16, jax.random.key(0))
  counts = jnp.asarray(np.random.default_rng(0).integers(1, max_iters + 1, batch), jnp.int32)
  run = lambda p, h, x_, k: pallas_loop.iterate(step, p, h, x_, iters=k, max_iters=max_iters)
  fn = run
  if grad:
    # Every leaf of the state summed (the LSTM's is a pair).
    fn = jax.grad(lambda p, h, x_, k: sum(jnp.sum(a.astype(jnp.float32))
                                          for a in jax.tree.leaves(run(p, h, x_, k))),
                  argnums=(0, 1))
  with tpu_design.patched(kernel_tpu_groups, **slabs):
    return deviceless.compile_for(fn, (params, h0, x, counts), mesh).as_text()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32768)
  parser.add_argument("--max-iters", type=int, default=64)
  parser.add_argument("--grad", action="store_true", help="jax.grad instead of the forward")
  parser.add_argument("--block", default="tanh_rnn", help="a block of benchmarks.blocks")
  parser.add_argument("--slab-bytes", type=int, default=None,
                      help="slabs of this many bytes from this many (kernel_tpu_groups' "
                           "SLAB_BYTES and SLABS_FROM_BYTES; 0: one slab)")
  args = parser.parse_args(argv)
  rows = instructions(compiled_text(args.batch, args.max_iters, args.grad, args.block,
                                    args.slab_bytes))
  print(f"{args.block}, B={args.batch}, D=128, bfloat16, T={args.max_iters}, "
        f"{'jax.grad' if args.grad else 'forward'}, compiled for a TPU v5e (deviceless)")
  print(f"{'computation':<28} {'instruction':<40} {'op':<26} {'shape':<28} {'memory':<6} cycles")
  for r in rows:
    cycles = "" if r["cycles"] is None else str(r["cycles"])
    print(f"{r['computation'][:28]:<28} {r['name'][:40]:<40} {r['op'][:26]:<26} "
          f"{r['shape'][:28]:<28} {r['memory']:<6} {cycles}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
