"""Loop-invariant hoisting: the step's state-independent work, once, outside the loop.

Legend:  B: rows of the batch   R: rows of a tile (any count)   B2: a second row count

The loop body `(params, h, x, t, rows, index) -> (h_new, y, flag)` often does
work that depends only on `params`, its closed-over constants and `x`: the
input projection `x @ U` of an RNN or GRU, `softplus(params)`. Inside the loop
that work is redone at every step. `split` finds it: it traces the body at
the batch shape, inlines nested `jit`s, and marks every value that depends on
`h`, `t`, `rows` or `index` (so on the state, the per-row key and the step
index) as variant. Of the invariant values the loop needs, those worth
computing once become *residuals*; the cheap ones (broadcasts, iota, converts,
reshapes, adds) stay in the loop and are recomputed there from their inputs,
so hoisting never turns a broadcast of `x` into a large per-row input.

A residual is an invariant value produced by a `dot_general`, a convolution,
a transcendental (`exp`, `tanh`, `logistic`, `log`, `pow`, ...), a reduction,
or a higher-order primitive containing one, of a floating dtype, and

  * per-row (it depends on `x`): its row axis leading, and at most as many
    elements per row as the state and `x` have together; or
  * shared (it does not depend on `x`): no more elements than the largest
    of `params` and the constants.

A value that fails these tests is recomputed in the loop. The row axis is
found by tracing the body at a second row count B2: the only axis whose size
follows the row count.

`Hoisted.residuals` computes the residuals as batched XLA ops over all rows
(`x @ U` is one [B, D] x [D, D] GEMM), outside the loop and the custom_vjp, so
JAX differentiates them; `Hoisted.body` is the loop body that reads them (per-
row residuals as extra `x` leaves, shared ones as extra `params`) instead of
recomputing them. The body is retraced at each tile's row count and split the
same way: the split is a function of the jaxpr's structure, checked equal at
B and B2.

Steps with effects, steps whose jaxpr depends on the row count, and steps
with nothing worth hoisting run unhoisted; the reason is logged at DEBUG
level on the `pallas_loop` logger and kept in `Decision.reason`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Callable

import jax
from jax import tree_util
from jax._src import source_info_util
from jax.extend import core as jex_core
import numpy as np

from pallas_loop._src.step import step_fn as step_fn_lib

logger = logging.getLogger("pallas_loop")

_INLINED = ("jit", "pjit", "closed_call", "core_call")

# Primitives whose invariant results are worth a residual: matrix products,
# transcendentals, reductions (each costs more than reading its result).
_WORTH = frozenset((
    "dot_general", "conv_general_dilated", "ragged_dot_general",
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
    "sinh", "cosh", "asinh", "acosh", "atanh",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac",
    "bessel_i0e", "bessel_i1e", "pow", "sqrt", "rsqrt", "cbrt",
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "fft", "triangular_solve", "cholesky", "sort", "top_k",
))


@dataclasses.dataclass(frozen=True)
class _Lit:
  """A literal operand of a flattened equation."""

  val: Any


@dataclasses.dataclass(frozen=True)
class _Node:
  """One equation of the flattened body, its operands and results as value ids."""

  eqn: Any
  ins: tuple   # int ids or _Lit
  outs: tuple  # int ids


@dataclasses.dataclass(frozen=True)
class _Program:
  """The body's jaxpr with nested jits inlined, values numbered in order.

  Numbering is positional, so two traces of the same step at different row
  counts number the same values alike (checked by `signature`).
  """

  inputs: tuple      # ids of constvars + invars
  nodes: tuple       # _Node
  outputs: tuple     # ids or _Lit
  avals: dict        # id -> aval
  out_tree: Any
  consts: tuple      # the traced constants' values (the constvars' operands)

  def signature(self) -> tuple:
    """The structure without shapes: primitives and the operands' ids."""
    mark = lambda a: "lit" if isinstance(a, _Lit) else a
    return (len(self.inputs), tuple(mark(a) for a in self.outputs),
            tuple((n.eqn.primitive.name, tuple(mark(a) for a in n.ins), n.outs)
                  for n in self.nodes))


