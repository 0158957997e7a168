"""Interpret mode: the kernels run on the CPU under a compiled backend's rules.

A user validates a step on a laptop (`implementation="pallas"` runs the
kernels in Pallas interpret mode there) and then runs it on an accelerator.
For the first run to predict the second, interpret mode applies the *target*
backend's rules: it declines what that backend's kernel declines (a
primitive its lowering lacks, a dot its compiler does not take, `jax.random`
on the per-row keys), with that backend's message, and evaluates the step
with that backend's rewrites (`jaxpr_eval.Rules`), so the CPU computes what
the accelerator would. The target is
named by its `Backend.device_platform`, and is `backends.DEFAULT_INTERPRET_TARGET`
(the TPU) when the caller names none:

  interpret=None (CPU, implementation="pallas") or True: the default target's
      rules;
  interpret="tpu", "gpu", ...: that platform's backend's rules;
  an object of a target's `Backend.interpret_params` type (e.g.
      `pltpu.InterpretParams()`): that target's rules and its own semantics
      (its launch and kernels, interpreted by Pallas).

Every backend listed in `backends.py` is a target; nothing here names one.

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

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backends
from pallas_loop._src.kernels import schedule as schedule_lib

# The interpret backend of each target, by its `Backend.device_platform`
# (the `interpret=` string); made when first asked for (`for_target`).
INTERPRETERS: dict[str, backend_lib.Backend] = {}


def _configure(rules: Any) -> Any:
  return lambda fp, given: (backend_lib.KernelConfig(fp.block_rows, eval_rules=rules), [])


# The SMs of the GPU whose persistent grid interpret mode runs
# (`persistent_programs`): an unknown GPU's, as a GPU backend plans for one.
INTERPRET_SMS = 108


def persistent_programs(config: backend_lib.KernelConfig | None, tiles: int) -> int:
  """Interpret mode's persistent grid: `INTERPRET_SMS` programs of 8 warps
  (one an SM), at most `tiles`.

  Example:
    >>> persistent_programs(None, 8), persistent_programs(None, 1000)
    (8, 108)
  """
  del config
  return schedule_lib.programs(INTERPRET_SMS, 8, tiles)


def for_target(target: backend_lib.Backend) -> backend_lib.Backend:
  """Interpret mode under `target`'s rules (made once per target).

  Its kernels read and write their rows by index, whatever the target, so
  that the CPU runs the indexed launch and the persistent schedule too;
  `for_option` with a target's `interpret_params` gives its own launch.

  Example:
    >>> t = backends.DEFAULT_INTERPRET_TARGET
    >>> for_target(t).checks is t, for_target(t).platforms
    (True, ())
  """
  key = target.device_platform or target.name
  made = INTERPRETERS.get(key)
  # Made again for another backend of the same platform (a test's); one a
  # test put here without a target's rules (`checks=None`) is kept.
  if made is None or (made.checks is not None and made.checks is not target):
    made = dataclasses.replace(
        backend_lib.INTERPRET, checks=target,
        configure=_configure(target.interpret_eval_rules or target.eval_rules),
        indexed_rows=True,
        # Read when called: a test may set INTERPRET_SMS.
        persistent_programs=lambda config, tiles: persistent_programs(config, tiles))
    INTERPRETERS[key] = made
  return made


def targets() -> dict[str, backend_lib.Backend]:
  """The compiled backends interpret mode can apply the rules of, by the
  `interpret=` string that names each: the default target first.

  Example:
    >>> list(targets())
    ['tpu', 'gpu']
  """
  default = backends.DEFAULT_INTERPRET_TARGET
  listed = [default] + [b for b in backends.compiled() if b is not default]
  return {b.device_platform: b for b in listed if b.device_platform}


def for_option(interpret: Any) -> backend_lib.Backend:
  """The interpret backend for an `interpret=` value other than False.

  Args:
    interpret: None or True (the default target's rules), a target's
      `device_platform` string ("tpu", "gpu"), or an object of a target's
      `interpret_params` type (e.g. `pltpu.InterpretParams`: the TPU's rules
      and semantics).

  Returns:
    The backend: interpret mode under the target's rules.

  Example:
    >>> for_option(True).checks.name, for_option("gpu").checks.name
    ('mosaic_tpu', 'triton')
  """
  if interpret is None or interpret is True:
    return for_target(backends.DEFAULT_INTERPRET_TARGET)
  if isinstance(interpret, str):
    return for_target(targets()[interpret])
  target = next(t for t in targets().values()
                if t.interpret_params and isinstance(interpret, t.interpret_params[0]))
  # The target's own semantics: its launch and its own kernels, interpreted.
  return dataclasses.replace(
      for_target(target), name=f"{target.device_platform}-interpret", interpret=interpret,
      plan_forward=target.plan_forward, plan_backward=target.plan_backward,
      indexed_rows=target.indexed_rows,
      persistent_programs=target.persistent_programs)


def check_option(interpret: Any) -> None:
  """Raises TypeError for an `interpret=` value of no known type, and
  ValueError for a string that names no target."""
  names = list(targets())
  kinds = [t.interpret_params for t in targets().values() if t.interpret_params]
  if not (interpret is None or isinstance(interpret, (bool, str))
          or any(isinstance(interpret, kind) for kind, _ in kinds)):
    spelled = ", ".join(f"'{n}'" for n in names)
    objects = " or ".join(f"a {spelling}()" for _, spelling in kinds)
    raise TypeError(f"{interpret=} must be None, True, False, {spelled}"
                    + (f" or {objects}." if objects else "."))
  if isinstance(interpret, str) and interpret not in names:
    spelled = " or ".join(", ".join(f"'{n}'" for n in names).rsplit(", ", 1))
    raise ValueError(f"{interpret=} must be None, True, False, {spelled} (the target "
                     "whose rules interpret mode applies), or "
                     + " or ".join(f"a {spelling}()" for _, spelling in kinds) + ".")
