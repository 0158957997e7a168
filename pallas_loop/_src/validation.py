"""Argument checks for `iterate`: every error names the argument and the fix."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src.operands import Halting


def static_int(name: str, value: Any, lowest: int) -> int:
  """`value` as a Python int >= `lowest`, or an error naming `name`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a static Python int >= {lowest}, got {value!r} of type "
                    f"{type(value).__name__}.")
  v = int(value)
  if v < lowest:
    raise ValueError(f"{name}={v} must be >= {lowest}.")
  return v


def concrete(value: Any) -> np.ndarray | None:
  """`value` as a NumPy array if it is known at trace time, else None."""
  try:
    return np.asarray(value)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def _shape(a) -> tuple[int, ...]:
  return tuple(np.shape(a))


def _dtype(a):
  if isinstance(a, str):  # jnp.result_type would read it as a dtype name
    return np.dtype(object)
  return jnp.result_type(a)


def check_step_index(step_index: Any) -> bool:
  """`step_index` as a Python bool (it changes how `step` is called)."""
  if not isinstance(step_index, bool):
    raise TypeError(f"step_index must be True or False, got {step_index!r}: with True, "
                    "step is called as step(params, h, x, index=t), t the int32 step index.")
  return step_index


def check_step_outputs(step_outputs: Any, mode: Any) -> bool:
  """`step_outputs` as a Python bool, with a gradient mode that defines the
  outputs' gradient (`mode.takes_outputs`)."""
  if not isinstance(step_outputs, bool):
    raise TypeError(f"step_outputs must be True or False, got {step_outputs!r}: with True, "
                    "step returns (h_new, y) and iterate returns (h, ys).")
  if step_outputs and not mode.takes_outputs:
    raise ValueError(
        f"step_outputs=True is not supported with grad={mode!r}: the per-step outputs of a "
        "fixed-point solve have no gradient under that mode. Use grad='full' or "
        "pallas_loop.Truncated(k), or return the outputs you need from the final state.")
  return step_outputs


def check_max_iters(max_iters: Any) -> int:
  """`max_iters` as a Python int >= 0 (it sizes buffers at trace time)."""
  try:
    return static_int("max_iters", max_iters, 0)
  except TypeError as e:
    raise TypeError(f"{e} It sizes buffers at trace time, so pass a constant "
                    "(e.g. max_iters=64), not an array.") from None


def _python_number(name: str, tree: Any, path: Any, leaf: Any) -> None:
  """Raises for a Python number in h0/x: most often a list meant as an array."""
  where = f"{name}{tree_util.keystr(path)}"
  if path:
    kind = type(tree).__name__ if isinstance(tree, (list, tuple)) else "pytree"
    raise TypeError(
        f"{name} is a Python {kind} of numbers ({where} = {leaf!r}): pass an array, "
        f"{name}=jnp.asarray({name}), with the rows on axis 0. A {kind} is a pytree, so "
        f"each number would be a state leaf of its own without a row axis.")
  raise TypeError(
      f"{name} is the Python {type(leaf).__name__} {leaf!r}: pass an array with a "
      f"leading row axis, e.g. {name}=jnp.full((rows,), {leaf!r}).")


def batch_size(h0: Any, x: Any) -> int:
  """The shared row count B of every leaf of h0 and x, or a clear error."""
  h_leaves = tree_util.tree_flatten_with_path(h0)[0]
  if not h_leaves:
    raise ValueError("h0 must contain at least one array (leaves [B, ...]); got "
                     f"an empty pytree {tree_util.tree_structure(h0)}.")
  rows = {}
  for name, tree in (("h0", h0), ("x", x)):
    for path, leaf in tree_util.tree_flatten_with_path(tree)[0]:
      if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float, complex, bool)):
        raise TypeError(f"{name}{tree_util.keystr(path)} is a "
                        f"{type(leaf).__name__}, not an array.")
      if isinstance(leaf, (int, float, complex, bool)) and not isinstance(leaf, np.generic):
        _python_number(name, tree, path, leaf)
      shape = _shape(leaf)
      if not shape:
        raise ValueError(
            f"{name}{tree_util.keystr(path)} has shape {shape}: every leaf of "
            f"{name} needs a leading row axis [B, ...] (use a[None] for one row).")
      rows[f"{name}{tree_util.keystr(path)}"] = shape[0]
  if len(set(rows.values())) > 1:
    listed = ", ".join(f"{k}: {v}" for k, v in rows.items())
    raise ValueError(
        "every leaf of h0 and x must have the same number of rows (axis 0); "
        f"got {listed}.")
  return next(iter(rows.values()))


