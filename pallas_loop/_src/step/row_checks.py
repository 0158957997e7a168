"""Trace-time checks of the step's jaxpr: rows stay rows, and tracing errors
that say what to do.

`iterate` runs the step on tiles of rows in count order (the kernel) or on
shrinking prefixes of the sorted batch (the XLA loop). A step that mixes rows
(`h.mean(0)`, `h.T @ h`, `jnp.roll(h, 1, 0)`) is therefore silently wrong on
every implementation, and a step that closes over a per-row array fails later
with a shape error about an internal tile size. Both show in the jaxpr of the
step traced at the batch shape, so they are caught there, before any loop is
built (`check_step_jaxpr`).

How. Every value of the jaxpr gets an abstract *row layout*, propagated
equation by equation from the inputs (h, x and the row-index operands have
their rows on axis 0; params and closed-over arrays have none):

  * `Row(axis, inner)`: axis `axis` indexes rows; `inner > 1` when that axis
    is the row axis merged with trailing axes by a reshape ([B, L, D] ->
    [B*L, D]: element i of the axis belongs to row i // inner), which stays
    row-independent until something reduces, slices or reorders that axis.
  * `None`: no row axis. Such a value also records the axes along which it
    carries a params leaf's or closed-over array's data of exactly B entries
    (`ext`): lining one of those up with the row axis in an elementwise op is
    per-row data smuggled past `x`.
  * `UNKNOWN`: an operation the checker does not model produced it (a
    callback, an exotic gather): nothing downstream of it is checked. The
    checker is conservative: it flags only operations it understands, on
    operands whose layout it knows.

An operation that reduces, contracts, sorts, reverses, slices, pads,
concatenates, scans cumulatively, gathers or scatters by position along the
row axis, splits the row axis or merges it with a leading axis, pairs two row
axes (`h @ h.T`) or returns the state with its rows off axis 0 raises a
`ValueError` naming the operation, the source line and the fix. Nested jaxprs
(jit, custom_jvp/vjp, remat, cond, while, scan) are followed; a while loop's
condition is not checked (vmapped while loops reduce their per-row
predicates over the rows by construction).

`explain_trace_error` turns the errors that tracing the step raises on first
contact (jax.random on the per-row keys, a 1-D `h0`) into ones that say what
to do.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from typing import Any, Sequence

import jax
from jax import tree_util
from jax.extend import core as jex_core
import numpy as np

_source_info: Any
try:  # the user's source line in the messages; private, so optional
  _source_info = importlib.import_module("jax._src.source_info_util")
except ImportError:  # pragma: no cover
  _source_info = None


@dataclasses.dataclass(frozen=True)
class Row:
  """Axis `axis` indexes rows (each row owns `inner` consecutive entries)."""

  axis: int
  inner: int = 1


class _Unknown:
  """The layout of a value produced by an operation the checker does not model."""

  def __repr__(self) -> str:
    return "UNKNOWN"


UNKNOWN = _Unknown()


@dataclasses.dataclass(frozen=True)
class _Val:
  row: Any = None                       # Row | None | UNKNOWN
  ext: frozenset = frozenset()          # axes carrying outside per-row-sized data
  origin: str = ""                      # what the ext data is (for messages)


_FREE = _Val()
_LOST = _Val(row=UNKNOWN)
# Leads the `origin` of random bits drawn over the rows from a shared key.
_RANDOM = "\0random:"


@dataclasses.dataclass
class Analysis:
  """What `analyze` found.

  Attributes:
    outputs: the layout of each output of the jaxpr (`Row`, None, UNKNOWN).
    unknown_primitives: the primitives whose outputs got UNKNOWN layouts
      because the checker does not model them (or not with these params).
    random_rows: per output, "" or, when its axis 0 holds random bits drawn
      from a key shared by every row (one draw per position in the group of
      rows), what drew them.
  """

  outputs: list
  unknown_primitives: set
  random_rows: list = dataclasses.field(default_factory=list)


class RowMixingError(ValueError):
  """The step treats rows together (or smuggles per-row data past `x`)."""


class SharedKeyError(RowMixingError):
  """The step draws random bits over the rows from a key shared by every row."""


# ---------------------------------------------------------------------------
# Helpers.


def _shape(v) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def _describe_aval(v) -> str:
  aval = v.aval
  dtype = getattr(aval, "dtype", None)
  return f"{dtype}{list(getattr(aval, 'shape', ()))}"


def _where(eqn) -> str:
  if _source_info is None:
    return ""
  try:
    text = _source_info.summarize(eqn.source_info)
  except Exception:  # pylint: disable=broad-except  # only decorates a message
    return ""
  return f" at {text}" if text else ""


# The package's own folder (pallas_loop/), wherever this module sits in it.
_LIBRARY_DIRS = ("site-packages", "dist-packages",
                 os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep + "_src", 1)[0])


def _user_where(eqn) -> str:
  """" at file:line" of the innermost frame of the user's own code (not an
  installed library such as Flax or Haiku, not this package), or ""."""
  traceback = getattr(eqn.source_info, "traceback", None)
  for frame in getattr(traceback, "frames", None) or ():
    name = frame.file_name
    if not any(d in name for d in _LIBRARY_DIRS) and not name.startswith("<frozen"):
      return f" at {name}:{frame.line_num}"
  return ""


def _prefix(shape: Sequence[int], k: int) -> int:
  return int(np.prod(shape[:k], dtype=np.int64))


def _sub_jaxprs(params: dict):
  """(name, jaxpr, consts) for each jaxpr-valued param of an equation."""
  found = []
  for name, p in params.items():
    if isinstance(p, jex_core.ClosedJaxpr):
      found.append((name, p.jaxpr, list(p.consts)))
    elif isinstance(p, jex_core.Jaxpr):
      found.append((name, p, []))
  return found


# Params that tie an operation to specific axes: an equation with one of them
# is never treated as elementwise.
_AXIS_PARAMS = frozenset({
    "axes", "axis", "dimension", "dimensions", "permutation", "dimension_numbers",
    "new_sizes", "broadcast_dimensions", "start_indices", "limit_indices",
    "strides", "slice_sizes", "padding_config", "window_dimensions", "fft_lengths",
    "sizes", "shape", "k", "axis_name", "axis_index_groups", "split_axis",
    "concat_axis", "lhs_shape", "rhs_shape",
})
# Not modelled: callbacks hide their body; the others' nested jaxprs work on
# refs, devices or shards, not on the values they are given.
_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "callback",
                        "pallas_call", "shard_map", "xla_pmap", "run_state",
                        "custom_partitioning"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


# ---------------------------------------------------------------------------
# The abstract interpreter.


class _Checker:
  """Propagates row layouts through one jaxpr (and its nested ones)."""

  def __init__(self, batch: int, hint: str):
    self.batch = batch
    self.hint = hint                # prepended to messages (a 1-D h0)
    self.unknown: set = set()
    self.outer_where = ""           # where the enclosing call is (jnp internals have none)
    self.outer_user = ""            # the line of the user's own code that made it

  # -- errors -----------------------------------------------------------------

  def fail(self, eqn, problem: str, fix: str, example: str = "") -> None:
    what = f"{eqn.primitive.name}{_where(eqn) or self.outer_where}"
    lines = [f"step {problem} ({what}): {fix}"]
    if self.hint:
      lines = [f"{self.hint}; step {problem} ({what})."]
    if example:
      lines.append(f"This is what e.g. {example} traces to.")
    lines.append(
        "iterate runs the step on groups of rows in an order of its choosing "
        "(sorted by count, in tiles or shrinking prefixes of the batch), so a "
        "row's result must depend on that row alone; see the docs' "
        "'Validating a block' page for what is checked.")
    raise RowMixingError("\n".join(lines))

  def fail_ext(self, eqn, val: _Val, axis: int) -> None:
    if val.origin.startswith(_RANDOM):
      self.fail_random(eqn, val.origin)
    origin = val.origin or "an array step closes over"
    self.fail(
        eqn, f"combines per-row data from {origin}, whose axis {axis} has the "
        f"batch's {self.batch} rows, with the state",
        "per-row data must travel through x (iterate(step, params, h0, x)), "
        "which iterate slices with the rows; params and closed-over arrays are "
        "shared by every row")

  def fail_random(self, eqn, origin: str) -> None:
    used = f"{eqn.primitive.name}{_where(eqn) or self.outer_where}"
    raise SharedKeyError(_random_message(origin[len(_RANDOM):], f"combined with the state by {used}"))

  # -- driver -----------------------------------------------------------------

  def run(self, jaxpr, consts_vals: Sequence[_Val], in_vals: Sequence[_Val]) -> list:
    env: dict = {}

    def read(v):
      if isinstance(v, jex_core.Literal):
        return _FREE
      return env.get(v, _FREE)

    for v, val in zip(jaxpr.constvars, consts_vals):
      env[v] = val
    for v, val in zip(jaxpr.invars, in_vals):
      env[v] = val
    outer, outer_user = self.outer_where, self.outer_user
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      self.outer_where = outer or _where(eqn)
      self.outer_user = outer_user or _user_where(eqn)
      outs = self.eqn(eqn, ins)
      self.outer_where, self.outer_user = outer, outer_user
      for v, val in zip(eqn.outvars, outs):
        env[v] = val
    return [read(v) for v in jaxpr.outvars]

  def const_val(self, shape: Sequence[int], origin: str) -> _Val:
    ext = frozenset(i for i, n in enumerate(shape) if n == self.batch) if self.batch > 1 else frozenset()
    return _Val(None, ext, origin if ext else "")

  def lost(self, eqn) -> list:
    self.unknown.add(eqn.primitive.name)
    return [_LOST] * len(eqn.outvars)

  # -- one equation -----------------------------------------------------------

  def eqn(self, eqn, ins: list[_Val]) -> list[_Val]:
    name = eqn.primitive.name
    if name in _CALLBACKS:
      return self.lost(eqn)
    if any(v.row is UNKNOWN for v in ins):
      return [_LOST] * len(eqn.outvars)
    rule = getattr(self, "rule_" + name, None)
    if rule is not None:
      out = rule(eqn, ins)
      return out if out is not None else self.lost(eqn)
    if name in _REDUCTIONS:
      return self.reduction(eqn, ins)
    if name in _CUMULATIVE:
      return self.along_axis(eqn, ins, [eqn.params["axis"]], "scans cumulatively along the row axis",
                             "cumulate along a feature axis (axis=-1)", "jnp.cumsum(h, axis=0)")
    subs = _sub_jaxprs(eqn.params)
    if subs:
      return self.call(eqn, ins, subs)
    if self.is_elementwise(eqn):
      return [self.elementwise(eqn, ins)] * len(eqn.outvars)
    return self.lost(eqn)

  def is_elementwise(self, eqn) -> bool:
    if not eqn.outvars or _AXIS_PARAMS.intersection(eqn.params):
      return False
    out = _shape(eqn.outvars[0])

    def broadcasts(shape):  # jaxprs broadcast () and size-1 axes implicitly
      return shape == () or (len(shape) == len(out)
                             and all(n in (m, 1) for n, m in zip(shape, out)))

    return (all(_shape(v) == out for v in eqn.outvars)
            and all(broadcasts(_shape(v)) for v in eqn.invars))

  def elementwise(self, eqn, ins: list[_Val]) -> _Val:
    rows = {v.row for v in ins if v.row is not None}
    if len(rows) > 1:
      axes = sorted(rows, key=lambda r: (r.axis, r.inner))
      self.fail(eqn, f"combines rows laid out on axes {[r.axis for r in axes]} of "
                f"{_describe_aval(eqn.outvars[0])}",
                "keep the rows on one axis (no transposes of the row axis)", "h + h.T")
    if rows:
      row = rows.pop()
      for v, var in zip(ins, eqn.invars):
        shape = _shape(var)
        if (v.row is None and row.inner == 1 and row.axis in v.ext
            and len(shape) > row.axis and shape[row.axis] == self.batch):
          self.fail_ext(eqn, v, row.axis)
      return _Val(row)
    ext = frozenset().union(*[v.ext for v, var in zip(ins, eqn.invars) if _shape(var)]) if ins else frozenset()
    origin = next((v.origin for v in ins if v.ext), "")
    return _Val(None, ext, origin)

  def along_axis(self, eqn, ins, axes, problem, fix, example) -> list[_Val]:
    """Shape-preserving ops acting along `axes`: flagged if the row axis is one."""
    for v in ins:
      if isinstance(v.row, Row) and v.row.axis in axes:
        self.fail(eqn, problem, fix, example)
    rows = {v.row for v in ins if v.row is not None}
    if len(rows) > 1:
      return self.lost(eqn)
    row = rows.pop() if rows else None
    return [_Val(row)] * len(eqn.outvars)

  def reduction(self, eqn, ins) -> list[_Val]:
    axes = tuple(eqn.params["axes"])
    v = ins[0]
    if isinstance(v.row, Row):
      if v.row.axis in axes:
        self.fail(eqn, f"reduces over the row axis (axis {v.row.axis} of "
                  f"{_describe_aval(eqn.invars[0])})",
                  "reduce over feature axes only (e.g. h.mean(axis=-1, keepdims=True)); "
                  "statistics shared by all rows belong in params",
                  "h.mean(0), h.sum(axis=0) or jnp.max(h)")
      return [_Val(Row(v.row.axis - sum(a < v.row.axis for a in axes), v.row.inner))]
    return [_FREE]

  # -- nested jaxprs ----------------------------------------------------------

  def call(self, eqn, ins, subs) -> list[_Val]:
    for _, jaxpr, consts in subs:
      if len(jaxpr.invars) == len(ins) and len(jaxpr.outvars) == len(eqn.outvars):
        consts_vals = [self.const_val(np.shape(c), "an array step closes over") for c in consts]
        return self.run(jaxpr, consts_vals, ins)
    return self.lost(eqn)

  def rule_cond(self, eqn, ins):
    results = []
    for branch in eqn.params["branches"]:
      consts_vals = [self.const_val(np.shape(c), "an array step closes over") for c in branch.consts]
      results.append(self.run(branch.jaxpr, consts_vals, ins[1:]))
    return [vals[0] if all(vals[0] == v for v in vals) else _LOST for vals in zip(*results)]

  def _fixpoint(self, body_fn, carry: list[_Val]) -> list[_Val] | None:
    for _ in range(4):
      new = body_fn(carry)
      if new == carry:
        return carry
      carry = [c if c == n else (_LOST if (c.row is not None or n.row is not None) else
                                 _Val(None, c.ext | n.ext, c.origin or n.origin))
               for c, n in zip(carry, new)]
    return None

  def rule_while(self, eqn, ins):
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body = eqn.params["body_jaxpr"]
    body_consts, carry = ins[nc:nc + nb], ins[nc + nb:]
    inner = [self.const_val(np.shape(c), "an array step closes over") for c in body.consts]
    # The condition is not checked: a vmapped while loop reduces its per-row
    # predicate over the rows by construction (the body masks finished rows).
    return self._fixpoint(lambda c: self.run(body.jaxpr, inner, body_consts + c), carry)

  def rule_scan(self, eqn, ins):
    p = eqn.params
    if "num_consts" in p:  # older JAX
      n_consts, n_carry = p["num_consts"], p["num_carry"]
      consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    else:  # JAX 0.11: the (consts, carry, xs) split is a flat tree
      consts, carry, xs = (list(g) for g in p["ft_in"].update(list(ins)).unpack())
    n_carry = len(carry)
    sliced = []
    for v in xs:
      if isinstance(v.row, Row):
        if v.row.axis == 0:
          return None  # a scan over the rows (lax.map over h): not modelled
        sliced.append(_Val(Row(v.row.axis - 1, v.row.inner)))
      else:
        sliced.append(_Val(None, frozenset(a - 1 for a in v.ext if a > 0), v.origin))
    inner = [self.const_val(np.shape(c), "an array step closes over") for c in p["jaxpr"].consts]
    run = lambda c: self.run(p["jaxpr"].jaxpr, inner, consts + c + sliced)
    final = self._fixpoint(lambda c: run(c)[:n_carry], carry)
    if final is None:
      return None
    ys = run(final)[n_carry:]
    stacked = [_Val(Row(y.row.axis + 1, y.row.inner)) if isinstance(y.row, Row) else
               (_LOST if y.row is UNKNOWN else _FREE) for y in ys]
    return final + stacked

  # -- structural rules -------------------------------------------------------

  def rule_broadcast_in_dim(self, eqn, ins):
    dims = eqn.params["broadcast_dimensions"]
    v = ins[0]
    if isinstance(v.row, Row):
      return [_Val(Row(dims[v.row.axis], v.row.inner))]
    return [_Val(None, frozenset(dims[a] for a in v.ext), v.origin)]

  def rule_transpose(self, eqn, ins):
    perm = list(eqn.params["permutation"])
    v = ins[0]
    if isinstance(v.row, Row):
      return [_Val(Row(perm.index(v.row.axis), v.row.inner))]
    return [_Val(None, frozenset(perm.index(a) for a in v.ext), v.origin)]

  def rule_squeeze(self, eqn, ins):
    dims = eqn.params["dimensions"]
    v = ins[0]
    if isinstance(v.row, Row):
      if v.row.axis in dims:
        return [_FREE]
      return [_Val(Row(v.row.axis - sum(d < v.row.axis for d in dims), v.row.inner))]
    return [_Val(None, frozenset(a - sum(d < a for d in dims) for a in v.ext if a not in dims),
                 v.origin)]

  def rule_reshape(self, eqn, ins):
    if eqn.params.get("dimensions") is not None:
      return None
    v = ins[0]
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if isinstance(v.row, Row):
      r, inner = v.row.axis, v.row.inner
      lead = _prefix(old, r)
      per_row = inner * _prefix(old[r + 1:], len(old) - r - 1)
      for k, n in enumerate(new):
        if (_prefix(new, k) == lead and n % self.batch == 0 and n > 0
            and (n // self.batch) * _prefix(new[k + 1:], len(new) - k - 1) == per_row):
          return [_Val(Row(k, n // self.batch))]
      if self.batch <= 1:
        return [_FREE]
      self.fail(eqn, f"reshapes the row axis of {_describe_aval(eqn.invars[0])} to "
                f"{list(new)}, splitting rows or merging them with a leading axis",
                "keep the rows on their own leading axis (reshape only the axes after it, "
                "e.g. h.reshape(h.shape[0], -1))", "h.reshape(-1, 2 * d)")
    ext = set()
    for a in v.ext:
      for k, n in enumerate(new):
        if _prefix(new, k) == _prefix(old, a) and n == old[a]:
          ext.add(k)
          break
    return [_Val(None, frozenset(ext), v.origin)]

  def rule_convert_element_type(self, eqn, ins):
    return [ins[0]]

  def rule_bitcast_convert_type(self, eqn, ins):
    v = ins[0]
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if isinstance(v.row, Row) and len(new) < len(old) and v.row.axis == len(old) - 1:
      return None
    if v.row is None:  # the leading axes stay (a narrower type adds one, a wider drops one)
      return [_Val(None, frozenset(a for a in v.ext if a < min(len(old), len(new))), v.origin)]
    return [_Val(v.row)]

  def rule_dot_general(self, eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    for v, contract in ((lhs, lc), (rhs, rc)):
      if isinstance(v.row, Row) and v.row.axis in contract:
        self.fail(eqn, "contracts the row axis (a sum over rows)",
                  "contract feature axes only (h @ W with h [rows, d]); statistics "
                  "shared by all rows belong in params", "h.T @ h or jnp.einsum('bi,bj->ij', h, h)")
    lrow = lhs.row.axis if isinstance(lhs.row, Row) else None
    rrow = rhs.row.axis if isinstance(rhs.row, Row) else None
    nb = len(lb)
    out = None
    if lrow is not None and lrow in lb:
      i = list(lb).index(lrow)
      if rrow is not None and rrow != rb[i]:
        return self._pairwise(eqn)
      if rrow is None and rb[i] in rhs.ext:
        self.fail_ext(eqn, rhs, rb[i])
      out = Row(i, lhs.row.inner)
    elif rrow is not None and rrow in rb:
      i = list(rb).index(rrow)
      if lrow is not None:
        return self._pairwise(eqn)
      if lb[i] in lhs.ext:
        self.fail_ext(eqn, lhs, lb[i])
      out = Row(i, rhs.row.inner)
    elif lrow is not None and rrow is not None:
      return self._pairwise(eqn)
    elif lrow is not None:
      out = Row(nb + lfree.index(lrow), lhs.row.inner)
    elif rrow is not None:
      out = Row(nb + len(lfree) + rfree.index(rrow), rhs.row.inner)
    if out is not None:
      return [_Val(out)]
    ext = {i for i, (a, b) in enumerate(zip(lb, rb)) if a in lhs.ext or b in rhs.ext}
    ext |= {nb + i for i, d in enumerate(lfree) if d in lhs.ext}
    ext |= {nb + len(lfree) + i for i, d in enumerate(rfree) if d in rhs.ext}
    return [_Val(None, frozenset(ext), lhs.origin or rhs.origin)]

  def _pairwise(self, eqn):
    self.fail(eqn, "pairs every row with every other row (a dot_general whose result "
              "has two row axes)", "attend or compare within a row (over an axis of "
              "each row, e.g. its tokens), never across the batch", "h @ h.T or attention over the batch")

  def rule_slice(self, eqn, ins):
    v = ins[0]
    if isinstance(v.row, Row):
      r = v.row.axis
      size = _shape(eqn.invars[0])[r]
      strides = eqn.params["strides"] or (1,) * len(eqn.params["start_indices"])
      if (eqn.params["start_indices"][r], eqn.params["limit_indices"][r], strides[r]) != (0, size, 1):
        self._positional(eqn, "slices", "h[1:], h[::2] or jnp.roll(h, 1, axis=0)")
      return [_Val(v.row)]
    return [_Val(None, frozenset(a for a in v.ext if _shape(eqn.outvars[0])[a] == self.batch),
                 v.origin)]

  def _positional(self, eqn, verb: str, example: str):
    self.fail(eqn, f"{verb} the row axis by position",
              "index, slice and shift feature axes only (h[:, 1:]); the rows a step "
              "sees are a group of the batch in an order of iterate's choosing", example)

  def rule_rev(self, eqn, ins):
    return self.along_axis(eqn, ins, list(eqn.params["dimensions"]), "reverses the row axis",
                           "reverse feature axes only (h[:, ::-1])", "h[::-1]")

  def rule_sort(self, eqn, ins):
    return self.along_axis(eqn, ins, [eqn.params["dimension"]], "sorts along the row axis",
                           "sort along a feature axis (jnp.sort(h, axis=-1))", "jnp.sort(h, axis=0)")

  def rule_top_k(self, eqn, ins):
    v = ins[0]
    nd = len(_shape(eqn.invars[0]))
    axis = eqn.params.get("axis", nd - 1)
    return self.along_axis(eqn, ins, [axis % nd if nd else 0], "takes top-k along the row axis",
                           "take top-k along a feature axis", "lax.top_k(h.T, k)")

  def rule_concatenate(self, eqn, ins):
    d = eqn.params["dimension"]
    rows = {v.row for v in ins if v.row is not None}
    for v in ins:
      if isinstance(v.row, Row) and v.row.axis == d:
        self._positional(eqn, "concatenates along", "jnp.concatenate([h, h]) or jnp.roll(h, 1, 0)")
    if len(rows) > 1:
      return None
    if rows:
      row = rows.pop()
      for v in ins:
        if v.row is None and row.axis in v.ext and row.inner == 1:
          self.fail_ext(eqn, v, row.axis)
      return [_Val(row)]
    return [_FREE]

  def rule_pad(self, eqn, ins):
    v = ins[0]
    if isinstance(v.row, Row):
      if tuple(eqn.params["padding_config"][v.row.axis]) != (0, 0, 0):
        self._positional(eqn, "pads", "jnp.pad(h, ((1, 0), (0, 0)))")
      return [_Val(v.row)]
    if ins[1].row is not None:
      return None
    return [_FREE]

  def rule_split(self, eqn, ins):
    v = ins[0]
    if isinstance(v.row, Row) and v.row.axis == eqn.params["axis"]:
      self._positional(eqn, "splits", "jnp.split(h, 2, axis=0)")
    return [_Val(v.row)] * len(eqn.outvars)

  def rule_dynamic_slice(self, eqn, ins):
    v = ins[0]
    if any(i.row is not None for i in ins[1:]):
      return None
    if isinstance(v.row, Row):
      if eqn.params["slice_sizes"][v.row.axis] != _shape(eqn.invars[0])[v.row.axis]:
        self._positional(eqn, "dynamically slices", "lax.dynamic_slice_in_dim(h, i, 1, axis=0)")
      return [_Val(v.row)]
    return [_FREE]

  def rule_dynamic_update_slice(self, eqn, ins):
    op, upd = ins[0], ins[1]
    if any(i.row is not None for i in ins[2:]):
      return None
    row = op.row if op.row is not None else upd.row
    if row is None:
      return [_FREE]
    if (op.row is not None and upd.row is not None and op.row != upd.row):
      return None
    if _shape(eqn.invars[1])[row.axis] != _shape(eqn.invars[0])[row.axis]:
      self._positional(eqn, "updates a slice of", "h.at[0].set(v) or lax.dynamic_update_slice(h, v, (i, 0))")
    return [_Val(row)]

  def rule_gather(self, eqn, ins):
    op, idx = ins
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    out_nd = len(_shape(eqn.outvars[0]))
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_nd) if d not in offset_dims]  # <-> idx dims [:-1]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    out_row = None
    if isinstance(op.row, Row):
      r = op.row.axis
      if op.row.inner != 1:
        return None
      if r in op_batching:
        j = op_batching.index(r)
        if not (isinstance(idx.row, Row) and idx.row.axis == idx_batching[j]):
          return None
        out_row = Row(batch_out[idx.row.axis])
      elif r in dn.start_index_map or r in dn.collapsed_slice_dims:
        self._positional(eqn, "gathers from", "h[idx] or jnp.take(h, idx, axis=0)")
      else:
        if eqn.params["slice_sizes"][r] != op_shape[r]:
          self._positional(eqn, "gathers a window of", "h[i:i + 2]")
        kept = [d for d in range(len(op_shape))
                if d not in dn.collapsed_slice_dims and d not in op_batching]
        out_row = Row(offset_dims[kept.index(r)])
        if isinstance(idx.row, Row):
          return self._pairwise_gather(eqn)
      return [_Val(out_row)]
    if isinstance(idx.row, Row):
      if idx.row.inner != 1 or idx.row.axis == len(idx_shape) - 1:
        return None
      return [_Val(Row(batch_out[idx.row.axis]))]
    return [_FREE]

  def _pairwise_gather(self, eqn):
    self.fail(eqn, "gathers from every row with indices that have rows of their own "
              "(a result with two row axes)", "index each row with its own indices "
              "(jnp.take_along_axis(h, idx, axis=1))", "h[:, idx] with idx [rows, k]")

  def _scatter(self, eqn, ins):
    op, idx, upd = ins[0], ins[1], ins[2]
    dn = eqn.params["dimension_numbers"]
    if any(isinstance(v.row, Row) and v.row.inner != 1 for v in (op, idx, upd)):
      return None
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if isinstance(op.row, Row):
      r = op.row.axis
      if r in op_batching:
        return [_Val(op.row)] if idx.row is not None else None
      if r in dn.scatter_dims_to_operand_dims or r in dn.inserted_window_dims:
        if idx.row is None and upd.row is None:
          self._positional(eqn, "scatters into", "h.at[0].set(v) or h.at[idx].add(v)")
        return None
      return [_Val(op.row)]
    if upd.row is not None or idx.row is not None:
      return None  # rows written into a row-free array: by index, not modelled
    return [_FREE]

  rule_scatter = _scatter
  rule_scatter_add = _scatter
  rule_scatter_mul = _scatter
  rule_scatter_min = _scatter
  rule_scatter_max = _scatter

  def rule_iota(self, eqn, ins):
    # An iota along an axis of B entries lined up with the rows is each row's
    # position in the group the step is given, which iterate reorders.
    dim, shape = eqn.params["dimension"], tuple(eqn.params["shape"])
    if self.batch > 1 and shape[dim] == self.batch:
      return [_Val(None, frozenset({dim}), "an iota over the rows (e.g. jnp.arange(h.shape[0]): "
                   "a row's position in the group of rows iterate passes, in an order of its "
                   "choosing)")]
    return [_FREE]

  # -- PRNG keys and bits (jax.random) ---------------------------------------

  def _drawn(self, eqn, key: _Val, key_nd: int, shape: Sequence[int]) -> _Val:
    """The layout of values drawn from `key` (a key array of `key_nd` axes)
    with `shape` appended: the key's rows, or else data that differs along
    every new axis of B entries (a row's bits depend on its position)."""
    if isinstance(key.row, Row):
      return _Val(key.row)
    new = (frozenset(key_nd + i for i, n in enumerate(shape) if n == self.batch)
           if self.batch > 1 else frozenset())
    if new:
      where = _where(eqn) or self.outer_where
      user = self.outer_user if self.outer_user and self.outer_user not in where else ""
      origin = (f"{_RANDOM}{eqn.primitive.name}{where}, {_describe_aval(eqn.outvars[0])}"
                + (f", called from {user[len(' at '):]}" if user else ""))
      return _Val(None, key.ext | new, origin)
    return _Val(None, key.ext, key.origin)

  def rule_random_bits(self, eqn, ins):
    return [self._drawn(eqn, ins[0], len(_shape(eqn.invars[0])), eqn.params["shape"])]

  def rule_random_split(self, eqn, ins):
    return [self._drawn(eqn, ins[0], len(_shape(eqn.invars[0])), eqn.params["shape"])]

  def rule_random_wrap(self, eqn, ins):
    # uint32 [..., n] key data -> key [...]: the trailing axis goes.
    v, nd = ins[0], len(_shape(eqn.outvars[0]))
    if isinstance(v.row, Row):
      return [_Val(v.row)] if v.row.axis < nd else None
    return [_Val(None, frozenset(a for a in v.ext if a < nd), v.origin)]

  def rule_random_unwrap(self, eqn, ins):
    # key [...] -> uint32 [..., n]: the key data's axis is new and last.
    return [ins[0]]

  def rule_select_and_gather_add(self, eqn, ins):
    return None

  def rule_optimization_barrier(self, eqn, ins):
    return list(ins)

  def rule_reduce_precision(self, eqn, ins):
    return [ins[0]]

  def rule_copy(self, eqn, ins):
    return [ins[0]]

  def rule_copy_p(self, eqn, ins):
    return [ins[0]]


# ---------------------------------------------------------------------------
# Entry points.


def analyze(closed: Any, in_rows: Sequence[Any], batch: int, *,
            in_origins: Sequence[str] | None = None, hint: str = "") -> Analysis:
  """Propagates row layouts through a closed jaxpr; raises on row mixing.

  Args:
    closed: a `ClosedJaxpr` (e.g. from `jax.make_jaxpr`).
    in_rows: per invar, the axis that indexes rows (an int) or None (a value
      shared by all rows: its axes of length `batch` are checked against
      being lined up with the rows).
    batch: B, the number of rows the jaxpr was traced with.
    in_origins: per invar, a name for the messages (e.g. "params['b']").
    hint: a sentence that leads every message (the 1-D `h0` hint).

  Returns:
    An `Analysis`: the layout of each output and the primitives not modelled.

  Raises:
    RowMixingError: (a ValueError) the jaxpr mixes rows; the first line
      names the operation and the fix.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_loop._src.step import row_checks
    >>> closed = jax.make_jaxpr(lambda h: jnp.tanh(h) * 2)(jnp.ones((4, 3)))
    >>> row_checks.analyze(closed, [0], batch=4).outputs
    [Row(axis=0, inner=1)]
  """
  checker = _Checker(batch, hint)
  origins = list(in_origins) if in_origins is not None else [""] * len(in_rows)
  in_vals = []
  for var, row, origin in zip(closed.jaxpr.invars, in_rows, origins):
    if row is None:
      in_vals.append(checker.const_val(_shape(var), origin or "an input shared by all rows"))
    else:
      in_vals.append(_Val(Row(row)))
  consts = [checker.const_val(np.shape(c), "an array step closes over") for c in closed.consts]
  outs = checker.run(closed.jaxpr, consts, in_vals)
  random_rows = [o.origin[len(_RANDOM):] if (o.row is None and 0 in o.ext
                                             and o.origin.startswith(_RANDOM)) else ""
                 for o in outs]
  return Analysis(outputs=[o.row for o in outs], unknown_primitives=checker.unknown,
                  random_rows=random_rows)


def _one_d_hint(named_leaves) -> str:
  """The 1-D `h0` hint, when every leaf of h0 is 1-D (one example without its
  row axis, most likely), else ""."""
  if not named_leaves or any(np.ndim(leaf) != 1 for _, leaf in named_leaves):
    return ""
  for name, leaf in named_leaves:
    shape = tuple(np.shape(leaf))
    if len(shape) == 1:
      return (f"{name} is 1-D ({jax.numpy.result_type(leaf)}{list(shape)}) and its "
              f"leading axis is the row axis, so it holds {shape[0]} rows of one value "
              f"each: for one example of {shape[0]} features pass {name}[None] "
              f"(shape (1, {shape[0]}))")
  return ""


def _named_leaves(prefix: str, tree: Any):
  return [(f"{prefix}{tree_util.keystr(path)}", leaf)
          for path, leaf in tree_util.tree_flatten_with_path(tree)[0]]


def check_step_jaxpr(closed: Any, params: Any, h0: Any, x: Any) -> Analysis:
  """Checks the loop body traced by `step_fn.trace_step` at the batch shape.

  The body's inputs are the leaves of `params` (shared by all rows), then
  those of `h0` and `x` and any further per-row operands (the step and row
  indices): every input after the params with a leading axis of B rows has
  its rows on axis 0. Outputs must keep their rows on axis 0.

  Args:
    closed: the `ClosedJaxpr` of the body.
    params: the params pytree it was traced with (arrays or avals).
    h0: the initial state (arrays or avals), [B, ...] leaves.
    x: the per-row inputs or None.

  Returns:
    The `Analysis` (layouts of the outputs, primitives not modelled).

  Raises:
    RowMixingError: (a ValueError) the step mixes rows, closes over per-row
      data, or returns its rows off axis 0.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_loop._src.step import row_checks
    >>> h0 = jnp.ones((8, 3))
    >>> closed = jax.make_jaxpr(lambda p, h: h - h.mean(0))(None, h0)
    >>> row_checks.check_step_jaxpr(closed, None, h0, None)
    Traceback (most recent call last):
    ...
    pallas_loop._src.step.row_checks.RowMixingError: step reduces over the row axis (axis 0 of float32[8, 3]) ...
  """
  h_leaves = tree_util.tree_leaves(h0)
  batch = int(np.shape(h_leaves[0])[0])
  shared = _named_leaves("params", params)
  per_row = _named_leaves("h0", h0) + _named_leaves("x", x)
  invars = closed.jaxpr.invars
  rows: list[int | None] = []
  origins: list[str] = []
  for i, var in enumerate(invars):
    if i < len(shared):
      rows.append(None)
      origins.append(shared[i][0] + " (params are shared by every row)")
    else:
      shape = _shape(var)
      rows.append(0 if shape and shape[0] == batch else None)
      origins.append("")
  hint = _one_d_hint(_named_leaves("h0", h0))
  result = analyze(closed, rows, batch, in_origins=origins, hint=hint)
  for k, drawn in enumerate(result.random_rows):
    if drawn:
      what = "a state leaf" if k < len(h_leaves) else "the halt flag or an output"
      raise SharedKeyError(_random_message(drawn, f"returned as {what}"))
  for k, row in enumerate(result.outputs):
    if isinstance(row, Row) and (row.axis, row.inner) != (0, 1):
      what = "state leaf" if k < len(h_leaves) else "halt flag or output"
      raise RowMixingError(
          f"step returns a {what} whose rows lie on axis {row.axis}"
          f"{' merged with other axes' if row.inner != 1 else ''} of "
          f"{_describe_aval(closed.jaxpr.outvars[k])}: return it with the rows on axis 0 "
          "(undo the transpose or reshape).")
  return result


def _random_message(drawn: str, used: str) -> str:
  """The error for random bits drawn over the rows from a key shared by every row."""
  return "\n".join([
      f"step draws random bits over the row axis from a key shared by every row ({drawn}; "
      f"{used}): draw from per-row keys instead: pass key= to iterate (or to "
      "deq.fixed_point) and draw with pallas_loop.random on the key step receives, e.g. "
      "pallas_loop.random.dropout(key, h, rate).",
      "This is what e.g. jax.random.bernoulli(k, p, h.shape) with k closed over or in "
      "params, Haiku's hk.dropout(hk.next_rng_key(), ...) or Flax's nn.Dropout with a "
      "module rng traces to: row r gets the bits of position r in the group of rows "
      "iterate passes to step, so its mask or noise changes with block_rows, the "
      "implementation, the row order and the batch size (even where h = 0 hides it).",
      "The key step receives is a pure function of (key, the row's index in your batch, "
      "the step); with per_example=True, jax.random on that key works too (on the XLA "
      "path). See the docs' 'Randomness' page."])


_SINGLE_KEY = re.compile(r"accepts a single key|single PRNG key|key array of shape|"
                         r"should be a ``jax.PRNGKey``")


def explain_trace_error(error: Exception, h0: Any, *, keyed: bool) -> Exception | None:
  """A clearer error for a failure while tracing the step, or None.

  Args:
    error: what tracing the step raised.
    h0: the initial state (to tell a 1-D `h0`).
    keyed: whether `iterate` was given `key=` (the step gets per-row keys).

  Returns:
    A new `TypeError`/`ValueError` whose first line names the problem and the
    fix (raise it `from error`), or None when there is nothing to add.

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_loop._src.step import row_checks
    >>> e = ValueError("normal accepts a single key, but was given a key array of shape (8, 2)")
    >>> print(str(row_checks.explain_trace_error(e, jnp.ones((8, 3)), keyed=True)).splitlines()[0])
    step called jax.random on its per-row keys (uint32[rows, 2], one key per row): draw with pallas_loop.random instead, e.g. pallas_loop.random.normal(key, h.shape) or pallas_loop.random.dropout(key, h, rate).
  """
  if isinstance(error, RowMixingError):
    return None
  text = str(error)
  first = text.splitlines()[0] if text else type(error).__name__
  if keyed and _SINGLE_KEY.search(text):
    return ValueError(
        "step called jax.random on its per-row keys (uint32[rows, 2], one key per row): "
        "draw with pallas_loop.random instead, e.g. pallas_loop.random.normal(key, "
        "h.shape) or pallas_loop.random.dropout(key, h, rate).\n"
        "Those samplers take the per-row keys and a shape with the row axis first, give "
        "the same bits on every implementation and lower inside the Pallas kernels "
        "(jax.random does not lower on Triton). With per_example=True the step sees one "
        "row's key, on which jax.random (and a Flax module's make_rng, e.g. "
        "apply(..., rngs={'dropout': key})) works on the XLA path.\n"
        f"JAX said: {first}")
  hint = _one_d_hint(_named_leaves("h0", h0))
  if hint and isinstance(error, (TypeError, ValueError, IndexError)):
    cls = TypeError if isinstance(error, TypeError) else ValueError
    return cls(f"{hint}; tracing step on it failed.\nJAX said: {first}")
  return None
