"""Mosaic (TPU) specifics of the iterate kernel: block rules and compiler params.

Mosaic's rule: the last two dimensions of every block are divisible by
(8, 128) or equal the array's. The kernel's row axis is the first axis, so it
is constrained only for 2-D operands (rows are the sublane axis: a multiple of
8) and 1-D operands (rows are the lane axis: a multiple of 128, or one tile).
"""

from __future__ import annotations

# `pltpu` is imported with this module, never lazily during a trace: importing
# it registers a JAX config option (its interpreter's), which changes JAX's
# tracing context, so an import inside a user's first trace made their jitted
# function miss the cache on its second call and compile again
# (tests/test_compile_count.py).

import math
from typing import Any, Sequence

from jax._src import source_info_util
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jex_core
import numpy as np

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.step import jaxpr_eval


# How the Mosaic kernels evaluate the step (`jaxpr_eval.Rules`): dots
# rewritten into the forms Mosaic compiles, narrow dots accumulated in
# float32 as XLA does on a TPU, bool reshapes and broadcasts done on int32, the
# logistic through tanh.
EVAL_RULES = jaxpr_eval.Rules(merge_leading_contractions=True, canonical_dots=True,
                              wide_accumulators=True, int32_bool_shapes=True,
                              vector_dots=True, logistic_via_tanh=True)


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


def _lowering_rules() -> Any:
  try:
    from jax._src.pallas.mosaic import lowering  # pylint: disable=g-import-not-at-top
    from jax._src.tpu import core as tpu_core  # type: ignore[attr-defined]  # pylint: disable=g-import-not-at-top
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


MIB = 1 << 20

# By device-kind substring: (default scoped VMEM limit, physical VMEM). The
# scoped limit is what a kernel may take unless its `vmem_limit_bytes` says
# otherwise (libtpu's E1001 "CompileTimeScopedVmemOom" names it). Unknown TPUs
# keep their default limit: the rule does not raise it.
_TPUS = (
    (("TPU v5 lite", "TPU v5e"), (16 * MIB, 128 * MIB)),
    (("TPU v6 lite", "TPU v6e", "TPU v6"), (32 * MIB, 128 * MIB)),
)
_UNKNOWN_TPU = (16 * MIB, 16 * MIB)

# Beyond the blocks: Mosaic's internal scratch and the step's temporaries, a
# few [block_rows, D] values (RESULTS.md, "Figures behind the code's choices").
FIXED_SCRATCH = 1 * MIB
ROW_TEMPORARIES = 8


# What libtpu took over the estimate, at most (deviceless, multi-head attention
# at D=128, 128-row tiles: 1.19 and 1.17 for Flax's forward and backward with
# libtpu 0.0.48.1, 1.31 for Equinox's forward with 0.0.42.1; RESULTS.md):
# a program whose estimate times this exceeds what a kernel may ask for is
# declined before the compiler is asked ("CompileTimeScopedVmemOom").
MARGIN = 1.5

# The smallest default tile height (`_default_block_rows`): also legal for a
# 1-D operand, whose rows are the lane axis.
SMALLEST_TILE = 128


def vmem(device_kind: str | None) -> tuple[int, int]:
  """(default scoped VMEM limit, physical VMEM) in bytes for a device kind."""
  for names, spec in _TPUS:
    if device_kind and any(n in device_kind for n in names):
      return spec
  return _UNKNOWN_TPU