def _trace(body: Callable, params: Any, h: Any, x: Any) -> _Program:
  """Traces `body` at the avals `params`, `h`, `x` and flattens it."""
  closed, out_shape = jax.make_jaxpr(body, return_shape=True)(
      params, h, x, *step_fn_lib.row_index_avals(h))
  counter = itertools.count()
  avals: dict[int, Any] = {}
  nodes: list[_Node] = []

  def new(aval: Any) -> int:
    i = next(counter)
    avals[i] = aval
    return i

  def walk(jaxpr: Any, in_atoms: list) -> list:
    env = dict(zip((*jaxpr.constvars, *jaxpr.invars), in_atoms))
    read = lambda a: _Lit(a.val) if isinstance(a, jex_core.Literal) else env[a]
    for eqn in jaxpr.eqns:
      ins = [read(a) for a in eqn.invars]
      inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
      if inner is not None and not getattr(inner, "consts", ()) and not inner.jaxpr.constvars:
        outs = walk(inner.jaxpr, ins)
      else:
        outs = [new(v.aval) for v in eqn.outvars]
        nodes.append(_Node(eqn, tuple(ins), tuple(outs)))
      env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]

  jaxpr = closed.jaxpr
  inputs = [new(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars)]
  outputs = walk(jaxpr, inputs)
  return _Program(tuple(inputs), tuple(nodes), tuple(outputs), avals,
                  tree_util.tree_structure(out_shape), tuple(closed.consts))


def _evaluate(program: _Program, which: list[int], env: dict[int, Any]) -> None:
  """Binds the nodes `which` (indices, in order), reading and writing `env`."""
  read = lambda a: a.val if isinstance(a, _Lit) else env[a]
  for k in which:
    node = program.nodes[k]
    eqn = node.eqn
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
      ans = eqn.primitive.bind(*map(read, node.ins), **bind_params)
    env.update(zip(node.outs, ans if eqn.primitive.multiple_results else [ans]))


def _worth(eqn: Any) -> bool:
  """Whether an invariant result of `eqn` is worth a residual."""
  if eqn.primitive.name in _WORTH:
    return True
  return any(_worth(inner) for sub in jex_core.jaxprs_in_params(eqn.params)
             for inner in sub.eqns)


