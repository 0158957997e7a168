"""The user's `step` as a closure-free function of explicit operands.

`iterate` calls `step` at several shapes (the whole batch in the XLA
implementation, one row tile in the kernel) and inside a `custom_vjp` and a
`pallas_call`, neither of which may capture arrays from the enclosing trace:
a `custom_vjp` would silently not differentiate them, a Pallas kernel refuses
them. So the arrays `step` closes over are found once, by tracing it at the
batch shape (`trace_step`), and passed along as explicit operands (`consts`)
next to `params`. Every later call (`StepFn.specialize`) traces `step` at
the shape at hand (once per shape) and substitutes those operands for the
captured values. `pallas_loop.deq` converts its map the same way
(`StepFn.closing_over`): this is the library's one closure conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.step import jaxpr_eval
from pallas_loop._src.step import row_checks


def avals(tree: Any, rows: int | None = None) -> Any:
  """`ShapeDtypeStruct`s of `tree`'s leaves; with `rows`, the leading (row)
  axis of each is `rows` long (a tile of the batch)."""

  def aval(a):
    shape = tuple(np.shape(a))
    if rows is not None:
      shape = (rows,) + shape[1:]
    return jax.ShapeDtypeStruct(shape, jax.numpy.result_type(a))

  return tree_util.tree_map(aval, tree)


def _describe(struct) -> str:
  return f"{struct.dtype}{list(struct.shape)}"


def row_index_avals(h):
  """Avals of the body's `t`, `rows` and `index` operands for a state `h`
  ([R, ...]): int32 [R, 1], [R, 1] and a scalar."""
  rows = tree_util.tree_leaves(h)[0].shape[0]
  column = jax.ShapeDtypeStruct((rows, 1), np.int32)
  return column, column, jax.ShapeDtypeStruct((), np.int32)


def extras(keys: Callable | None, indexed: bool, t, rows, index) -> dict[str, Any]:
  """The keyword arguments `step` receives beside (params, h, x): `key`
  (the per-row keys, with `key=`) and `index` (with `step_index=True`)."""
  out: dict[str, Any] = {}
  if keys is not None:
    out["key"] = keys(t, rows)
  if indexed:
    out["index"] = index
  return out


def explain_extras_error(error: Exception, *, keyed: bool, indexed: bool) -> Exception | None:
  """A clear error when `step` does not take the keyword extras it is given
  (`key=`, `index=`), e.g. a step written for the old positional key; or None."""
  text = str(error)
  if not isinstance(error, TypeError):
    return None
  if keyed and "unexpected keyword argument 'key'" in text:
    return TypeError(
        "step must accept `key` as a keyword argument: with key=..., iterate calls "
        "step(params, h, x, key=...) with the per-row keys (uint32 [rows, 2]), e.g. "
        "`def step(params, h, x, *, key):`. (Before pallas_loop 0.2 the key was the 4th "
        "positional argument: rename that parameter to `key`.)")
  if indexed and "unexpected keyword argument 'index'" in text:
    return TypeError(
        "step must accept `index` as a keyword argument: with step_index=True, iterate "
        "calls step(params, h, x, index=t) with the 0-based step index t (an int32 "
        "scalar shared by the rows of the call), e.g. `def step(params, h, x, *, index):` "
        "reading per-step layers as params[index]. Drop step_index=True if step does not "
        "use the index.")
  return None


def vmapped(step: Callable) -> Callable:
  """A per-example `step(params, h, x, **extras)` as a step over rows
  (vmapped over the leading axis of h, x and the per-row `key`; params and
  the step `index` shared)."""

  def batched(params, h, x, **extra):
    keyed = {k: v for k, v in extra.items() if k == "key"}
    shared = {k: v for k, v in extra.items() if k != "key"}
    one_row = lambda h_, x_, keyed_: step(params, h_, x_, **keyed_, **shared)
    return jax.vmap(one_row)(h, x, keyed)

  return batched


def with_halt(step: Callable, halt: Callable | None,
              keys: Callable | None = None, indexed: bool = False,
              outputs: bool = False) -> Callable:
  """The loop body: `(params, h, x, t, rows, index) -> (h_new, y, flag)`.

  `t` and `rows` are int32 [R, 1]: each row's step index (0-based) and its
  index in the caller's batch; `index` is the int32 scalar step index that
  every row of the call shares (callers that run rows at different steps
  pass any value and never use an `indexed` body so, see
  `StepFn.new_state_per_row`). They reach `step` as its keyword extras
  (`extras`): `key=keys(t, rows)` with `keys`, `index=index` when `indexed`.
  `y` is the step's per-step output (with `outputs`: `step` returns
  `(h_new, y)`), else None. The flag is `halt(...)` or None. Tracing step
  and criterion as one function hoists both one's closed-over arrays (the
  key data among them), and lets the kernel evaluate the criterion on the
  fresh update.
  """

  def body(params, h, x, t, rows, index):
    out = step(params, h, x, **extras(keys, indexed, t, rows, index))
    if outputs:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            "with step_outputs=True, step must return a pair (h_new, y): the new state "
            f"and this step's output; got {type(out).__name__}.")
      h_new, y = out
    else:
      h_new, y = out, None
    return h_new, y, (None if halt is None else halt(params, h_new, h, x))

  return body


def check_halt_output(flag_shape, batch: int) -> None:
  """Raises unless `halt` returned bool [B] (or [B, 1])."""
  if flag_shape is None:
    return
  if (not isinstance(flag_shape, jax.ShapeDtypeStruct)
      or flag_shape.shape not in ((batch,), (batch, 1)) or flag_shape.dtype != bool):
    got = _describe(flag_shape) if isinstance(flag_shape, jax.ShapeDtypeStruct) else flag_shape
    raise TypeError(
        f"halt(params, h_new, h, x) must return bool[{batch}], one flag per row; "
        f"got {got}. Reduce over the non-row axes, e.g. "
        "jnp.max(jnp.abs(h_new - h), axis=-1) < 1e-3.")


def output_buffer_avals(y_shape: Any, batch: int, max_iters: int) -> Any:
  """The per-step outputs' buffers, [B, max_iters, ...] per leaf of `y`
  (traced at [B, ...]); raises unless every leaf has the row axis."""
  def buffer(path, leaf):
    if not leaf.shape or leaf.shape[0] != batch:
      raise TypeError(
          f"step's per-step output y{tree_util.keystr(path)} is {_describe(leaf)}: every "
          f"leaf of y needs the row axis first ([{batch}, ...] here), one output per row.")
    return jax.ShapeDtypeStruct((batch, max_iters) + leaf.shape[1:], leaf.dtype)
  return tree_util.tree_map_with_path(buffer, y_shape)


def _trace(step: Callable, params, h, x, positioned: bool):
  """`step` traced at the shapes of (params, h, x) (and, when `positioned`,
  of the body's `t`, `rows`, `index`): (closed jaxpr, out_shape)."""
  operands = (avals(params), avals(h), avals(x))
  position = row_index_avals(h) if positioned else ()
  return jax.make_jaxpr(step, return_shape=True)(*operands, *position)


def trace_step(step: Callable, params, h0, x):
  """Traces the body `step(params, h0, x, t, rows)` once at the batch shape.

  Returns:
    (consts, out_shape): the arrays `step` closes over (tracers of an
    enclosing trace or concrete arrays), in a stable order, and the pytree
    of `ShapeDtypeStruct` it returns.
  """
  closed, out_shape = _trace(step, params, h0, x, positioned=True)
  row_checks.check_step_jaxpr(closed, params, h0, x)  # rows stay rows
  return list(closed.consts), out_shape


def check_step_output(out_shape, h0) -> None:
  """Raises unless `step` returns the structure, shapes and dtypes of `h0`."""
  h_struct: Any = tree_util.tree_structure(h0)
  out_struct: Any = tree_util.tree_structure(out_shape)
  if h_struct != out_struct:
    raise TypeError(
        "step(params, h, x) must return the pytree structure of h0; "
        f"got {out_struct=} for {h_struct=}. Return a new state shaped "
        "exactly like h (the same containers, the same leaves).")
  for (path, h_leaf), out_leaf in zip(
      tree_util.tree_flatten_with_path(h0)[0], tree_util.tree_leaves(out_shape)):
    want = jax.ShapeDtypeStruct(np.shape(h_leaf), jax.numpy.result_type(h_leaf))
    if (out_leaf.shape, out_leaf.dtype) != (want.shape, want.dtype):
      raise TypeError(
          f"step returned {_describe(out_leaf)} for the state leaf "
          f"h{tree_util.keystr(path)}, which is {_describe(want)}: step must "
          "keep every leaf's shape and dtype (cast with .astype(h.dtype) if "
          "a computation promoted it).")


@dataclasses.dataclass(frozen=True)
class SpecializedStep:
  """`step` traced at one shape: a jaxpr and the operands for its constants.

  Attributes:
    jaxpr: the closure-free jaxpr of `step(params, h, x)`; its constvars are
      bound to `const_values`.
    const_values: one value per constvar: an entry of the caller's `consts`
      (possibly a tracer of the current trace) or a concrete array.
    out_tree: the treedef of the new state.
    sources: per constvar, the index of the caller's const it stands for, or
      None for a constant created inside step (it gets no gradient).
  """

  jaxpr: Any
  const_values: tuple
  out_tree: Any
  sources: tuple = ()

  def apply(self, const_values, params, h, x, t, rows, index, *, rules=None):
    """Evaluates the traced step; `const_values` may be loaded kernel refs.

    `rules` (inside kernels: a `jaxpr_eval.Rules`) evaluates it with every
    dot's operands in one dtype, which Triton requires, and the backend's
    rewrites; None evaluates the jaxpr as it is.
    """
    flat = tree_util.tree_leaves((params, h, x, t, rows, index))
    if rules is not None:
      out = jaxpr_eval.eval_jaxpr(self.jaxpr, list(const_values), flat, rules=rules)
    else:
      out = jax.core.eval_jaxpr(self.jaxpr, list(const_values), *flat)
    return tree_util.tree_unflatten(self.out_tree, out)


@dataclasses.dataclass(frozen=True)
class StepFn:
  """The user's step with its closed-over arrays turned into operands.

  `outer_consts` (the values found by `trace_step`, or by `closing_over`)
  are identified by object identity; the operands that replace them are
  passed at each call.
  """

  step: Callable
  outer_consts: tuple
  indexed: bool = False  # the step takes its step index (`step_index=True`)
  outputs: bool = False  # the step returns (h_new, y) (`step_outputs=True`)
  # The step takes the body's (t, rows, index) after (params, h, x), as
  # iterate's body does; False for a map of (params, h, x) alone (the DEQ's).
  positioned: bool = True
  # What the user calls the function, for the messages ("step", "f").
  name: str = "step"
  # Each shape `step` was traced at: (jaxpr, out_tree, sources, constants made
  # inside step), so a later call at that shape does not retrace it (see
  # `jax_versions.BACKWARD_TRACED_AFTER_VMAP`). One `iterate` call's own.
  traced: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def closing_over(cls, step: Callable, params, h, x, **fields) -> "StepFn":
    """`step(params, h, x)` (no body extras) with the arrays it closes over
    at these shapes (the batch's) as its `outer_consts`; `fields` as the
    class's (e.g. `name="f"`). The DEQ's map: its rows are checked where
    `iterate` traces the solver step that calls it."""
    closed, _ = _trace(step, params, h, x, positioned=False)
    return cls(step, tuple(closed.consts), positioned=False, **fields)

  def specialize(self, params, consts, h, x) -> SpecializedStep:
    """Traces `step` at the shapes of `h`/`x` (once per shape) and maps its
    captured arrays to `consts`."""
    leaves, tree = tree_util.tree_flatten((avals(params), avals(h), avals(x)))
    shape_key = (tree, tuple((a.shape, a.dtype) for a in leaves))
    if shape_key not in self.traced:
      closed, out_shape = _trace(self.step, params, h, x, self.positioned)
      by_id = {id(c): i for i, c in enumerate(self.outer_consts)}
      found: list[int | None] = []  # each constant's position in outer_consts
      kept: list[Any] = []  # each constant, None where it is an outer one
      for c in closed.consts:
        found.append(by_id.get(id(c)))
        if id(c) in by_id:
          kept.append(None)
        elif isinstance(c, jax.core.Tracer):
          raise ValueError(
              f"{self.name} closes over a traced array that it did not capture when "
              "traced at the batch shape; pass such arrays through `params`.")
        else:
          kept.append(c)  # a constant created inside step: safe to pass along
      self.traced[shape_key] = (closed.jaxpr, tree_util.tree_structure(out_shape),
                                tuple(found), tuple(kept))
    jaxpr, out_tree, sources, inner = self.traced[shape_key]
    values = tuple(c if i is None else consts[i] for i, c in zip(sources, inner))
    return SpecializedStep(jaxpr, values, out_tree, sources)

  def __call__(self, params, consts, h, x, t=None, rows=None, index=None):
    """The step's output at (params, consts, h, x) (and the body's `t`,
    `rows`, `index` where it is `positioned`)."""
    spec = self.specialize(params, consts, h, x)
    return spec.apply(spec.const_values, params, h, x, t, rows, index)

  def new_state(self, shared, h, x, t, rows, index):
    """The step's new state alone, with `shared = (params, consts)` as one
    operand: the function the backwards differentiate."""
    return self(shared[0], shared[1], h, x, t, rows, index)[0]

  def new_state_and_output(self, shared, h, x, t, rows, index):
    """(new state, per-step output or None), `shared` as in `new_state`."""
    return self(shared[0], shared[1], h, x, t, rows, index)[:2]

  def new_state_per_row(self, shared, h, x, t, rows):
    """`new_state` for rows at different steps `t` (int32 [R, 1]).

    A step that takes its scalar index is applied one row at a time
    (vmapped, so each row gets its own index: `params[index]` becomes a
    gather); any other step is applied to the rows at once.
    """
    if not self.indexed:
      return self.new_state(shared, h, x, t, rows, jnp.int32(0))
    def one_row(h_, x_, t_, r_):
      tile = lambda a: a[None]  # the row as a tile of one
      h_new = self.new_state(shared, tree_util.tree_map(tile, h_), tree_util.tree_map(tile, x_),
                             t_[None], r_[None], t_[0])
      return tree_util.tree_map(lambda a: a[0], h_new)

    return jax.vmap(one_row)(h, x, t, rows)
