"""What a kernel program holds on chip, read off the step's traced jaxpr.

The backends' configuration rules (`backend_triton.configure`,
`backend_mosaic_tpu.configure`) decide from this how many warps a program
gets, whether the shared operands (params and the step's constants) stay on
chip across steps or are re-read where each use needs them, and whether any
configuration fits at all. Sizes are those the kernel really computes with:
a dot's operands in the one dtype the kernel gives them (`jaxpr_eval.py`
casts the narrower one to the wider).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from jax.extend import core as jex_core

from pallas_loop._src.step import jaxpr_eval

# Higher-order primitives whose body is an inlined call: operands map 1:1 to
# the body's inputs, so provenance is followed through them.
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "remat", "checkpoint")


@dataclasses.dataclass(frozen=True)
class Dot:
  """One `dot_general` of the kernel, at the tile's shapes.

  Attributes:
    lhs, rhs: operand shapes.
    itemsizes: bytes per element of each operand as the kernel stages it: a
      row operand in the dot's one dtype (`jaxpr_eval.py` casts the narrower
      operand to the wider), a shared operand in its own dtype (measured:
      Triton stages a loaded bfloat16 weight as bfloat16 and widens it
      after; but see `Footprint.shared_dot_bytes`).
    lhs_shared, rhs_shared: whether the operand is computed from the shared
      operands alone (a weight, or a cast/transpose of one), not from rows.
    flops: 2 * output elements * contracted size.
    roots: for each shared operand, the shared input (or constant) it is
      computed from (a cast or transpose keeps its root); None for a row
      operand.
  """

  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  itemsizes: tuple[int, int]
  lhs_shared: bool
  rhs_shared: bool
  flops: int
  split_axis: int | None = None  # rhs is a shared operand itself, contracted on this axis
  wide_itemsize: int = 4
  out: tuple[int, ...] = ()
  contracts_rows: bool = False  # sums over the tile's rows: a weight gradient
  roots: tuple[Any, Any] = dataclasses.field(default=(None, None), compare=False)

  @property
  def accumulator_bytes(self) -> int:
    """The output as the dot accumulates it (float32)."""
    return math.prod(self.out) * 4

  @property
  def operand_bytes(self) -> tuple[int, int]:
    return (math.prod(self.lhs) * self.itemsizes[0], math.prod(self.rhs) * self.itemsizes[1])

  def staged_bytes(self, split_budget: int | None) -> int:
    """Both operands as staged when the weight is re-read: in K chunks where
    the kernel splits the dot (`jaxpr_eval.split_parts`), else whole."""
    if self.split_axis is None or len(self.rhs) != 2:
      return sum(self.operand_bytes)
    k, n = self.rhs[self.split_axis], self.rhs[1 - self.split_axis]
    parts = jaxpr_eval.split_parts(k, n, self.wide_itemsize, split_budget)
    return sum(self.operand_bytes) // parts


@dataclasses.dataclass(frozen=True)
class Footprint:
  """The on-chip needs of one kernel program.

  Attributes:
    batch: B, the rows of the whole call.
    block_rows: rows per tile.
    dots: every dot of the step (and of its VJP, for the backward kernel).
    largest_row_value_bytes: the largest [TB, ...] value the program
      computes, counted as float32 (layout conversions and cross-warp
      reductions stage such values in shared memory).
    shared_bytes: bytes of all shared operands as stored.
    block_bytes: bytes of every block one program reads or writes (its
      tiles of the row operands plus the whole shared operands), once.
    row_bytes: bytes one row's blocks take (what a batched XLA step reads
      and writes per row).
    blocks: (shape, dtype name) of every block one program reads or writes:
      for backends that lay blocks out in padded tiles (Mosaic's VMEM).
    values: (shape, dtype name, first, last) of every array the program
      computes (each equation's outputs, in the traced jaxprs and the
      bodies they call): alive from position `first` to `last` of the
      program in order (`peak_live_bytes`).
  """

  batch: int
  block_rows: int
  dots: tuple[Dot, ...]
  largest_row_value_bytes: int
  shared_bytes: int
  block_bytes: int
  row_bytes: int
  blocks: tuple[tuple[tuple[int, ...], str], ...] = ()
  values: tuple[tuple[tuple[int, ...], str, int, int], ...] = ()

  @property
  def tiles(self) -> int:
    return -(-self.batch // self.block_rows)

  def flops(self) -> int:
    """FLOPs of the dots of one tile-step."""
    return sum(d.flops for d in self.dots)

  def shared_dot_bytes(self) -> int:
    """Bytes of the shared dot operands, per dot: what holding them costs.

    A held weight is loop-invariant, and so is its cast to a dot's wider
    dtype: where no dot uses the weight at its own width, Triton hoists the
    cast with the staging and keeps the weight in shared memory widened
    (measured: the implicit adjoint's GRU step at D=128, float32 cotangents
    against bfloat16 weights, staged its three [128, 128] weights as float32,
    200 KB). A weight some dot also uses at its own width (the backward
    kernel's recomputed forward step) stays staged at it (the tanh RNN's
    backward: 72 KB for two bfloat16 weights).
    """
    operands = [(d, shape, size, root)
                for d in self.dots
                for shape, size, root, s in zip((d.lhs, d.rhs), d.itemsizes, d.roots,
                                                (d.lhs_shared, d.rhs_shared)) if s]
    own_width = {id(root) for d, _, size, root in operands if size == d.wide_itemsize}
    return sum(math.prod(shape) * (size if id(root) in own_width else d.wide_itemsize)
               for d, shape, size, root in operands)

  def largest_dot_bytes(self, split_budget: int | None = None) -> int:
    """Both operands of the largest dot: what staging one dot costs (re-read
    weights split into chunks of `split_budget` bytes, see `Dot`)."""
    return max((d.staged_bytes(split_budget) for d in self.dots), default=0)

  def largest_gradient_accumulator_bytes(self) -> int:
    """The largest output of a dot that sums over the tile's rows (a weight
    gradient in the backward kernel), as a float32 accumulator; 0 if none."""
    return max((d.accumulator_bytes for d in self.dots if d.contracts_rows), default=0)

  def peak_live_bytes(self, size: Callable[[tuple[int, ...], str], int]) -> int:
    """The most bytes of computed values alive at once, each `size(shape,
    dtype)` bytes (a backend's layout: Mosaic pads to (8, 128) tiles).

    A value is alive from the equation that computes it to the last one
    that reads it (to the end for an output). Straight-line code keeps
    them all (a VJP keeps the forward's residuals until their cotangents
    are computed: multi-head attention's [TB, H, L, L] probabilities and
    [TB, L, H, K] heads); values of a loop or branch body count over the
    whole body, an over-estimate.

    Example:
      >>> fp = Footprint(1, 1, (), 0, 0, 0, 0, values=(((4,), "float32", 0, 2),
      ...                                               ((8,), "float32", 1, 1),
      ...                                               ((2,), "float32", 3, 3)))
      >>> fp.peak_live_bytes(lambda shape, dtype: shape[0])
      12
    """
    events = []
    for shape, dtype, first, last in self.values:
      n = size(shape, dtype)
      events += [(first, 1, n), (last + 1, 0, -n)]  # frees before allocations
    peak = live = 0
    for _, _, n in sorted(events):
      live += n
      peak = max(peak, live)
    return peak

  def largest_row_operand_bytes(self) -> int:
    """The largest dot operand computed from rows (staged per dot either way)."""
    return max((b for d in self.dots for b, s in zip(d.operand_bytes, (d.lhs_shared, d.rhs_shared))
                if not s), default=0)


def _nbytes(aval: Any) -> int:
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _dot(eqn: jex_core.JaxprEqn, roots: tuple[Any, Any], rhs_direct: bool, rows: int) -> Dot:
  a: Any
  b: Any
  a, b = (v.aval for v in eqn.invars)
  shared = (roots[0] is not None, roots[1] is not None)
  (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
  sizes = [np.dtype(a.dtype).itemsize, np.dtype(b.dtype).itemsize]
  wide = max(sizes)
  staged = tuple(size if s else wide for size, s in zip(sizes, shared))
  contracted = math.prod(a.shape[i] for i in lc)
  # Mirrors `jaxpr_eval._split_dot`: a 2-D row operand contracted on its last
  # axis by a shared operand used as it is passed in (no cast or reshape).
  splittable = (rhs_direct and not lb and tuple(lc) == (1,) and len(a.shape) == 2
                and len(b.shape) == 2 and tuple(rc) in ((0,), (1,)))
  contracts_rows = any(
      not s and len(x.shape) > 0 and x.shape[0] == rows and 0 in c
      for x, s, c in ((a, shared[0], lc), (b, shared[1], rc)))
  out = tuple(eqn.outvars[0].aval.shape)  # type: ignore[attr-defined]
  return Dot(tuple(a.shape), tuple(b.shape), staged, shared[0], shared[1],
             2 * math.prod(out) * contracted,
             split_axis=rc[0] if splittable else None, wide_itemsize=wide,
             out=out, contracts_rows=contracts_rows, roots=roots)


def _walk(jaxpr: jex_core.Jaxpr, roots_in: list[Any], dots: list[Dot], largest: list[int],
          rows: int, top: bool = False) -> list[Any]:
  """Records the dots of `jaxpr`; returns the outputs' roots.

  A value's root is the shared input or constant it is computed from (the
  first such input of the equation that made it), or None where a row value
  enters it: what `Dot.roots` holds. `top`: the jaxpr the kernel evaluates,
  whose shared inputs stay refs read where used (inside inlined calls they
  arrive loaded).
  """
  root: dict[Any, Any] = {}
  for v, r in zip(jaxpr.invars, roots_in):
    root[v] = r
  for v in jaxpr.constvars:
    root[v] = v
  direct = {v for v, r in root.items() if r is not None} if top else set()

  def root_of(v: jex_core.Var | jex_core.Literal) -> Any:
    return v if isinstance(v, jex_core.Literal) else root.get(v)

  for eqn in jaxpr.eqns:
    ins = [root_of(v) for v in eqn.invars]
    for v in eqn.outvars:
      shape = getattr(v.aval, "shape", ())
      if shape and shape[0] == rows:
        largest[0] = max(largest[0], math.prod(shape) * 4)
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if eqn.primitive.name in _CALLS and sub is not None:
      sub = sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub
      outs = _walk(sub, ins, dots, largest, rows)
    else:
      for sub_jaxpr in jex_core.jaxprs_in_params(eqn.params):
        # A loop or branch inside the step: its operands' provenance is not
        # followed; counting all of them as shared over-estimates what
        # holding costs, never under-estimates it.
        _walk(sub_jaxpr, list(sub_jaxpr.invars), dots, largest, rows)
      if eqn.primitive.name == "dot_general":
        rhs = eqn.invars[1]
        dots.append(_dot(eqn, (ins[0], ins[1]),
                         not isinstance(rhs, jex_core.Literal) and rhs in direct, rows))
      made = None
      if all(r is not None for r in ins):
        made = next((r for v, r in zip(eqn.invars, ins)
                     if not isinstance(v, jex_core.Literal)), eqn.outvars[0])
      outs = [made] * len(eqn.outvars)
    for v, r in zip(eqn.outvars, outs):
      root[v] = r
  return [root_of(v) for v in jaxpr.outvars]


def _lifetimes(jaxpr: jex_core.Jaxpr, out: list, position: list[int]) -> None:
  """Appends (shape, dtype, first, last) of every array `jaxpr` computes
  (`Footprint.values`); `position` is the running program position."""
  first: dict[Any, tuple[tuple[int, ...], str, int]] = {}
  last: dict[Any, int] = {}
  for eqn in jaxpr.eqns:
    for sub in jex_core.jaxprs_in_params(eqn.params):
      _lifetimes(sub, out, position)
    here = position[0]
    position[0] += 1
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal) and v in first:
        last[v] = here
    for v in eqn.outvars:
      shape = tuple(getattr(v.aval, "shape", ()))
      dtype = getattr(v.aval, "dtype", None)
      if (shape and not isinstance(v, jex_core.DropVar)
          and isinstance(dtype, np.dtype)):  # not a typed key: no layout known
        first[v] = (shape, dtype.name, here)
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal) and v in first:
      last[v] = position[0]
  out.extend((shape, dtype, start, last.get(v, start))
             for v, (shape, dtype, start) in first.items())


def measure(jaxprs_and_shared: Iterable[tuple[jex_core.Jaxpr, int]], *, batch: int,
            block_rows: int, shared_avals: Sequence[Any],
            row_block_avals: Sequence[Any]) -> Footprint:
  """The footprint of a program that runs the given jaxprs.

  Args:
    jaxprs_and_shared: (jaxpr, number of leading invars that are shared
      operands) for each traced function the program runs; the jaxpr's
      constvars count as shared.
    batch: B.
    block_rows: rows per tile.
    shared_avals: avals (shape, dtype) of the shared operands.
    row_block_avals: avals of the program's row blocks (inputs and outputs),
      each with the tile's rows as its leading axis, or [S, TB, ...] buffers.
  """
  dots: list[Dot] = []
  largest = [0]
  values: list = []
  for jaxpr, n_shared in jaxprs_and_shared:
    _walk(jaxpr, [v if i < n_shared else None for i, v in enumerate(jaxpr.invars)], dots,
          largest, block_rows, top=True)
    _lifetimes(jaxpr, values, [0])
  shared_bytes = sum(_nbytes(a) for a in shared_avals)
  row_block_bytes = sum(_nbytes(a) for a in row_block_avals)
  return Footprint(
      batch=batch, block_rows=block_rows, dots=tuple(dots),
      largest_row_value_bytes=largest[0], shared_bytes=shared_bytes,
      block_bytes=shared_bytes + row_block_bytes,
      row_bytes=-(-row_block_bytes // block_rows),
      blocks=tuple((tuple(a.shape), np.dtype(a.dtype).name)
                   for a in list(shared_avals) + list(row_block_avals)),
      values=tuple(values))