def _size(shape: tuple) -> int:
  return int(np.prod(shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Decision:
  """Whether and what `split` hoists, for logs and tests.

  Attributes:
    hoisted: whether the loop runs the hoisted body.
    reason: why not (empty when hoisted).
    shared: avals of the row-independent residuals (at the batch shape).
    per_row: avals of the per-row residuals ([B, ...]).
  """

  hoisted: bool
  reason: str = ""
  shared: tuple = ()
  per_row: tuple = ()


@dataclasses.dataclass(frozen=True)
class Hoisted:
  """A body split into its invariant residuals and the loop's rest.

  Attributes:
    body: the loop body `(params2, h, x2, t, rows, index) -> (h_new, y,
      flag)` with `params2 = (params, shared residuals)` and `x2 = (x,
      per-row residuals)`; it recomputes nothing that a residual holds.
    decision: what was hoisted.
  """

  body: Callable[..., Any]
  decision: Decision
  _program: _Program
  _known: tuple      # node indices computing the residuals
  _shared: tuple     # residual ids, row-independent
  _per_row: tuple    # residual ids, [B, ...]
  _n_h: int          # leaves of the state (the inputs between params and x)
  _params_read: tuple  # per params leaf: read by the loop
  _x_read: tuple       # per x leaf: read by the loop

  @property
  def consts(self) -> tuple:
    """The values of the constants the residuals read (the traced body's)."""
    return self._program.consts

  def operands(self, params: Any, x: Any, consts: Any = None) -> tuple[Any, Any]:
    """The hoisted body's `(params2, x2)` for the operands `params`, `x`.

    `params2 = (params leaves the loop reads, shared residuals)` and
    `x2 = (x leaves the loop reads, per-row residuals)`, leaves the loop does
    not read as None. The residuals are computed here as batched ops over
    the rows of `x`, outside the loop and its custom_vjp, so JAX
    differentiates them. `consts` replaces the values of `self.consts`
    (None: those found by the trace), so that a caller can pass them in as
    operands (e.g. of the shard_map that runs each device's rows).
    """
    shared, per_row = self.residuals(params, x, consts)
    keep = lambda leaves, read: [v if r else None for v, r in zip(leaves, read)]
    return ((keep(tree_util.tree_leaves(params), self._params_read), shared),
            (keep(tree_util.tree_leaves(x), self._x_read), per_row))

  def residuals(self, params: Any, x: Any, consts: Any = None) -> tuple[list, list]:
    """The residuals as batched ops over all rows: (shared, per-row) lists."""
    p = self._program
    consts = p.consts if consts is None else consts
    n_front = len(p.consts) + len(tree_util.tree_leaves(params))
    x_leaves = tree_util.tree_leaves(x)
    env = dict(zip(p.inputs[:n_front], [*consts, *tree_util.tree_leaves(params)]))
    env.update(zip(p.inputs[n_front + self._n_h:], x_leaves))  # the state is not read
    _evaluate(p, list(self._known), env)
    return [env[i] for i in self._shared], [env[i] for i in self._per_row]


def _rows_of(shape_b: tuple, shape_b2: tuple, b: int, b2: int) -> int | None:
  """The row axis of a value shaped `shape_b` at B rows and `shape_b2` at B2
  rows: the one axis that follows the row count; None if there is no such
  single axis."""
  if len(shape_b) != len(shape_b2):
    return None
  moved = [a for a, (m, n) in enumerate(zip(shape_b, shape_b2)) if m != n]
  if len(moved) != 1 or (shape_b[moved[0]], shape_b2[moved[0]]) != (b, b2):
    return None
  return moved[0]


def _not_hoisted(reason: str) -> Decision:
  logger.debug("pallas_loop.iterate: the step runs unhoisted: %s", reason)
  return Decision(hoisted=False, reason=reason)


def split(body: Callable[..., Any], params: Any, h0: Any,
          x: Any) -> tuple[Hoisted | None, Decision]:
  """Splits `body` into its state-independent residuals and the loop's rest.

  Args:
    body: the loop body `(params, h, x, t, rows, index) -> (h_new, y, flag)`
      (`step_fn.with_halt`).
    params, h0, x: the operands of `iterate` (h0's and x's leaves [B, ...]).

  Returns:
    `(hoisted, decision)`: `hoisted` is None when nothing is hoisted
    (`decision.reason` says why; also logged at DEBUG level).

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_loop._src.step import hoist
    >>> from pallas_loop._src.step import step_fn
    >>> step = lambda u, h, x: jnp.tanh(h + x @ u)
    >>> body = step_fn.with_halt(step, None)
    >>> hoisted, decision = hoist.split(body, jnp.eye(4), jnp.ones((8, 4)), jnp.ones((8, 4)))
    >>> [a.shape for a in decision.per_row]
    [(8, 4)]
  """
  batch = tree_util.tree_leaves(h0)[0].shape[0]
  b2 = 2 * batch if batch else 1
  avals = step_fn_lib.avals
  program = _trace(body, avals(params), avals(h0), avals(x))
  if any(n.eqn.effects for n in program.nodes):
    return None, _not_hoisted("the step has effects")
  try:
    other = _trace(body, avals(params), avals(h0, b2), avals(x, b2))
  except Exception as e:  # noqa: BLE001 - hoisting is an optimisation: say why, run unhoisted
    return None, _not_hoisted(f"the step does not trace at {b2} rows ({type(e).__name__}: {e})")
  if other.signature() != program.signature():
    return None, _not_hoisted("the step's jaxpr depends on the row count")

  n_consts = len(program.consts)
  n_params = len(tree_util.tree_leaves(params))
  n_h = len(tree_util.tree_leaves(h0))
  n_x = len(tree_util.tree_leaves(x))
  ins = program.inputs
  x_ids = set(ins[n_consts + n_params + n_h:n_consts + n_params + n_h + n_x])
  variant = set(ins[n_consts + n_params:n_consts + n_params + n_h]) | set(
      ins[n_consts + n_params + n_h + n_x:])
  on_x = set(x_ids)
  on_inputs = set(ins)
  producer: dict[int, int] = {}
  for k, node in enumerate(program.nodes):
    ids = [a for a in node.ins if not isinstance(a, _Lit)]
    if any(a in variant for a in ids):
      variant.update(node.outs)
    if any(a in on_x for a in ids):
      on_x.update(node.outs)
    if any(a in on_inputs for a in ids):
      on_inputs.update(node.outs)
    producer.update((o, k) for o in node.outs)

  per_row_leaf = lambda tree: sum(_size(np.shape(a)[1:]) for a in tree_util.tree_leaves(tree))
  row_budget = per_row_leaf(h0) + per_row_leaf(x)
  shared_sizes = [_size(np.shape(a)) for a in (*program.consts, *tree_util.tree_leaves(params))]
  shared_budget = max(shared_sizes, default=0)

  def kind(i: int) -> str | None:
    """'shared', 'per_row' or None (recompute in the loop) for invariant value i."""
    node = program.nodes[producer[i]]
    aval = program.avals[i]
    if not _worth(node.eqn) or not jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
      return None
    if i not in on_inputs:
      # A constant (`jnp.sqrt(d)` of attention's scaling): the kernels compute
      # it while tracing (`jaxpr_eval._folds`); as a residual it would be a
      # parameter whose gradient the backward kernel sums to a scalar.
      return None
    shape, shape2 = tuple(aval.shape), tuple(other.avals[i].shape)
    if i not in on_x:
      return "shared" if shape == shape2 and _size(shape) <= shared_budget else None
    if _rows_of(shape, shape2, batch, b2) != 0 or _size(shape[1:]) > row_budget:
      return None  # a row axis not leading, or a blow-up: recompute it in the loop
    return "per_row"

  # What the loop needs of the invariant values: walk back from the variant
  # equations and the outputs; a residual ends the walk, a cheap value pulls
  # its equation into the loop.
  in_loop = {k for k, n in enumerate(program.nodes) if n.outs and n.outs[0] in variant}
  in_loop |= {k for k, n in enumerate(program.nodes) if not n.outs}
  inputs = set(ins)
  residual: dict[int, str] = {}
  seen: set[int] = set()
  stack = [a for k in sorted(in_loop) for a in program.nodes[k].ins if not isinstance(a, _Lit)]
  stack += [a for a in program.outputs if not isinstance(a, _Lit)]
  stack.reverse()
  while stack:
    i = stack.pop()
    if i in seen or i in variant or i in inputs:
      continue
    seen.add(i)
    found = kind(i)
    if found is not None:
      residual[i] = found
      continue
    k = producer[i]
    in_loop.add(k)
    stack.extend(a for a in reversed(program.nodes[k].ins) if not isinstance(a, _Lit))
  if not residual:
    return None, _not_hoisted("nothing state-independent is worth hoisting")

  shared = tuple(sorted(i for i, k in residual.items() if k == "shared"))
  per_row = tuple(sorted(i for i, k in residual.items() if k == "per_row"))
  known: set[int] = set()
  stack = list(residual)
  while stack:
    i = stack.pop()
    if i in inputs or producer[i] in known:
      continue
    known.add(producer[i])
    stack.extend(a for a in program.nodes[producer[i]].ins if not isinstance(a, _Lit))
  loop_nodes = sorted(in_loop)
  signature = program.signature()
  # The loop's operands: the params and x leaves it reads (the others, e.g.
  # `U` and `x` of `x @ U`, are None: the kernel does not load them).
  read = {a for k in loop_nodes for a in program.nodes[k].ins if not isinstance(a, _Lit)}
  read |= {a for a in program.outputs if not isinstance(a, _Lit)}
  params_leaves, params_tree = tree_util.tree_flatten(params)
  x_leaves, x_tree = tree_util.tree_flatten(x)
  params_read = tuple(ins[n_consts + k] in read for k in range(n_params))
  x_read = tuple(ins[n_consts + n_params + n_h + k] in read for k in range(n_x))
  params_avals = avals(params_leaves)
  x_avals = avals(x_leaves)

  def hoisted_body(params2, h, x2, t, rows, index):
    (params_read_leaves, shared_res), (x_read_leaves, row_res) = params2, x2
    r = tree_util.tree_leaves(h)[0].shape[0]
    params_ = [v if keep else a for v, a, keep in
               zip(params_read_leaves, params_avals, params_read)]
    x_ = [v if keep else jax.ShapeDtypeStruct((r,) + a.shape[1:], a.dtype)
          for v, a, keep in zip(x_read_leaves, x_avals, x_read)]
    here = _trace(body, tree_util.tree_unflatten(params_tree, avals(params_)), avals(h),
                  tree_util.tree_unflatten(x_tree, avals(x_)))
    if here.signature() != signature:
      raise ValueError(
          "pallas_loop.iterate: the step's jaxpr differs between row counts, so its "
          "hoisted state-independent part does not apply at this tile; pass "
          "options=pallas_loop.Options(hoist=False).")
    flat = [*here.consts, *params_, *tree_util.tree_leaves(h), *x_,
            *tree_util.tree_leaves((t, rows, index))]
    env = {i: v for i, v in zip(here.inputs, flat) if i in read}
    env.update(zip(shared, shared_res))
    env.update(zip(per_row, row_res))
    _evaluate(here, loop_nodes, env)
    outs = [a.val if isinstance(a, _Lit) else env[a] for a in here.outputs]
    return tree_util.tree_unflatten(here.out_tree, outs)

  decision = Decision(hoisted=True,
                      shared=tuple(program.avals[i] for i in shared),
                      per_row=tuple(program.avals[i] for i in per_row))
  logger.debug("pallas_loop.iterate: hoisted %d shared and %d per-row residuals out of the "
               "loop: %s", len(shared), len(per_row), decision)
  return (Hoisted(hoisted_body, decision, program, tuple(sorted(known)), shared, per_row, n_h,
                  params_read, x_read), decision)
