"""What distinguishes one Pallas backend from another for the iterate kernel.

A `Backend` holds all that is its own: the platforms it serves, how its
kernels launch (rows gathered into tiles, or read by index; persistent
programs), its block and configuration rules, its evaluation rules
(`jaxpr_eval.Rules`), its tile heights (the default and what tuning tries),
its interpret mode, and optionally a forward kernel of its own. The shared
kernels (`kernel_forward.py`, `kernel_backward.py`, and the `kernel_toolkit.py`
they launch through), `dispatch.py` and `tuning.py` read these fields and
never name a backend. The compiled backends are listed in `backends.py`
(one line each); interpret mode is `INTERPRET` here, made into one backend
per compiled target by `backend_interpret.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.extend import core as jex_core

from pallas_loop._src.step import jaxpr_eval


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How one kernel runs on a backend, chosen by the backend's rule.

  Attributes:
    block_rows: rows per tile.
    shared_on_chip: True: the shared operands (params, the step's constants)
      are loaded once per program and held on chip across steps; False: each
      use in a step re-reads its operand (from L1/L2 on a GPU), so only one
      dot's operands need to be on chip at a time.
    compiler_params: the `pallas_call` compiler params.
    prefer_xla: why the XLA implementation is expected to be faster (a
      modelled, not a hard, limit: `implementation=None` then falls back,
      `"pallas"` still runs the kernel); None when the kernel is preferred.
    estimate: the rule's resource estimate, e.g. {"shared_memory_bytes": ...},
      shown by the compile report next to what the compiler took.
    eval_rules: how the kernel evaluates the step (`jaxpr_eval.Rules`).
  """

  block_rows: int
  shared_on_chip: bool = True
  compiler_params: Any = None
  prefer_xla: str | None = None
  estimate: dict = dataclasses.field(default_factory=dict, compare=False)
  eval_rules: jaxpr_eval.Rules = jaxpr_eval.PLAIN


@dataclasses.dataclass(frozen=True)
class Block:
  """One blocked operand of the kernel, as the block rules see it."""

  what: str                  # e.g. "h['c']" or "params[0]": named in errors
  block_shape: tuple[int, ...]
  array_shape: tuple[int, ...]
  row_axis: int | None = 0   # the axis block_rows sizes (None: none does)


@dataclasses.dataclass(frozen=True)
class Backend:
  """A Pallas backend for the iterate kernel.

  Attributes:
    name: short name used in kernel names, errors and warnings.
    platforms: the lowering platforms it compiles for (`lax.platform_dependent`
      keys, e.g. "cuda"; empty: interpret mode, which runs everywhere).
    default_block_rows: B -> rows per tile when the caller gives none.
    block_problems: blocks -> a message per violated block rule.
    configure: (footprint, block_rows_given) -> (KernelConfig or None,
      problems): the kernel's configuration for a `footprint.Footprint`, or
      why none fits. `block_rows_given` says whether the caller chose the
      tile height (the rule may then not change it).
    lowering_rules: () -> the primitives its lowering supports, or None when
      the table cannot be read in this JAX version (no pre-check then).
    extra_problems: specialized jaxpr -> further messages (e.g. dot sizes).
    interpret: the `interpret=` value for `pallas_call`.
    smallest_default_rows: the default tile height is halved, down to this,
      while no configuration fits (a tile the caller chose is never changed).
    checks: for interpret mode, the compiled backend whose step rules
      (`step_problems`) it applies (`backend_interpret.py`); None: its own.
    plan_forward: the backend's own forward kernel: `plan_forward(backend,
      step_fn, params, consts, h0, x, block_rows, outputs=, sort_rows=,
      max_iters=, approx_tanh=)` -> a plan with `.problems`, `.config` and
      `.run(ops, sort_rows=, residual=, schedule=)`; None: the tile kernel
      every backend shares (`kernel_forward.plan`).
    plan_backward: the backend's own backward kernel: `plan_backward(backend,
      step_fn, params, consts, h, x, block_rows=, bound=, every=, outputs=,
      sort_rows=, approx_tanh=)` -> a plan with `.problems`, `.config` and
      `.run(ops, sort_rows=, schedule=)`; None: the tile kernel every
      backend shares (`kernel_backward.plan`).
    device_platform: its devices' platform as JAX names it
      (`jax.default_backend()`, `Device.platform`, an abstract mesh's), e.g.
      "gpu"; also the `Options(interpret=...)` string that applies its rules
      in interpret mode. None for interpret mode.
    label: how messages name its platform, e.g. "GPU (Triton)".
    indexed_rows: its kernels read and write their rows by index in the
      caller's order (`schedule.over_tiles`); False: the rows are gathered
      into tiles before the kernel and put back after (`tiling.in_tiles`).
    persistent_programs: (config, tiles) -> the persistent schedule's grid
      (`schedule.py`), for a backend with `indexed_rows`; None: it runs the
      grid schedule only.
    tile_candidates: (low, high): the powers of two `tuning.default_candidates`
      tries on its platform.
    eval_rules: how its kernels evaluate the step (`jaxpr_eval.Rules`; its
      `configure` puts them in the `KernelConfig`).
    interpret_eval_rules: how interpret mode under its rules evaluates the
      step (e.g. fast math emulated in jnp); None: `eval_rules`.
    interpret_params: (type, spelling): the `Options(interpret=...)` objects
      with which Pallas interprets its kernels with its own semantics (e.g.
      `pltpu.InterpretParams`), and how messages spell the type; None: none.
  """

  name: str
  platforms: tuple[str, ...]
  default_block_rows: Callable[[int], int]
  block_problems: Callable[[Sequence[Block]], list[str]]
  configure: Callable[[Any, bool], tuple[KernelConfig | None, list[str]]]
  lowering_rules: Callable[[], Any] = lambda: None
  extra_problems: Callable[[Any], list[str]] = lambda jaxpr: []
  interpret: Any = False
  smallest_default_rows: int = 16
  checks: Backend | None = None
  plan_forward: Callable[..., Any] | None = None
  plan_backward: Callable[..., Any] | None = None
  device_platform: str | None = None
  label: str = ""
  indexed_rows: bool = False
  persistent_programs: Callable[[KernelConfig | None, int], int] | None = None
  tile_candidates: tuple[int, int] = (8, 256)
  eval_rules: jaxpr_eval.Rules = jaxpr_eval.PLAIN
  interpret_eval_rules: jaxpr_eval.Rules | None = None
  interpret_params: tuple[type, str] | None = None


