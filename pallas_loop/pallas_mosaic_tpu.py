"""Mosaic (TPU) specifics of the iterate kernel: block rules and compiler params.

Mosaic's rule: the last two dimensions of every block are divisible by
(8, 128) or equal the array's. The kernel's row axis is the first axis, so it
is constrained only for 2-D operands (rows are the sublane axis: a multiple of
8) and 1-D operands (rows are the lane axis: a multiple of 128, or one tile).
"""

from __future__ import annotations

from typing import Sequence

from pallas_loop import backend as backend_lib


def _block_problems(blocks: Sequence[backend_lib.Block]) -> list[str]:
  problems = []
  for b in blocks:
    rank = len(b.block_shape)
    for axis, unit in ((rank - 1, 128), (rank - 2, 8)):
      if axis < 0:
        continue
      blk, arr = b.block_shape[axis], b.array_shape[axis]
      if blk % unit and blk != arr:
        if axis == b.row_axis:
          advice = f"choose block_rows a multiple of {unit}"
        else:
          advice = (f"its axis {axis} is not the row axis, so block_rows cannot fix it: "
                    "please report this as a pallas_loop bug")
        problems.append(
            f"Mosaic TPU needs the last two block dimensions divisible by "
            f"(8, 128) or equal to the array's; {b.what} has block shape "
            f"{b.block_shape} (array {b.array_shape}): {advice}")
  return problems


def _lowering_rules():
  try:
    from jax._src.pallas.mosaic import lowering  # pylint: disable=g-import-not-at-top
    from jax._src.tpu import core as tpu_core  # pylint: disable=g-import-not-at-top
  except ImportError:
    try:
      from jax._src.pallas.mosaic import core as tpu_core  # pylint: disable=g-import-not-at-top
      from jax._src.pallas.mosaic import lowering  # pylint: disable=g-import-not-at-top
    except ImportError:
      return None
  try:
    return lowering.lowering_rules[tpu_core.CoreType.TC]
  except (AttributeError, KeyError):
    return None


def configure(fp, block_rows_given: bool):
  """The Mosaic kernel's configuration for a footprint, or why none fits."""
  del block_rows_given
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  # Row tiles are independent: let Mosaic split them across TensorCores.
  params = pltpu.CompilerParams(dimension_semantics=("parallel",))
  return backend_lib.KernelConfig(block_rows=fp.block_rows, compiler_params=params), []


def _default_block_rows(batch: int) -> int:
  # 16 rows fill a bf16 sublane tile; 128 rows amortise the loop overhead.
  return min(128, -(-batch // 16) * 16)


MOSAIC_TPU = backend_lib.Backend(
    name="mosaic_tpu",
    platforms=("tpu",),
    default_block_rows=_default_block_rows,
    block_problems=_block_problems,
    configure=configure,
    lowering_rules=_lowering_rules,
)