def counts_from_iters(iters: Any, batch: int, max_iters: int) -> jax.Array:
  """int32 [B] step counts: iters broadcast to the batch, clipped to [0, max_iters]
  (None: max_iters for every row)."""
  if iters is None:
    iters = max_iters
  if isinstance(iters, bool):
    raise TypeError(f"iters must be an int or an int array, got {iters!r}.")
  dtype = _dtype(iters)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"iters has dtype {dtype}; it must be an integer count (int or int "
        f"array of shape () or ({batch},)). Round explicitly, e.g. "
        "iters=jnp.round(n).astype(jnp.int32).")
  shape = _shape(iters)
  if shape not in ((), (batch,)):
    raise ValueError(
        f"iters.shape={shape} must be () or ({batch},): one count per row of h0.")
  if isinstance(iters, (int, np.integer)):
    iters = min(max(int(iters), -1), max_iters + 1)  # no int32 overflow
  counts = jnp.clip(jnp.asarray(iters), 0, max_iters).astype(jnp.int32)
  return jnp.broadcast_to(counts, (batch,))


def same_count_every_row(iters: Any) -> bool:
  """Whether every row is given the same count, as the caller writes `iters`
  (None, an int, or a 0-d array): the rows are then in count order already,
  which the kernels know at trace time and sort nothing.

  Example:
    >>> same_count_every_row(None), same_count_every_row(3), same_count_every_row(jnp.ones(4))
    (True, True, False)
  """
  return iters is None or _shape(iters) == ()


def halting_operands(tol: Any, halt: Callable[..., Any] | None,
                     min_iters: Any) -> Halting | None:
  """`Halting(tol, min_iters)` as float32/int32 0-d arrays, after checks.

  Returns None when neither `tol` nor `halt` is given (no halting).
  """
  if halt is not None and not callable(halt):
    raise TypeError(f"halt must be callable as halt(params, h_new, h, x) -> bool[rows], "
                    f"got {type(halt).__name__}.")
  if isinstance(min_iters, bool) or not jnp.issubdtype(_dtype(min_iters), jnp.integer):
    raise TypeError(f"min_iters must be an int (or int scalar array), got {min_iters!r}.")
  if _shape(min_iters) != ():
    raise ValueError(f"min_iters.shape={_shape(min_iters)} must be (): one minimum for all rows.")
  if isinstance(min_iters, (int, np.integer)) and min_iters < 0:
    raise ValueError(f"{min_iters=} must be >= 0.")
  if tol is not None:
    if isinstance(tol, bool) or not jnp.issubdtype(_dtype(tol), jnp.number) \
        or jnp.issubdtype(_dtype(tol), jnp.complexfloating):
      raise TypeError(f"tol must be a real number (rms of the update), got {tol!r}.")
    if _shape(tol) != ():
      raise ValueError(f"tol.shape={_shape(tol)} must be (): one tolerance for all rows.")
    if isinstance(tol, (int, float, np.number)) and not tol >= 0:
      raise ValueError(f"{tol=} must be >= 0 (a row halts once rms(h_new - h) <= tol).")
  if tol is None and halt is None:
    return None
  tol_op = None if tol is None else jnp.asarray(tol).astype(jnp.float32)
  min_op = jnp.asarray(min(int(min_iters), 2**31 - 1)
                       if isinstance(min_iters, (int, np.integer)) else min_iters).astype(jnp.int32)
  return Halting(tol=tol_op, min_iters=min_op)


def check_step(step: Any) -> None:
  """`step` is callable, or a TypeError saying how it is called."""
  if not callable(step):
    raise TypeError(f"step must be callable as step(params, h, x), got "
                    f"{type(step).__name__}.")
