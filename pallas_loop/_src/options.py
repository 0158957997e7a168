"""`pallas_loop.Options`: how `iterate` runs (never what it computes).

One frozen, validated value holds the seven how-to-run choices, so
`iterate`, `deq.fixed_point`, `testing.check_against_reference` and
`tuning.tune_block_rows` take it as one keyword and forward it whole, and
the internals (`dispatch.py`) read it as it came. Being frozen and hashable,
it is a valid static value under `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

from pallas_loop._src.kernels import backend_interpret
from pallas_loop._src.kernels.schedule import SCHEDULES

IMPLEMENTATIONS = (None, "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class Options:
  """How `pallas_loop.iterate` runs: implementation, tiling, kernel details.

  The fields choose speed and where the work runs, not what is computed:
  results agree to rounding across them (the tests hold each to the
  reference), except that `approx_tanh` picks a GPU `tanh` and a TPU
  logistic of bounded error.
  Every field has the default `iterate` uses and is checked when the
  `Options` is built (a bad value fails there, naming the field). The value
  is frozen and hashable, so it can be a static argument of `jax.jit`;
  `options.replace(block_rows=64)` makes a changed copy (checked again).

  Attributes:
    implementation: None (auto: the Pallas kernel on GPU/TPU when the step
      fits its rules, else XLA with a one-time warning saying why; XLA on
      CPU), "pallas" (the kernel; interpret mode on CPU; an error, never a
      silent fallback, if it cannot run) or "xla".
    interpret: run the kernel in Pallas interpret mode. None: only where no
      compiled backend exists (CPU). Interpret mode applies a target's rules
      (declines what its kernel declines, evaluates the step as it does):
      True or "tpu" the TPU's, "gpu" the GPU's; a `pltpu.InterpretParams()`
      interprets with TPU semantics under the TPU's rules. False: never
      (`implementation="pallas", interpret=False` then needs a GPU or TPU).
    block_rows: rows per kernel tile, a positive int, or None (default
      chosen per backend: at least 256 tiles of 16 to 64 rows with Triton,
      at least 4 tiles of 128 to 1024 rows on TPU, 32 in interpret mode;
      `pallas_loop.tuning.tune_block_rows` times the candidates).
    sort_rows: order rows by descending count before tiling so each tile's
      rows finish together.
    schedule: how GPU kernel programs take their tiles: None (the backend's
      default, "grid"), "grid" (one program per tile) or "persistent" (one
      program per SM, each taking tiles longest first); see the docs'
      "Implementations" page, "Schedule".
    hoist: compute the step's state-independent part once, outside the
      loop: work that depends only on `params`, the arrays `step` closes
      over and `x` (not on `h`, the key or the step index), e.g. `x @ U`,
      runs as one batched op over all rows before the loop, and is
      differentiated there. False recomputes it at every step. See the
      docs' "Performance" page for what is hoisted.
    approx_tanh: how the GPU (Triton) kernels compute a float32 `tanh`:
      with the hardware's `tanh.approx.f32` (one instruction; relative
      error at most 2^-11, below a 16-bit float's rounding) or libdevice's
      `tanhf` (about 15). None (default): the approximation where every
      floating leaf of the state is 16-bit (bfloat16, float16), libdevice
      where any is wider; True/False: always/never. The same choice decides
      whether the TPU kernels compute the logistic (`jax.nn.sigmoid`) as
      `0.5 tanh(x / 2) + 0.5` (one transcendental instead of an exp and a
      reciprocal; off by up to 2.2e-5 on a v5e, where the exact one is
      off by 1.0e-6). The XLA implementation always uses its platform's
      own; interpret mode applies the approximations. See the docs'
      "Implementations" page, "Transcendentals on a GPU".

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> opts = pallas_loop.Options(implementation="pallas", block_rows=8)
    >>> opts
    Options(implementation='pallas', block_rows=8)
    >>> opts.replace(implementation="xla")
    Options(implementation='xla', block_rows=8)
    >>> step = lambda p, h, x: h * 2
    >>> pallas_loop.iterate(step, None, jnp.ones((3, 2)), iters=jnp.array([0, 1, 2]),
    ...                     max_iters=2, options=opts)[:, 0]
    Array([1., 2., 4.], dtype=float32)
    >>> pallas_loop.Options(schedule="fast")
    Traceback (most recent call last):
    ...
    ValueError: schedule='fast' must be None, 'grid' or 'persistent'.
  """

  implementation: str | None = None
  interpret: Any = None
  block_rows: int | None = None
  sort_rows: bool = True
  schedule: str | None = None
  hoist: bool = True
  approx_tanh: bool | None = None

  def __post_init__(self) -> None:
    implementation, interpret = self.implementation, self.interpret
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}.")
    backend_interpret.check_option(interpret)  # the targets' names and objects
    if implementation == "xla" and interpret not in (None, False):
      raise ValueError("interpret= applies to the Pallas kernel; it has no "
                       "meaning with implementation='xla'.")
    block_rows = self.block_rows
    if block_rows is not None:
      try:
        if isinstance(block_rows, bool):  # an int to operator.index
          raise TypeError
        block_rows = operator.index(block_rows)
      except TypeError:
        raise TypeError(f"{block_rows=} must be a positive int or None.") from None
      if block_rows < 1:
        raise ValueError(f"{block_rows=} must be a positive int or None.")
      # A NumPy integer becomes a Python int: equal Options hash alike.
      object.__setattr__(self, "block_rows", int(block_rows))
    if not isinstance(self.sort_rows, bool):
      raise TypeError(f"sort_rows={self.sort_rows!r} must be a bool.")
    if self.schedule is not None and self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r} must be None, 'grid' or 'persistent'.")
    if not isinstance(self.hoist, bool):
      raise TypeError(f"hoist={self.hoist!r} must be a bool.")
    if self.approx_tanh is not None and not isinstance(self.approx_tanh, bool):
      raise TypeError(f"approx_tanh={self.approx_tanh!r} must be None, True or False.")

  def replace(self, **changes: Any) -> Options:
    """A copy with `changes` applied (and checked), like `dataclasses.replace`.

    Args:
      **changes: new values of fields, by name.

    Returns:
      The changed `Options`.

    Examples:
      >>> import pallas_loop
      >>> pallas_loop.Options(block_rows=8).replace(sort_rows=False)
      Options(block_rows=8, sort_rows=False)
    """
    return dataclasses.replace(self, **changes)

  def __repr__(self) -> str:
    # Only what differs from the defaults: what a caller chose, and what
    # they would type to build it again.
    chosen = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
              if getattr(self, f.name) != f.default]
    return f"Options({', '.join(chosen)})"


FIELDS = tuple(f.name for f in dataclasses.fields(Options))


def check_options(options: Any) -> Options:
  """`options` (None: the defaults) as an `Options`, or a TypeError saying
  how to build one."""
  if options is None:
    return Options()
  if not isinstance(options, Options):
    hint = (f"pallas_loop.Options(**{dict(options)!r})" if isinstance(options, Mapping)
            else "pallas_loop.Options(...)")
    raise TypeError(f"options must be a pallas_loop.Options or None, got "
                    f"{type(options).__name__}: pass options={hint}.")
  return options


def reject_keywords(where: str, kwargs: Mapping[str, Any]) -> None:
  """Raises the TypeError for keywords `where` does not take: for the
  how-to-run options `iterate` took before `Options`, one that shows the
  new spelling; for anything else, Python's own wording."""
  old = {name: value for name, value in kwargs.items() if name in FIELDS}
  if old:
    spelled = ", ".join(f"{name}={value!r}" for name, value in old.items())
    what = "is no longer a keyword" if len(old) == 1 else "are no longer keywords"
    raise TypeError(f"{where}({spelled}) {what}: pass "
                    f"options=pallas_loop.Options({spelled}).")
  for name in kwargs:
    raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