def padded_bytes(shape: Sequence[int], dtype: str) -> int:
  """Bytes of a block as VMEM holds it: the last two axes padded to a
  (8 x 32 bits / itemsize, 128) tile (a 1-D block is one row)."""
  itemsize = np.dtype(dtype).itemsize
  shape = (1,) * (2 - len(shape)) + tuple(shape)
  sublanes = 8 * max(1, 4 // itemsize)
  *lead, a, b = shape
  return (math.prod(lead) * (-(-a // sublanes) * sublanes) * (-(-b // 128) * 128)
          * itemsize)


def vmem_estimate(fp: footprint_lib.Footprint) -> int:
  """Bytes of VMEM a program needs, estimated (not a bound: `configure`
  asks for twice it, see there).

  Pallas double-buffers every block (the pipeline fetches the next tile's
  while this one runs), shared operands included; plus `FIXED_SCRATCH` and
  the step's values (`step_values_bytes`).
  """
  blocks = sum(padded_bytes(shape, dtype) for shape, dtype in fp.blocks)
  return 2 * blocks + FIXED_SCRATCH + step_values_bytes(fp)


def step_values_bytes(fp: footprint_lib.Footprint) -> int:
  """VMEM for the values a program computes: `ROW_TEMPORARIES` float32 row
  values, or where more the most its values keep alive at once, each
  padded to VMEM's tiles (`Footprint.peak_live_bytes`). The latter is what
  a backward of multi-head attention needs: it keeps the forward's
  [TB, H, L, L] probabilities and [TB, L, H, K] heads, each padded 16- and
  8-fold in their last two axes (L = 8, K = 32), until their cotangents are
  computed."""
  return max(ROW_TEMPORARIES * fp.largest_row_value_bytes, fp.peak_live_bytes(padded_bytes))


def configure(fp: footprint_lib.Footprint, block_rows_given: bool
              ) -> tuple[backend_lib.KernelConfig | None, list[str]]:
  """The Mosaic kernel's configuration for a footprint, or why none fits.

  The rule: a default-height tile taller than `SMALLEST_TILE` must need at
  most twice the default scoped limit (else no configuration, and
  `kernel_toolkit.configured` halves it); a program whose VMEM estimate (`vmem_estimate`),
  doubled, is within the TPU's default scoped limit runs as is; else the kernel asks for
  twice its estimate as its `vmem_limit_bytes`, at most 7/8 of the physical
  VMEM (the rest stays XLA's); an estimate whose `MARGIN` times is beyond
  that means no configuration fits (the XLA implementation runs it, a
  smaller `block_rows` may fit).
  """
  default, physical = vmem(backend_lib.device_kind("tpu"))
  cap = physical * 7 // 8 if physical > default else default
  need = vmem_estimate(fp)
  if not block_rows_given and fp.block_rows > SMALLEST_TILE and need > 2 * default:
    # The tall default tiles were measured on a v5e with estimates up to
    # ~30 MB (the D=128 blocks' forward and backward kernels at 1024 rows).
    # Beyond twice the default scoped limit (a wide or many-leaf state, a
    # transformer's tokens) nothing was measured, and Mosaic's compile time
    # grew (a transformer block at D=64, deviceless: 9 s at 128 rows, 59 s
    # at 1024): `configured` halves the default height while it needs more,
    # down to SMALLEST_TILE, where the rule below applies as before.
    return None, [f"the default tile of {fp.block_rows} rows needs about {need:,} B of "
                  f"VMEM, over twice the TPU's default scoped limit ({default:,} B)"]
  if need * MARGIN > cap:
    return None, [
        f"no kernel configuration fits the TPU's VMEM: a program needs about {need:,} B "
        f"(its blocks double-buffered: {len(fp.blocks)} blocks of {fp.block_rows} rows, "
        f"the shared operands and the step's values), {MARGIN}x of which is more than the "
        f"{cap:,} B a kernel may ask for; a smaller block_rows may fit, else the XLA "
        "implementation runs it"]
  # Twice the estimate: the estimate alone fell short of what Mosaic took
  # (RESULTS.md, "Figures behind the code's choices").
  limit = None if 2 * need <= default else min(cap, -(-2 * need // MIB) * MIB)
  # Row tiles are independent: let Mosaic split them across TensorCores.
  params = pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit)
  return backend_lib.KernelConfig(
      block_rows=fp.block_rows, compiler_params=params, eval_rules=EVAL_RULES,
      estimate={"vmem_bytes": need, "vmem_limit_bytes": limit or default}), []


def _random_problems(jaxpr: jex_core.Jaxpr) -> list[str]:
  """`jax.random` on an array of keys (the per-row keys of a per-example
  step, vmapped): Mosaic's `random_bits` rule takes one key and fails inside
  JAX's threefry with a TypeError at lowering."""
  for eqn in backend_lib.iter_eqns(jaxpr):
    if eqn.primitive.name == "random_bits" and eqn.invars[0].aval.shape:  # type: ignore[attr-defined]
      return ["step draws with jax.random from an array of keys (the per-row keys), which "
              "Mosaic TPU does not lower; draw with pallas_loop.random on the step's key"]
  return []


# Measured on a TPU v5e (JAX 0.10.2; RESULTS.md, "TPU v5e: the kernels
# run"): a TPU core runs the grid's tiles one after another, and a tile's
# step is a chain of dependent matrix-unit and vector work whose latency a
# taller tile amortises. Fitted on the tanh RNN at D=128 bf16 (B=32768, every
# row 64 steps), a tile-step costs about 0.30 us + 1.4 ns a row: a 128-row
# tile spent over half its time on the fixed part. Taller tiles cost early
# exit (a tile runs to its slowest row): over 128 to 2048 rows at B=4096 and
# 32768 (tanh RNN, GRU, residual MLP; constant, uniform and recurrent-depth
# counts) 1024 rows was within 7% of the fastest height in every case (128
# rows: 1.2-2.4x slower than the fastest), so at least 4 tiles, 128 to 1024
# rows.
TILES = 4


def _default_block_rows(batch: int) -> int:
  rows = backend_lib.rows_for_tiles(batch, TILES, smallest=SMALLEST_TILE, largest=1024)
  # 16 rows fill a bf16 sublane tile: a small batch is one tile.
  return min(rows, -(-batch // 16) * 16)


def _narrow_scalar_problems(jaxpr: jex_core.Jaxpr) -> list[str]:
  """Scalars of 16-bit floats the kernel would compute: Mosaic makes a
  scalar only of a 32-bit value ("Only arrays with 32-bit element types can
  be converted to scalars", JAX 0.11.2), e.g. the gradient of a bfloat16
  scalar parameter (a sum over every element). A scalar computed from
  constants alone is computed while tracing (`jaxpr_eval._folds`): fine."""
  problems: list[str] = []
  for v in list(jaxpr.invars) + list(jaxpr.constvars):
    dtype = getattr(v.aval, "dtype", None)
    if (getattr(v.aval, "shape", None) == () and isinstance(dtype, np.dtype)
        and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4):
      problems.append(f"a shared operand is a {dtype.name} scalar, which Mosaic TPU does not "
                      "load (it makes scalars of 32-bit values only); keep scalar parameters "
                      "in float32")

  def walk(j: jex_core.Jaxpr, constant: set) -> None:
    for eqn in j.eqns:
      ins = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
      subs = list(jex_core.jaxprs_in_params(eqn.params))  # a generator in JAX 0.10
      for sub in subs:
        walk(sub, set())
      if not subs and all(v in constant for v in ins):
        constant.update(eqn.outvars)
        continue
      for v in eqn.outvars:
        dtype = getattr(v.aval, "dtype", None)
        if (getattr(v.aval, "shape", None) == () and isinstance(dtype, np.dtype)
            and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4):
          where = source_info_util.summarize(eqn.source_info)
          problems.append(f"the step computes a {dtype.name} scalar ({eqn.primitive.name} at "
                          f"{where}), which Mosaic TPU does not lower (it makes scalars of "
                          "32-bit values only); keep scalar parameters in float32")

  walk(jaxpr, set())
  return list(dict.fromkeys(problems))


def _plan_forward(*args, **kwargs):
  """The TPU's own forward kernel (`kernel_tpu_groups.plan`), imported here
  when first planned: that module builds on this one's rules."""
  from pallas_loop._src.kernels import kernel_tpu_groups  # pylint: disable=g-import-not-at-top
  return kernel_tpu_groups.plan(*args, **kwargs)


def _plan_backward(*args, **kwargs):
  """The TPU's own backward kernel (`kernel_tpu_groups_backward.plan`),
  imported when first planned, as `_plan_forward`."""
  from pallas_loop._src.kernels import kernel_tpu_groups_backward  # pylint: disable=g-import-not-at-top
  return kernel_tpu_groups_backward.plan(*args, **kwargs)


MOSAIC_TPU = backend_lib.Backend(
    name="mosaic_tpu",
    platforms=("tpu",),
    default_block_rows=_default_block_rows,
    block_problems=_block_problems,
    configure=configure,
    lowering_rules=_lowering_rules,
    # Dots with several batch or contracted axes, and matrix-vector and outer
    # products, are rewritten into forms Mosaic compiles (`jaxpr_eval.
    # _canonical_dot`, `_merged_dot`, `_vector_dot`), not declined.
    extra_problems=lambda jaxpr: _random_problems(jaxpr) + _narrow_scalar_problems(jaxpr),
    smallest_default_rows=SMALLEST_TILE,
    plan_forward=_plan_forward,
    plan_backward=_plan_backward,
    device_platform="tpu",
    label="TPU (Mosaic)",
    # Mosaic keeps its blocks (rows gathered into tiles before the kernel,
    # put back after): a gather from HBM would be a DMA per row. A TPU core
    # runs the grid's tiles in order, longest first, which is what a
    # persistent program would do: the grid schedule only.
    indexed_rows=False,
    # A TPU core runs tiles one after another, and tiles under 128 rows were
    # 1.2-2.4x slower than the fastest on a v5e (RESULTS.md): 128 to 2048.
    tile_candidates=(SMALLEST_TILE, 2048),
    eval_rules=EVAL_RULES,
    interpret_params=(pltpu.InterpretParams, "jax.experimental.pallas.tpu.InterpretParams"),
)
