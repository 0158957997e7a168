"""Interpret mode: the kernels run on the CPU under a compiled backend's rules.

A user validates a step on a laptop (`implementation="pallas"` runs the
kernels in Pallas interpret mode there) and then runs it on an accelerator.
For the first run to predict the second, interpret mode applies the *target*
backend's rules: it declines what that backend's kernel declines (a
primitive its lowering lacks, a dot its compiler does not take, `jax.random`
on the per-row keys), with that backend's message, and evaluates the step
with that backend's rewrites (`jaxpr_eval.Rules`), so the CPU computes what
the accelerator would. The target is the TPU (Mosaic) unless the caller
names the GPU:

  interpret=None (CPU, implementation="pallas"), True, "tpu", or a
      `pltpu.InterpretParams()` (TPU semantics): the TPU's rules;
  interpret="gpu": the GPU's (Triton's) rules.

Not applied: the rules about the tile (block shapes, which depend on the
tile height, and the interpret tile is its own) and about resources (VMEM,
shared memory, registers: they depend on the chip). Those decide only on the
accelerator, where `implementation=None` falls back to XLA with a warning;
`pallas_loop.testing.check_compiles` reports them for a TPU and a GPU
without either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_loop._src import backend as backend_lib
from pallas_loop._src import backend_mosaic_tpu
from pallas_loop._src import backend_triton
from pallas_loop._src import jaxpr_eval

# `interpret=` strings naming the target whose rules interpret mode applies.
TARGETS = {"tpu": backend_mosaic_tpu.MOSAIC_TPU, "gpu": backend_triton.TRITON}


def _configure(rules: jaxpr_eval.Rules):
  return lambda fp, given: (backend_lib.KernelConfig(fp.block_rows, eval_rules=rules), [])


# The interpret backends read and write their rows by index (as Triton does:
# `schedule.INDEXED_BACKENDS`), whatever their target; the TPU-semantics
# interpreter gathers them into tiles, as Mosaic does.
ON_TPU = dataclasses.replace(backend_lib.INTERPRET, checks=backend_mosaic_tpu.MOSAIC_TPU,
                             configure=_configure(jaxpr_eval.MOSAIC))
ON_GPU = dataclasses.replace(backend_lib.INTERPRET, checks=backend_triton.TRITON,
                             configure=_configure(jaxpr_eval.TRITON_INTERPRET))


def for_option(interpret: Any) -> backend_lib.Backend:
  """The interpret backend for an `interpret=` value other than False.

  Args:
    interpret: None or True (the TPU's rules), "tpu", "gpu", or a
      `pltpu.InterpretParams` (the TPU's rules, TPU semantics).

  Returns:
    The backend: interpret mode under the target's rules.

  Example:
    >>> for_option(True).checks.name, for_option("gpu").checks.name
    ('mosaic_tpu', 'triton')
  """
  if interpret is None or interpret is True or interpret == "tpu":
    return ON_TPU
  if interpret == "gpu":
    return ON_GPU
  # TPU semantics: the TPU's own forward kernel, interpreted.
  return dataclasses.replace(ON_TPU, name="tpu-interpret", interpret=interpret,
                             plan_forward=backend_mosaic_tpu.MOSAIC_TPU.plan_forward)


def check_option(interpret: Any) -> None:
  """Raises ValueError for an `interpret=` string that names no target."""
  if isinstance(interpret, str) and interpret not in TARGETS:
    raise ValueError(f"{interpret=} must be None, True, False, 'tpu' or 'gpu' (the target "
                     "whose rules interpret mode applies), or a pltpu.InterpretParams().")