def configure(backend: Backend, fp: Any, block_rows_given: bool, *, state: Any,
              approx_tanh: bool | None) -> tuple[KernelConfig | None, list[str]]:
  """`backend.configure(fp, block_rows_given)` for one call: its
  configuration evaluates the step with the tanh this call asks for
  (`jaxpr_eval.for_state`). Every planner configures through this.

  Args:
    backend: the backend planned for.
    fp: the kernel's `footprint.Footprint`.
    block_rows_given: whether the caller chose the tile height.
    state: the call's carried state (arrays or avals: their dtypes count).
    approx_tanh: `Options.approx_tanh`.

  Returns:
    (KernelConfig or None, problems), as `Backend.configure`.
  """
  config, problems = backend.configure(fp, block_rows_given)
  return for_call(config, state, approx_tanh), problems


def for_call(config: KernelConfig | None, state: Any, approx_tanh: bool | None
             ) -> KernelConfig | None:
  """`config` (None stays None) with the step's evaluation rules for a call
  with carried `state` and `Options.approx_tanh` (`jaxpr_eval.for_state`):
  for a planner that makes its `KernelConfig` itself."""
  if config is None:
    return None
  return dataclasses.replace(
      config, eval_rules=jaxpr_eval.for_state(config.eval_rules, state, approx_tanh))


