"""Triton (GPU) specifics of the iterate kernel: block rules and compiler params.

Everything Triton-specific lives here, so that a Mosaic GPU backend can be
added beside it (the Pallas Triton backend is deprecated upstream from JAX
0.11). Triton's rules (from `jax/_src/pallas/triton/lowering.py`):
  * every array in the kernel has power-of-2 dimensions;
  * `dot` operands have every dimension >= 16;
  * no `jax.random`, no scalar prefetch, no reduce_and/reduce_or.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence
import warnings

from jax.extend import core as jex_core

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.step import jaxpr_eval
from pallas_loop._src.kernels import schedule as schedule_lib


# How the Triton kernels evaluate the step (`jaxpr_eval.Rules`): the
# rewrites XLA's Triton pipeline needs to compile a kernel at all, or within
# shared memory, and the GPU's fast tanh/logistic (`fast_math.py`).
EVAL_RULES = jaxpr_eval.Rules(swap_transposed_dots=True, fence_transposed_operands=True,
                              integer_mask_selects=True, split_dot_bytes=32768,
                              fast_math=True)
# Interpret mode under Triton's rules: the fast math emulated in jnp (no PTX).
INTERPRET_EVAL_RULES = dataclasses.replace(EVAL_RULES, emulate_fast_math=True)


def _is_power_of_2(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def _block_problems(blocks: Sequence[backend_lib.Block]) -> list[str]:
  problems = []
  for b in blocks:
    bad = [d for d in b.block_shape if not _is_power_of_2(d)]
    if bad:
      problems.append(
          f"Triton needs power-of-2 block dimensions; {b.what} has block "
          f"shape {b.block_shape} (array {b.array_shape})")
  return problems


def _dot_problems(jaxpr: jex_core.Jaxpr) -> list[str]:
  """Dots Triton's lowering cannot take: anything but a matrix product of
  two 2-D operands (one contracted axis each, no batch axes: Pallas' Triton
  `dot_general` rule asserts so, a bare AssertionError at lowering, e.g. the
  per-token attention `einsum("rtd,rsd->rts")` of ACT per token), and
  dimensions under 16."""
  problems = []
  for eqn in backend_lib.iter_eqns(jaxpr):
    if eqn.primitive.name == "dot_general":
      shapes = [tuple(v.aval.shape) for v in eqn.invars]  # type: ignore[attr-defined]
      (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
      if lb or len(lc) != 1 or len(rc) != 1 or any(len(s) != 2 for s in shapes):
        what = "a batched dot" if lb else "a dot"
        problems.append(
            f"Triton lowers only matrix products of two 2-D operands (one contracted "
            f"axis each, no batch axes); step has {what} of {shapes[0]} x {shapes[1]} "
            f"contracting axes {tuple(lc)} x {tuple(rc)}"
            + (f" over batch axes {tuple(lb)}" if lb else "")
            + " (e.g. attention over a row's tokens, or a matmul of a [rows, T, D] "
            "state)")
        continue
      if any(d < 16 for s in shapes for d in s):
        problems.append(
            "Triton needs every dimension of a dot operand to be >= 16; step "
            f"has a dot of {shapes[0]} x {shapes[1]} (raise block_rows to 16 "
            "or more, or widen the operands)")
  return problems


def _lowering_rules() -> Any:
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    return lowering.triton_lowering_rules
  except (ImportError, AttributeError):
    return None


def _compiler_params(num_warps: int) -> Any:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
  # A while loop whose body is a dependent chain gains nothing from software
  # pipelining (and stages would multiply the shared memory).
  return pl_triton.CompilerParams(num_warps=num_warps, num_stages=1)


@dataclasses.dataclass(frozen=True)
class Gpu:
  """What the configuration rule needs to know of a GPU.

  shared_memory: the opt-in shared memory per block (bytes); sms: streaming
  multiprocessors (the persistent schedule's programs, `persistent_programs`);
  the rest are data-sheet figures used only by the cost model (`prefer_xla`).
  """

  shared_memory: int
  bf16_flops: float      # dense tensor-core peak, FLOP/s (float32 dots: half)
  hbm_bytes_per_s: float
  sms: int


# By device-kind substring, first match wins ("H20" is a substring of
# "H200": the H200 comes first). Unknown NVIDIA GPUs get the smallest opt-in
# shared memory of the sm_80+ parts (99 KB: sm_86/sm_89), so the rule stays
# safe, and the A100's SM count. SM counts: data sheets (H100 SXM / H200 132,
# H100 PCIe 114, H20 78, B200 148 (B300 assumed the same, not checked),
# A100 108). The cost model's figures are the H200's for the whole Hopper row.
_GPUS = (
    (("H200", "GH200", "H800"), Gpu(232448, 989e12, 4.8e12, 132)),
    (("H100 PCIe",), Gpu(232448, 989e12, 4.8e12, 114)),
    (("H100",), Gpu(232448, 989e12, 4.8e12, 132)),
    (("H20",), Gpu(232448, 989e12, 4.8e12, 78)),
    (("B200", "B300", "GB200", "GB300"), Gpu(232448, 2250e12, 8.0e12, 148)),
    (("A100", "A800"), Gpu(166912, 312e12, 2.0e12, 108)),
)
_UNKNOWN_GPU = Gpu(101376, 312e12, 1.0e12, 108)

# Cost-model assumptions, not measurements (`benchmarks/gpu_check.py` times
# both sides of the boundary): L2 streams at twice HBM's bandwidth, and one
# trip of an XLA while loop costs at least 10 us (its kernel launches and the
# predicate read back by the host).
L2_OVER_HBM = 2.0
XLA_TRIP_SECONDS = 10e-6


def gpu(device_kind: str | None) -> Gpu:
  """The `Gpu` entry for a device kind (e.g. "NVIDIA H200")."""
  for names, spec in _GPUS:
    if device_kind and any(n in device_kind for n in names):
      return spec
  return _UNKNOWN_GPU


def num_warps(fp: footprint_lib.Footprint) -> int:
  """Warps per program: 8, or 4 for a small footprint.

  A program's values are spread over its threads' registers (255 at most per
  thread): a [16, 128] float32 tile takes 8 registers a thread with 8 warps,
  16 with 4, and a staged [128, 128] bfloat16 weight 32 / 64. With 4 warps
  the GRU and LSTM forward at D=128 spill, with 8 none do (compile report),
  and 8 warps x 255 registers is what one H200 SM has (65,536). Footprints
  whose largest dot operand is at most 8 KB ([64, 64] bfloat16) and whose
  row values are at most [16, 64] float32 fit 4 warps without spilling.
  """
  largest = max([b for d in fp.dots for b in d.operand_bytes], default=0)
  return 4 if largest <= 8192 and fp.largest_row_value_bytes <= 4096 else 8


def shared_memory_estimate(fp: footprint_lib.Footprint, on_chip: bool, warps: int) -> int:
  """Bytes of shared memory a program takes, an upper bound (compile report).

  Triton stages both operands of a dot in shared memory. Held on chip, every
  shared dot operand stays staged for the whole loop, plus one row operand;
  re-read where used, one dot's operands at a time, a re-read weight in K
  chunks of at most `EVAL_RULES.split_dot_bytes`. Layout conversions and
  cross-warp reductions take up to two row values (float32) more, and a
  weight gradient's accumulator leaves the dot through a layout conversion
  staged `16 * warps` rows at a time (float32).
  """
  scratch = 2 * fp.largest_row_value_bytes + gradient_conversion_bytes(fp, warps)
  if on_chip:
    return fp.shared_dot_bytes() + fp.largest_row_operand_bytes() + scratch
  return fp.largest_dot_bytes(EVAL_RULES.split_dot_bytes) + scratch


def gradient_conversion_bytes(fp: footprint_lib.Footprint, warps: int) -> int:
  """Shared memory for converting the largest weight gradient's layout."""
  sizes = [min(d.out[0], 16 * warps) * (d.accumulator_bytes // d.out[0])
           for d in fp.dots if d.contracts_rows and d.out]
  return max(sizes, default=0)


# A program's register file: 8 warps x 32 threads x 255 registers x 4 B.
PROGRAM_REGISTER_BYTES = 8 * 32 * 255 * 4


def accumulator_problem(fp: footprint_lib.Footprint) -> str | None:
  """Why a weight-gradient dot cannot accumulate in registers, or None.

  A dot keeps its whole output in registers while it runs. The backward
  kernel's weight gradients (sums over the tile's rows) are [K, N] outputs;
  up to half the program's register file they compile (the other half holds
  the step's row values and the operands in flight). A [256, 256] float32
  accumulator (256 KB) spills and, for an LSTM in float32, fails register
  allocation (compile report).
  """
  acc = fp.largest_gradient_accumulator_bytes()
  if acc <= PROGRAM_REGISTER_BYTES // 2:
    return None
  big = max((d for d in fp.dots if d.contracts_rows), key=lambda d: d.accumulator_bytes)
  return (f"a weight gradient of shape {list(big.out)} would accumulate {acc:,} B in "
          f"registers, more than half a program's register file "
          f"({PROGRAM_REGISTER_BYTES // 2:,} B)")


def prefer_xla(fp: footprint_lib.Footprint, spec: Gpu) -> str | None:
  """Why the XLA implementation should beat a kernel that re-reads its weights.

  A program that re-reads its shared operands streams them from L2 on every
  step: tiles x their bytes per step, for all tiles. The batched XLA step
  reads them once and runs one large dot, but pays a loop trip per step.
  Returns the reason when the first exceeds the second (modelled, see
  `L2_OVER_HBM`, `XLA_TRIP_SECONDS`), else None.
  """
  reread = sum(b for d in fp.dots for b, s in zip(d.operand_bytes, (d.lhs_shared, d.rhs_shared))
               if s)
  kernel_s = fp.tiles * reread / (L2_OVER_HBM * spec.hbm_bytes_per_s)
  batch_flops = fp.flops() * fp.tiles
  xla_s = max(batch_flops / spec.bf16_flops,
              (fp.shared_bytes + fp.batch * fp.row_bytes) / spec.hbm_bytes_per_s
              ) + XLA_TRIP_SECONDS
  if kernel_s <= xla_s:
    return None
  return (f"its {fp.tiles} tiles would re-read {reread:,} B of weights from L2 every step "
          f"(modelled {kernel_s * 1e6:.1f} us a step against {xla_s * 1e6:.1f} us for the "
          "batched XLA step): they do not fit in shared memory at once")


def configure(fp: footprint_lib.Footprint, block_rows_given: bool
              ) -> tuple[backend_lib.KernelConfig | None, list[str]]:
  """The Triton kernel's configuration for a footprint, or why none fits.

  The rule (numbers from the compile report, `benchmarks/compile_check.py`):
    1. Hold the shared operands on chip (loaded once per program, staged in
       shared memory for the whole loop) when they fit the GPU's shared
       memory (`shared_memory_estimate`).
    2. Else re-read each where a step uses it, when one dot's operands fit;
       `prefer_xla` then says whether the XLA implementation is expected to
       be faster (`implementation=None` falls back, "pallas" runs it).
    3. Else no configuration fits: a problem naming the dot.
  Before these, a weight gradient too large to accumulate in registers
  (`accumulator_problem`) means no configuration fits.
  Warps per program: `num_warps`.
  """
  del block_rows_given
  spec = gpu(backend_lib.device_kind("gpu"))
  warps = num_warps(fp)
  too_big = accumulator_problem(fp)
  if too_big:
    return None, [f"no kernel configuration fits: {too_big}; the XLA implementation runs it"]
  for on_chip in (True, False):
    smem = shared_memory_estimate(fp, on_chip, warps)
    if smem <= spec.shared_memory:
      return backend_lib.KernelConfig(
          block_rows=fp.block_rows, shared_on_chip=on_chip,
          compiler_params=_compiler_params(warps),
          prefer_xla=None if on_chip else prefer_xla(fp, spec),
          eval_rules=EVAL_RULES,
          estimate={"shared_memory_bytes": smem, "num_warps": warps}), []
  big = max(fp.dots, key=lambda d: sum(d.operand_bytes))
  return None, [
      f"no kernel configuration fits the GPU's shared memory ({spec.shared_memory:,} B "
      f"a program): the step's dot of {list(big.lhs)} x {list(big.rhs)} stages "
      f"{sum(big.operand_bytes):,} B, {shared_memory_estimate(fp, False, warps):,} B with "
      "scratch; Triton cannot split a dot, so the XLA implementation runs it"]


def persistent_programs(config: backend_lib.KernelConfig | None, tiles: int) -> int:
  """The persistent schedule's grid (`schedule.py`): the GPU's SMs times
  the programs an SM holds by registers at the kernel's warps (255
  registers a thread at worst), at most `tiles`.

  Example:
    >>> persistent_programs(None, 8)  # no GPU here: the unknown GPU's 108 SMs
    8
  """
  warps = (config.estimate.get("num_warps", 8) if config is not None else 8)
  return schedule_lib.programs(gpu(backend_lib.device_kind("gpu")).sms, warps, tiles)


# A heuristic, not yet timed on a GPU (`benchmarks/gpu_check.py` times
# block_rows 16/32/64): at least 256 tiles (16 rows, the smallest tile whose
# dots Triton lowers, up to 64), ~2 programs per SM of an H200; each program
# runs one dependent chain of steps, so a GPU is filled by programs, not by
# taller tiles. The work efficiency this gives: RESULTS.md, "Figures behind the code's choices".
TILES = 256


def _default_block_rows(batch: int) -> int:
  return backend_lib.rows_for_tiles(batch, TILES, smallest=16, largest=64)


TRITON = backend_lib.Backend(
    name="triton",
    platforms=("cuda", "rocm"),
    default_block_rows=_default_block_rows,
    block_problems=_block_problems,
    configure=configure,
    lowering_rules=_lowering_rules,
    extra_problems=_dot_problems,
    device_platform="gpu",
    label="GPU (Triton)",
    # Pallas' Triton lowering takes an int32 vector as a ref indexer (pointer
    # arithmetic), so the kernels read their rows in the caller's order: no
    # gathers before the kernel, no scatter after (`schedule.py`).
    indexed_rows=True,
    persistent_programs=persistent_programs,
    # From 8 rows (tiles Triton's dots decline are reported by tuning) to 256.
    tile_candidates=(8, 256),
    eval_rules=EVAL_RULES,
    interpret_eval_rules=INTERPRET_EVAL_RULES,
)
