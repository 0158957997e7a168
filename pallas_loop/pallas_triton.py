"""Triton (GPU) specifics of the iterate kernel: block rules and compiler params.

Everything Triton-specific lives here, so that a Mosaic GPU backend can be
added beside it (the Pallas Triton backend is deprecated upstream from JAX
0.11). Triton's rules (from `jax/_src/pallas/triton/lowering.py`):
  * every array in the kernel has power-of-2 dimensions;
  * `dot` operands have every dimension >= 16;
  * no `jax.random`, no scalar prefetch, no reduce_and/reduce_or.
"""

from __future__ import annotations

from typing import Sequence
import warnings

from pallas_loop import backend as backend_lib


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


def _dot_problems(jaxpr) -> list[str]:
  problems = []
  for eqn in backend_lib.iter_eqns(jaxpr):
    if eqn.primitive.name == "dot_general":
      shapes = [tuple(v.aval.shape) for v in eqn.invars]
      if any(d < 16 for s in shapes for d in s):
        problems.append(
            "Triton needs every dimension of a dot operand to be >= 16; step "
            f"has a dot of {shapes[0]} x {shapes[1]} (raise block_rows to 16 "
            "or more, or widen the operands)")
  return problems


def _lowering_rules():
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    return lowering.triton_lowering_rules
  except (ImportError, AttributeError):
    return None


def _compiler_params(block_rows: int):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
  # One warp per 16 rows keeps the per-thread state small; a while loop whose
  # body is a dependent chain gains nothing from software pipelining.
  return pl_triton.CompilerParams(num_warps=max(1, min(8, block_rows // 16)),
                                  num_stages=1)


# Heuristic (not yet timed on a GPU: no device was lent to the sessions that
# wrote it; `benchmarks/gpu_check.py` times block_rows 16/32/64 to check it):
# at least 256 tiles, i.e. 16 rows (the smallest tile whose dots Triton
# lowers) below B = 8192, 32 rows below B = 16384, then 64. 256 programs put ~2
# on each of an H200's 132 SMs, and that many sorted tiles keep the work
# efficiency >= 0.97 on the random count distributions
# (`backend.rows_for_tiles`). Each program runs one dependent chain of steps,
# so a GPU is filled by programs, not by taller tiles.
TILES = 256


def _default_block_rows(batch: int) -> int:
  return backend_lib.rows_for_tiles(batch, TILES, smallest=16, largest=64)


TRITON = backend_lib.Backend(
    name="triton",
    platforms=("cuda", "rocm"),
    default_block_rows=_default_block_rows,
    block_problems=_block_problems,
    compiler_params=_compiler_params,
    lowering_rules=_lowering_rules,
    extra_problems=_dot_problems,
)