def iter_eqns(jaxpr: jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
  """Every equation of `jaxpr`, recursing into sub-jaxprs (loops, jit, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from iter_eqns(sub)


def leading_slices(jaxpr: jex_core.Jaxpr, shared: Sequence[Any]) -> tuple[set[int], set[int]]:
  """The `params[index]` reads of stacked shared operands in `jaxpr`.

  Args:
    jaxpr: the step's jaxpr.
    shared: its variables that hold the shared operands, in the kernel's
      order (params leaves, then constants).

  Returns:
    (positions in `shared` of operands read by a `dynamic_slice` of their
    leading axis alone, ids of those equations). The kernels read such an
    operand one slice at a time from its ref (`jaxpr_eval.LoadOnUse`), so
    the equation needs no lowering of its own.
  """
  where = {v: i for i, v in enumerate(shared)}
  positions, eqns = set(), set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "dynamic_slice" or eqn.invars[0] not in where:
      continue
    shape = tuple(getattr(eqn.invars[0].aval, "shape", ()))
    if len(shape) >= 2 and tuple(eqn.params["slice_sizes"])[1:] == shape[1:]:
      positions.add(where[eqn.invars[0]])
      eqns.add(id(eqn))
  return positions, eqns


def extended_dtype_problems(named: Sequence[tuple[str, Any]]) -> list[str]:
  """A message per operand of an extended dtype (a typed PRNG key array,
  `key<fry>`), which no Pallas backend takes as a kernel operand.

  Args:
    named: (description, array or aval) pairs: the kernel's operands.
  """
  return [f"{name} is a typed PRNG key array ({a.dtype}), which a Pallas kernel cannot take: "
          "draw per-row randomness with iterate(key=...) and pallas_loop.random"
          for name, a in named if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)]


def unsupported_primitive_problems(backend: Backend, jaxpr: jex_core.Jaxpr,
                                   read_from_refs: frozenset[int] | set[int] = frozenset()
                                   ) -> list[str]:
  """Names the primitives of `jaxpr` that `backend` has no lowering for
  (the equations in `read_from_refs`, ids, are ref reads: see
  `leading_slices`)."""
  rules = backend.lowering_rules()
  if rules is None:
    return []
  missing = sorted({e.primitive.name for e in iter_eqns(jaxpr)
                    if e.primitive not in rules and id(e) not in read_from_refs})
  return [f"step uses the primitive `{name}`, which the Pallas {backend.name} "
          "lowering does not support" for name in missing]


def step_problems(backend: Backend, jaxpr: jex_core.Jaxpr,
                  read_from_refs: frozenset[int] | set[int] = frozenset()) -> list[str]:
  """Why `backend`'s kernel cannot take the step (or VJP) `jaxpr` itself,
  whatever the tile: primitives its lowering lacks, dots or draws its
  compiler does not take (`Backend.extra_problems`). An interpret backend
  answers for the backend it `checks`, with that backend's messages.

  Args:
    backend: the backend planned for.
    jaxpr: the traced step (or its VJP).
    read_from_refs: ids of equations the kernel reads from refs
      (`leading_slices`).
  """
  rules_of = backend.checks or backend
  return (unsupported_primitive_problems(rules_of, jaxpr, read_from_refs)
          + rules_of.extra_problems(jaxpr))


def device_kind(platform: str) -> str | None:
  """The device kind being compiled for, when it is known while tracing.

  From the abstract mesh (deviceless compilation and export set one: see
  `jax.sharding.use_abstract_mesh` / `jax.set_mesh`), else from the local
  devices if they are of `platform` ("gpu" or "tpu"); None otherwise.
  """
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.device_kind if abstract.platform == platform else None
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  return device.device_kind if device.platform == platform else None


def next_power_of_2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def rows_for_tiles(batch: int, tiles: int, smallest: int, largest: int) -> int:
  """The tile height that gives the batch about `tiles` sorted tiles.

  A sorted tile runs until its slowest row is done, so the work efficiency
  (useful row-steps / row-steps computed) grows with the number of tiles:
  for rows ordered by count it is sum(n) / (R * sum of each tile's largest
  n). About 64 tiles keep it >= 0.95 on every random distribution of the
  benchmarks (RESULTS.md, "Figures behind the code's choices"), and more
  tiles also mean more programs to spread over the cores.

  Args:
    batch: B, the rows.
    tiles: the number of tiles aimed for.
    smallest, largest: powers of two bounding the result (the backend's
      smallest legal / largest sensible tile).

  Returns:
    The largest power of two R in [smallest, largest] with B / R >= tiles
    (`smallest` when even that gives fewer tiles).

  Example:
    >>> rows_for_tiles(1024, 64, 16, 64), rows_for_tiles(16384, 64, 16, 64)
    (16, 64)
  """
  rows = largest
  while rows > smallest and batch < tiles * rows:
    rows //= 2
  return rows


def _interpret_block_rows(batch: int) -> int:
  # A tile per 32 rows: small enough that sorted tiles show early exit, large
  # enough that the interpreter's per-program overhead stays small.
  return min(32, next_power_of_2(batch))


# Interpret mode without a target's rules: `backend_interpret.py` makes the
# backends `iterate` runs from it (one per compiled backend, whose rules it
# applies). Its tile candidates are tuning's on a platform no compiled
# backend serves (the CPU).
INTERPRET = Backend(
    name="interpret",
    platforms=(),
    default_block_rows=_interpret_block_rows,
    block_problems=lambda blocks: [],
    configure=lambda fp, given: (KernelConfig(fp.block_rows, eval_rules=jaxpr_eval.PLAIN), []),
    interpret=True,
)
