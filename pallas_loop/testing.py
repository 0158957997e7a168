"""Checks to run on a new block before trusting the kernel with it.

Two functions, meant to be the first thing a user runs on their own `step`:

* `check_row_independence(step, params, h, x)`: `iterate` calls `step` on
  tiles of rows, after reordering and padding the batch, so a step that mixes
  rows (a mean, a sort or a matmul over the row axis) gives silently wrong
  results there. This checks that permuting the rows permutes the output,
  that a subset of the rows gives those rows' output, and that changing one
  row changes no other row's output.
* `check_compiles(step, params, h0, x, iters=..., max_iters=...)`: lowers
  (and, where the compiler is installed, compiles) your own call for a TPU
  and a GPU without either, and reports per gradient mode which kernel runs
  on each and why XLA runs instead where it does.
* `check_against_reference(step, params, h0, x, iters=..., max_iters=...)`:
  runs `pallas_loop.iterate` (by default the Pallas kernel; interpret mode on
  CPU) and the oracle (a plain masked `lax.scan`) on the user's own
  inputs, forward and gradients, and raises an `AssertionError` naming the
  output or gradient leaf, the rows and the size of every difference.

They raise `AssertionError` (so they read naturally inside a test);
`check_against_reference` returns the measured errors and `check_compiles`
what runs where.

`poisoned_padding()` makes the kernels pad their tiles with NaN, so that a
test shows any padded row reaching a result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import jax
from jax import tree_util
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike
import numpy as np

import pallas_loop._reference as reference
from pallas_loop._src.kernels import deviceless
from pallas_loop._src import dispatch
from pallas_loop._src import grad_modes
from pallas_loop._src import iterate as iterate_lib
from pallas_loop._src.kernels import kernel_backward
from pallas_loop._src.kernels import kernel_forward
from pallas_loop._src import options as options_lib
from pallas_loop._src.step import row_checks
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src import validation
from pallas_loop._src.options import Options

__all__ = [
    "CompileLine",
    "CompileReport",
    "Comparison",
    "ReferenceCheck",
    "check_against_reference",
    "check_compiles",
    "check_row_independence",
    "default_tolerance",
]

# (rtol, atol) per dtype. float32: the kernel runs the reference's operations
# on tiles instead of the whole batch, so only summation order differs (a few
# ulps, which a recurrence may amplify a little; a real bug is O(1)). Low
# precision: one rounding difference per step is legitimate and a recurrence
# can carry it along, so a few ulps of slack (bf16's ulp is 2**-7).
_TOLERANCES = {
    np.dtype(np.float64): (1e-7, 1e-9),
    np.dtype(np.float32): (1e-4, 1e-5),
    np.dtype(jnp.float16): (1e-2, 1e-3),
    np.dtype(jnp.bfloat16): (5e-2, 1e-2),
}

# Keywords of `iterate` never given to the reference (besides `options`, how
# it runs): the reference takes the gradient mode's own arguments instead.
_ITERATE_ONLY = ("grad",)
_MAX_LISTED = 5  # rows / indices listed in a message before "..."


def default_tolerance(dtype: DTypeLike) -> tuple[float, float]:
  """The default `(rtol, atol)` the checks use for a leaf of `dtype`.

  Args:
    dtype: a floating dtype (float64, float32, float16 or bfloat16). Other
      dtypes (integers, bool) are compared exactly: `(0.0, 0.0)`.

  Returns:
    `(rtol, atol)`: an element passes when
    `|got - want| <= atol * max(1, max|want|) + rtol * |want|`, `max|want|`
    taken over the leaf (so a gradient leaf of size 1e3 is judged on its own
    scale).

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> pallas_loop.testing.default_tolerance(jnp.float32)
    (0.0001, 1e-05)
  """
  dtype = np.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return 0.0, 0.0
  return _TOLERANCES.get(dtype, _TOLERANCES[np.dtype(np.float32)])


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One leaf of `iterate`'s result (or gradient) against the reference's.

  Attributes:
    name: which leaf, e.g. "output h[1]", "gradient w.r.t. params['w']",
      "info.steps".
    dtype: the leaf's dtype (a string).
    shape: the leaf's shape.
    max_abs: largest |got - want| (0 where both are the same NaN/inf).
    max_rel: largest |got - want| / |want| over elements with want != 0.
    rtol: the relative tolerance applied (see `default_tolerance`).
    atol: the absolute tolerance applied.
    bad: the failing rows (leaves with a row axis) or element indices
      (parameter gradients), at most the first few; empty when it passed.
    n_bad: how many rows/elements fail in all.
    n_total: how many rows/elements were compared.
    by_row: whether `bad` lists rows (True) or element indices (False).
    scale: `max(1, max|want|)` over the leaf, the factor of `atol`.
    margin: the largest `|got - want| / (atol * scale + rtol * |want|)` over
      the elements: at most 1 where every element passes (0 when all are
      equal; inf where an element differs and its allowance is 0).
  """

  name: str
  dtype: str
  shape: tuple[int, ...]
  max_abs: float
  max_rel: float
  rtol: float
  atol: float
  bad: tuple = ()
  n_bad: int = 0
  n_total: int = 0
  by_row: bool = True
  scale: float = 1.0
  margin: float = 0.0

  @property
  def ok(self) -> bool:
    return self.n_bad == 0

  def rule(self) -> str:
    """The test every element is held to, with this leaf's numbers."""
    if self.rtol == 0 and self.atol == 0:
      return "got == want"
    return (f"|got - want| <= {self.atol:g}*{self.scale:.3g} + {self.rtol:g}*|want| "
            "(atol*max(1, max|want|) + rtol*|want|)")

  def describe(self) -> str:
    """One line: the rule, whether it held, where not, and by how much.

    A passing leaf names the rule that passed and how much of its allowance
    the worst element used, since its `max rel err` alone may exceed `rtol`
    (an element near 0 is judged on the leaf's scale, not its own).
    """
    what = "rows" if self.by_row else "elements"
    head = f"{self.name} ({self.dtype}{list(self.shape)}): "
    if self.ok and self.rtol == 0 and self.atol == 0:
      head += f"ok: {self.rule()}"
    elif self.ok:
      head += f"ok: {self.rule()}, the worst element at {self.margin:.2g} of it"
    else:
      listed = ", ".join(str(i) for i in self.bad)
      more = ", ..." if self.n_bad > len(self.bad) else ""
      head += (f"{self.n_bad} of {self.n_total} {what} differ ({what} {listed}{more}); "
               f"allowed: {self.rule()}")
    return f"{head}; max abs err {self.max_abs:.3g}, max rel err {self.max_rel:.3g}"


@dataclasses.dataclass(frozen=True)
class ReferenceCheck:
  """What `check_against_reference` compared (returned when all agree).

  Attributes:
    comparisons: one `Comparison` per leaf of the output, of the gradients
      and (with halting) of `info.steps` / `info.halted`.
    gradients_compared: False when gradients were skipped (`grads=False`, or
      `Implicit`/`Phantom`, which the reference does not have).
  """

  comparisons: tuple[Comparison, ...]
  gradients_compared: bool

  def __str__(self) -> str:
    lines = [c.describe() for c in self.comparisons]
    if not self.gradients_compared:
      lines.append("gradients: not compared")
    return "\n".join(lines)


def _to_f64(a: ArrayLike) -> np.ndarray:
  a = np.asarray(a)
  return a.astype(np.float64) if a.dtype != np.bool_ else a.astype(np.int64)


def _compare(name: str, got: Any, want: Any, *, rtol: float | None, atol: float | None,
             by_row: bool) -> Comparison:
  """Elementwise comparison of two arrays; NaN == NaN, inf == inf."""
  dtype = np.dtype(want.dtype)
  if got.shape != want.shape or np.dtype(got.dtype) != dtype:
    # Cannot happen for iterate (it checks its output), but keep the check honest.
    return Comparison(name, f"{got.dtype} vs reference {want.dtype}", tuple(want.shape),
                      float("inf"), float("inf"), 0.0, 0.0, ("shape/dtype",), 1, 1, by_row)
  d_rtol, d_atol = default_tolerance(dtype)
  rtol = d_rtol if rtol is None else float(rtol)
  atol = d_atol if atol is None else float(atol)
  g, w = _to_f64(got), _to_f64(want)
  same = (g == w) | (np.isnan(g) & np.isnan(w))
  diff = np.where(same, 0.0, np.abs(g - w))  # NaN where exactly one side is NaN
  finite_w = np.abs(w[np.isfinite(w)])
  scale = max(1.0, float(finite_w.max())) if finite_w.size else 1.0
  allowed = atol * scale + rtol * np.abs(w)
  bad = ~same & ~(diff <= allowed)
  with np.errstate(divide="ignore", invalid="ignore"):
    used = np.where(same, 0.0, np.where(allowed > 0, diff / allowed, np.inf))
  margin = float(np.max(used)) if used.size else 0.0
  nonzero = same | (w != 0)
  rel = np.where(nonzero & ~same, diff / np.where(w == 0, 1.0, np.abs(w)), 0.0)
  max_abs = float(np.max(diff)) if diff.size else 0.0
  max_rel = float(np.max(rel)) if rel.size else 0.0
  if by_row and g.ndim >= 1:
    bad_rows = (np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1)) if g.size
                else np.zeros(0, np.int64))
    listed: tuple = tuple(int(i) for i in bad_rows[:_MAX_LISTED])
    n_bad, n_total = len(bad_rows), g.shape[0]
  else:
    bad_idx = np.argwhere(bad)
    listed = tuple(tuple(int(j) for j in i) if g.ndim != 1 else int(i[0])
                   for i in bad_idx[:_MAX_LISTED])
    n_bad, n_total, by_row = len(bad_idx), int(g.size), False
  return Comparison(name, str(dtype), tuple(want.shape), max_abs, max_rel, rtol, atol,
                    listed, n_bad, n_total, by_row, scale, margin)


def _compare_trees(prefix: str, got: Any, want: Any, *, rtol: float | None,
                   atol: float | None, by_row: bool) -> list[Comparison]:
  got_flat, got_tree = tree_util.tree_flatten_with_path(got)
  want_flat, want_tree = tree_util.tree_flatten_with_path(want)
  if got_tree != want_tree:  # type: ignore[operator]
    raise AssertionError(f"{prefix}: pytree structure {got_tree} differs from the "
                         f"reference's {want_tree}.")
  out = []
  for (path, g), (_, w) in zip(got_flat, want_flat):
    if np.dtype(w.dtype) == jax.dtypes.float0:  # integer inputs have no gradient
      continue
    out.append(_compare(f"{prefix}{tree_util.keystr(path)}", g, w,
                        rtol=rtol, atol=atol, by_row=by_row))
  return out


def _cotangent(h0: Any, seed: int) -> Any:
  """A random, seeded cotangent shaped like the output (float0 for non-floats)."""
  leaves, tree = tree_util.tree_flatten(h0)
  keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
  out: list[Any] = []
  for k, leaf in zip(keys, leaves):
    dtype = jnp.result_type(leaf)
    if jnp.issubdtype(dtype, jnp.inexact):
      out.append(jax.random.normal(k, np.shape(leaf), jnp.float32).astype(dtype))
    else:
      out.append(np.zeros(np.shape(leaf), jax.dtypes.float0))
  return tree_util.tree_unflatten(tree, out)


def check_against_reference(
    step: Callable[..., Any],
    params: Any,
    h0: Any,
    x: Any = None,
    *,
    iters: Any = None,
    max_iters: int,
    rtol: float | None = None,
    atol: float | None = None,
    grads: bool = True,
    seed: int = 0,
    options: Options | None = None,
    **kwargs: Any,
) -> ReferenceCheck:
  """Runs `pallas_loop.iterate` and the oracle on your inputs and compares.

  The oracle (the repository's `reference/`, installed as
  `pallas_loop._reference`) is a plain masked `lax.scan` over `max_iters`
  steps, differentiated by ordinary JAX autodiff.

  Compares the final state and, with `grads=True`, the gradients w.r.t.
  `params`, `h0` and `x` (one `jax.vjp` with a random, seeded cotangent,
  so every output element matters). With halting (`tol`/`halt`) it also
  compares `IterateInfo.steps` and `.halted` exactly. Each leaf is checked
  elementwise with dtype-aware tolerances (`default_tolerance`); a NaN
  matches a NaN.

  Keywords are split by who understands them: `options` and `grad` go only
  to `iterate`; `tol`, `halt`, `min_iters` (and any other keyword the oracle
  accepts, such as `key`) go to both. Gradients are compared for the exact modes:
  `grad="full"` (the default), `Full(...)`, and `Truncated(k)` (against the
  reference's `stop_gradient` truncation); `Implicit` and `Phantom`
  approximate the gradient on purpose and the reference has no counterpart,
  so with them only the forward is compared.

  Args:
    step: `step(params, h, x) -> h_new`, as for `pallas_loop.iterate`.
    params: pytree shared by every row (may be None).
    h0: pytree of arrays [B, ...].
    x: pytree of arrays [B, ...], or None.
    iters: int or int array [B], as for `iterate`.
    max_iters: static int >= 0.
    rtol: overrides the per-dtype relative tolerance for every leaf (an
      element passes when `|got - want| <= atol * max(1, max|want|) + rtol *
      |want|`).
    atol: overrides the per-dtype absolute tolerance likewise.
    grads: compare gradients too (default True).
    seed: seeds the random cotangent.
    options: how `iterate` runs, a `pallas_loop.Options`, forwarded whole
      and as given (its `implementation=None` is the automatic choice: XLA
      on CPU). None (the default): `Options(implementation="pallas")`, the
      kernel, in interpret mode on CPU under the TPU's rules
      (`Options(implementation="pallas", interpret="gpu")`: the GPU's), so
      what that kernel declines raises here too (pass
      `Options(implementation="xla")` to check the XLA loop, or
      `Options(implementation="pallas", interpret=False)` on a GPU/TPU to
      check the compiled kernel).
    **kwargs: further keywords of `iterate` (`tol`, `halt`, `min_iters`,
      `key`, `grad`, `step_index`, ...).

  Returns:
    A `ReferenceCheck` holding every leaf's `Comparison` (max abs/rel error);
    `print` it to see how close the implementations are.

  Raises:
    AssertionError: some leaf differs beyond tolerance. The message lists
      every such leaf by its pytree path ("output h[1]", "gradient w.r.t.
      params['w']"), the first differing rows (or parameter elements), the
      rule they broke, and the max abs and max rel error.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> def step(params, h, x):
    ...   return jnp.tanh(h @ params["w"] + x)
    >>> params = {"w": 0.5 * jnp.eye(8)}
    >>> h0, x = jnp.zeros((16, 8)), jnp.ones((16, 8))
    >>> n = jnp.arange(16) % 5
    >>> pallas_loop.testing.check_row_independence(step, params, h0, x)
    >>> report = pallas_loop.testing.check_against_reference(
    ...     step, params, h0, x, iters=n, max_iters=4)
    >>> print(report)                 # doctest: +ELLIPSIS
    output h (float32[16, 8]): ok: |got - want| <= 1e-05*1 + 0.0001*|want| (atol*max(1, max|want|) + rtol*|want|), the worst element at ... of it; max abs err ...
  """
  if "return_info" in kwargs:
    raise TypeError("check_against_reference sets return_info itself; do not pass it.")
  options_lib.reject_keywords(
      "check_against_reference", {k: v for k, v in kwargs.items() if k in options_lib.FIELDS})
  options = (Options(implementation="pallas") if options is None
             else options_lib.check_options(options))
  ref_accepts = set(inspect.signature(reference.iterate).parameters)
  iterate_accepts = set(inspect.signature(iterate_lib.iterate).parameters) - {"kwargs"}
  unknown = sorted(set(kwargs) - ref_accepts - iterate_accepts)
  if unknown:
    raise TypeError(f"unknown keywords {unknown}: neither pallas_loop.iterate nor "
                    "reference.iterate takes them.")
  shared = {k: v for k, v in kwargs.items()
            if k in ref_accepts and k not in _ITERATE_ONLY}
  # Gradients are compared where the reference computes the same ones ("full",
  # or Truncated(k) by stop_gradient): the mode says with which arguments.
  reference_grad = grad_modes.as_mode(kwargs.get("grad", "full")).reference_grad()
  if reference_grad is not None:
    shared.update(reference_grad)
  compare_grads = grads and reference_grad is not None
  halting = kwargs.get("tol") is not None or kwargs.get("halt") is not None

  def with_info(result: tuple) -> tuple[Any, Any]:
    # (h, info), or (h, ys, info) with per-step outputs: ((h, ys), info).
    *out, info = result
    return (out[0] if len(out) == 1 else tuple(out)), info

  def impl(p: Any, h: Any, x_: Any) -> Any:
    return with_info(iterate_lib.iterate(step, p, h, x_, iters=iters, max_iters=max_iters,
                                         return_info=True, options=options, **kwargs))

  def ref(p: Any, h: Any, x_: Any) -> Any:
    return with_info(reference.iterate(step, p, h, x_, iters=iters, max_iters=max_iters,
                                       return_info=True, **shared))

  def run(fn: Callable[..., Any]) -> tuple[Any, Any, Any]:
    def with_grads(p: Any, h: Any, x_: Any) -> tuple[Any, Any, Any]:
      out, vjp, info = jax.vjp(fn, p, h, x_, has_aux=True)
      # Shaped like the output: the state, or (state, per-step outputs).
      return out, info, vjp(_cotangent(out, seed))
    if compare_grads:
      return jax.jit(with_grads)(params, h0, x)
    out, info = jax.jit(fn)(params, h0, x)
    return out, info, None

  got, got_info, got_grads = run(lambda p, h, x_: impl(p, h, x_))
  want, want_info, want_grads = run(lambda p, h, x_: ref(p, h, x_))

  comparisons = _compare_trees("output h", got, want, rtol=rtol, atol=atol, by_row=True)
  if halting:
    for field in ("steps", "halted"):
      comparisons.append(_compare(f"info.{field}", getattr(got_info, field),
                                  getattr(want_info, field), rtol=0, atol=0, by_row=True))
  if compare_grads:
    for name, g, w, by_row in zip(("params", "h0", "x"), got_grads, want_grads,
                                  (False, True, True)):
      comparisons += _compare_trees(f"gradient w.r.t. {name}", g, w,
                                    rtol=rtol, atol=atol, by_row=by_row)
  report = ReferenceCheck(tuple(comparisons), compare_grads)
  failed = [c for c in comparisons if not c.ok]
  if failed:
    chosen = ", ".join([f"options={options!r}"]
                       + [f"{k}={v!r}" for k, v in kwargs.items() if k in _ITERATE_ONLY])
    raise AssertionError(
        f"pallas_loop.iterate ({chosen}) differs from reference.iterate:\n  "
        + "\n  ".join(c.describe() for c in failed)
        + "\nIf a few rows differ, run pallas_loop.testing.check_row_independence: "
          "a step that mixes rows is wrong once the batch is tiled. If the errors "
          "are rounding-sized, pass rtol=/atol=.")
  return report


@contextlib.contextmanager
def poisoned_padding() -> Iterator[None]:
  """Inside, the tiles' padding rows are NaN (floats) / -1 (ints), not copies
  of a real row, wherever the implementation does not need them finite.

  A padded row's results are dropped, so nothing a caller sees may change;
  a result that turns NaN shows a padded row leaking into a real one. (The
  backward's padding stays finite: its zero cotangents times NaN would be
  NaN by arithmetic, not by a leak.)

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> with pallas_loop.testing.poisoned_padding():
    ...   h = pallas_loop.iterate(lambda p, h, x: h + 1, None, jnp.zeros((5, 2)),
    ...                           max_iters=2, options=pallas_loop.Options(
    ...                               implementation="pallas", block_rows=8))
    >>> bool(jnp.all(h == 2))
    True
  """
  finite_padding = tiling.pad_rows

  def pad_rows(tree: Any, rows: int, *, must_be_finite: bool) -> Any:
    if must_be_finite:
      return finite_padding(tree, rows, must_be_finite=True)

    def poison(a: jax.Array) -> jax.Array:
      fill = jnp.nan if jnp.issubdtype(a.dtype, jnp.inexact) else -1
      block = jnp.full((rows - a.shape[0],) + a.shape[1:], fill, a.dtype)
      return jnp.concatenate([a, block], axis=0)

    return tree_util.tree_map(poison, tree)

  with mock.patch.object(tiling, "pad_rows", pad_rows):
    yield


def _take_rows(tree: Any, rows: ArrayLike) -> Any:
  return tiling.take_rows(tree, jnp.asarray(rows))


def _perturb_row(tree: Any, row: int, key: jax.Array) -> Any:
  """`tree` with row `row` of every leaf changed (noise of the leaf's own scale)."""
  leaves, treedef = tree_util.tree_flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  out = []
  for k, leaf in zip(keys, leaves):
    leaf = jnp.asarray(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      scale = jnp.std(leaf.astype(jnp.float32))
      scale = jnp.where(scale > 0, scale, 1.0)
      noise = jax.random.normal(k, leaf.shape[1:], jnp.float32) * scale
      new = (leaf[row].astype(jnp.float32) + noise).astype(leaf.dtype)
    elif leaf.dtype == jnp.bool_:
      new = ~leaf[row]
    else:
      new = leaf[row] + jnp.ones((), leaf.dtype)
    out.append(leaf.at[row].set(new))
  return tree_util.tree_unflatten(treedef, out)


def _listed(indices: np.ndarray | Sequence[int], n_total: int) -> str:
  """The first few of `n_total` indices, then "..." if some were left out."""
  shown = ", ".join(str(int(i)) for i in list(indices)[:_MAX_LISTED])
  return shown + (", ..." if n_total > min(len(indices), _MAX_LISTED) else "")


_MIXING_HINT = (
    "step must treat rows independently: no reduction (mean, sum, max, "
    "sort, softmax, normalisation) and no matmul over the row axis 0. "
    "iterate runs step on tiles of rows, reordered and padded, so such a step "
    "gives wrong results there.")


def check_row_independence(
    step: Callable[..., Any],
    params: Any,
    h: Any,
    x: Any = None,
    *,
    key: jax.Array | None = None,
    rows: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
  """Checks that `step` treats the rows of `h` and `x` independently.

  `iterate` reorders rows by count, splits them into tiles and pads the last
  tile, calling `step` on each tile: a step whose output row depends on other
  rows (a batch mean, a cross-row matmul) gives silently wrong results. Three
  checks, on your inputs:

  1. Changing one row of `h` and `x` changes no other row's output, bit for
     bit (a row-independent step computes each row from that row alone).
  2. Permuting the rows of `h` and `x` permutes `step`'s output (catches a
     step that depends on a row's position).
  3. A subset of the rows gives those rows' output (the kernel calls `step`
     on tiles, so it must also accept any number of rows).

  Checks 2 and 3 use the per-dtype tolerances of `default_tolerance` (the
  summation order of a matmul may depend on a row's position); check 1 is
  exact. 4. The step's jaxpr at the batch shape passes the trace-time check
  `iterate` runs (no reduction, contraction, slice or sort over the rows; no
  random bits drawn over the rows from a key shared by every row). That one
  does not depend on the values of `h`: it catches, say, a dropout mask
  drawn from a closed-over key even at `h = 0`, where checks 1-3 see
  nothing (such a mask is reported first, whatever `h`).

  Args:
    step: `step(params, h, x) -> h_new`, as for `pallas_loop.iterate`.
    params: pytree shared by every row (may be None).
    h: pytree of arrays [B, ...], B >= 2: a representative state.
    x: pytree of arrays [B, ...], or None.
    key: PRNG key for the permutation, the subset and the perturbations
      (default `jax.random.key(0)`).
    rows: the rows to perturb one at a time in check 1 (default: the first,
      the last and one random row).
    rtol: overrides the relative tolerance of checks 2 and 3.
    atol: overrides their absolute tolerance.

  Returns:
    Nothing; it returns quietly when every check passes.

  Raises:
    AssertionError: a check failed; the message names the output leaf and
      the rows affected (e.g. "changing row 0 changed rows 1, 2, 3, ... of
      output h[0]").
    TypeError/ValueError: `step`'s output does not match `h`, or B < 2.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> step = lambda params, h, x: jnp.tanh(h @ params + x)
    >>> h, x = jnp.ones((8, 4)), jnp.zeros((8, 4))
    >>> pallas_loop.testing.check_row_independence(step, jnp.eye(4), h, x)
    >>> bad = lambda params, h, x: h - jnp.mean(h, axis=0)   # batch norm
    >>> pallas_loop.testing.check_row_independence(bad, None, h, x)
    Traceback (most recent call last):
    AssertionError: changing row 0 of h/x changed rows 1, 2, 3, 4, 5, ... ...
  """
  batch = validation.batch_size(h, x)
  if batch < 2:
    raise ValueError(f"h has {batch} row(s); row independence needs at least 2 rows.")
  step_fn_lib.check_step_output(
      jax.eval_shape(step, params, h, x), h)
  # 0. What the jaxpr shows, whatever the values (e.g. h = 0): random bits
  # drawn over the rows from a shared key are reported at once; another
  # structural problem after the numerical checks, which name the rows.
  structural = None
  try:
    row_checks.check_step_jaxpr(jax.make_jaxpr(step)(params, h, x), params, h, x)
  except row_checks.SharedKeyError as e:
    raise AssertionError(str(e)) from e
  except row_checks.RowMixingError as e:
    structural = e
  key = jax.random.key(0) if key is None else key
  k_perm, k_sub, k_row, k_noise = jax.random.split(key, 4)
  run = jax.jit(step)
  out = run(params, h, x)

  # 1. Changing one row changes no other row (exactly).
  if rows is None:
    rows = sorted({0, batch - 1, int(jax.random.randint(k_row, (), 0, batch))})
  for i, r in enumerate(np.atleast_1d(np.asarray(rows))):
    r = int(r)
    if not 0 <= r < batch:
      raise ValueError(f"rows contains {r}, outside [0, {batch}).")
    noise_key = jax.random.fold_in(k_noise, i)
    k_h, k_x = jax.random.split(noise_key)
    got = run(params, _perturb_row(h, r, k_h), _perturb_row(x, r, k_x))
    others = np.array([i for i in range(batch) if i != r])
    lines = [
        f"changed rows {_listed(others[list(c.bad)], c.n_bad)} ({c.n_bad} of the "
        f"{batch - 1} other rows) of {c.name}, max abs change {c.max_abs:.3g}"
        for c in _compare_trees("output h", _take_rows(got, others), _take_rows(out, others),
                                rtol=0.0, atol=0.0, by_row=True) if not c.ok]
    if lines:
      raise AssertionError(
          f"changing row {r} of h/x " + "; ".join(lines) + ".\n" + _MIXING_HINT)

  # 2. Permuting the rows permutes the output.
  perm = np.asarray(jax.random.permutation(k_perm, batch))
  got = run(params, _take_rows(h, perm), _take_rows(x, perm))
  failed = [c for c in _compare_trees("output h", got, _take_rows(out, perm),
                                      rtol=rtol, atol=atol, by_row=True) if not c.ok]
  if failed:
    lines = []
    for c in failed:
      moved = [f"{perm[i]} (moved to {i})" for i in c.bad]
      more = ", ..." if c.n_bad > len(c.bad) else ""
      lines.append(f"{c.name}: rows {', '.join(moved)}{more} ({c.n_bad} of {batch}) "
                   f"differ from the unpermuted output, max abs err {c.max_abs:.3g}")
    raise AssertionError(
        "permuting the rows of h/x did not permute step's output:\n  "
        + "\n  ".join(lines) + "\n" + _MIXING_HINT)

  # 3. A subset of rows (a tile) gives those rows' output.
  sub = np.sort(np.asarray(jax.random.permutation(k_sub, batch))[:max(1, batch // 2)])
  try:
    got = run(params, _take_rows(h, sub), _take_rows(x, sub))
  except Exception as e:  # re-raised with what it means for iterate
    raise AssertionError(
        f"step failed on {len(sub)} of the {batch} rows: iterate calls step on "
        f"tiles of block_rows rows, so it must accept any number of rows. "
        f"{type(e).__name__}: {e}") from e
  failed = [c for c in _compare_trees("output h", got, _take_rows(out, sub),
                                      rtol=rtol, atol=atol, by_row=True) if not c.ok]
  if failed:
    lines = [f"{c.name}: rows {_listed(sub[list(c.bad)], c.n_bad)} ({c.n_bad} of {len(sub)}) "
             f"differ, max abs err {c.max_abs:.3g}" for c in failed]
    raise AssertionError(
        f"step on a subset of {len(sub)} rows gave those rows a different output "
        "than on the whole batch:\n  " + "\n  ".join(lines) + "\n" + _MIXING_HINT)

  # 4. What the jaxpr shows that these values did not.
  if structural is not None:
    raise AssertionError(str(structural)) from structural


# --- Compiling for the accelerators without one --------------------------------


@dataclasses.dataclass(frozen=True)
class CompileLine:
  """What one kernel of one call does on one target (`check_compiles`).

  Attributes:
    target: "tpu" (a TPU v5e) or "gpu" (an NVIDIA H200).
    grad: "forward" (the call alone), or the gradient mode differentiated
      ("full", "Truncated(4)", ...).
    kernel: "forward" or "backward" (the backward kernel of that mode;
      Implicit's adjoint solve is a forward kernel).
    runs: "kernel", "XLA" (the default falls back, with the warning that
      says why), or "raises" (`implementation="pallas"` declined it).
    why: the rule that sent it to XLA (or the error); empty for a kernel.
    proof: "compiled" (the target's compiler built it, deviceless),
      "exported" (`jax.export` lowered it; the compiler is not installed
      here), or "failed" (the compiler or the export failed: a bug).
    detail: the compiler used, why it was not, or the failure.
  """

  target: str
  grad: str
  kernel: str
  runs: str
  why: str
  proof: str
  detail: str = ""

  def describe(self) -> str:
    runs = self.runs if not self.why else f"{self.runs} ({self.why})"
    return (f"{self.target:3s} {self.grad:14s} {self.kernel:8s} {runs}; "
            f"{self.proof}{': ' + self.detail if self.detail else ''}")


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """Every `CompileLine` of a `check_compiles` call."""

  lines: tuple[CompileLine, ...]

  def __str__(self) -> str:
    return "\n".join(line.describe() for line in self.lines)

  def runs(self, target: str, grad: str = "forward", kernel: str = "forward") -> str:
    """Where a kernel runs: "kernel", "XLA" or "raises" (first such line)."""
    for line in self.lines:
      if (line.target, line.grad, line.kernel) == (target, grad, kernel):
        return line.runs
    raise KeyError(f"no line for {target=}, {grad=}, {kernel=} in the report:\n{self}")


def _mode_name(grad: Any) -> str:
  return grad if isinstance(grad, str) else repr(grad)


def _plan_line(target: deviceless.Target, grad: str, what: str, plan: Any,
               strict: bool, text: str) -> CompileLine:
  """The line for one observed plan on `target`."""
  config = plan.config
  if plan.problems:
    return CompileLine(target.name, grad, what, "raises" if strict else "XLA",
                       "; ".join(plan.problems), "")
  if config is not None and config.prefer_xla and not strict:
    return CompileLine(target.name, grad, what, "XLA", config.prefer_xla, "")
  name = kernel_forward.KERNEL_NAME if what == "forward" else kernel_backward.KERNEL_NAME
  if name not in text:
    return CompileLine(target.name, grad, what, "kernel", "",
                       "failed", f"planned, but {name} is not in the exported module")
  return CompileLine(target.name, grad, what, "kernel", "", "")


def check_compiles(
    step: Callable[..., Any],
    params: Any,
    h0: Any,
    x: Any = None,
    *,
    iters: Any = None,
    max_iters: int,
    grads: Sequence[Any] = ("full",),
    targets: Sequence[str] = ("tpu", "gpu"),
    options: Options | None = None,
    **kwargs: Any,
) -> CompileReport:
  """Lowers and compiles your own `iterate` call for a TPU and a GPU, on any machine.

  For each target, the call alone ("forward") and its gradient w.r.t.
  `params`, `h0` and `x` under each mode in `grads` are exported with
  `jax.export` for the target's platform, planned for its chip (a TPU v5e,
  an NVIDIA H200), and compiled by the target's own compiler, deviceless,
  where that compiler is installed (libtpu for the TPU; the JAX CUDA plugin
  with ptxas for the GPU). The report has a line per kernel: whether the
  Pallas kernel runs or XLA does (with the rule that decided), and what the
  line rests on: "compiled", "exported" (the compiler is not installed
  here: the detail says which package brings it), or "failed".

  Interpret mode (`Options(implementation="pallas")` on a CPU) declines what the
  TPU's (or GPU's) kernel declines by the step itself; the rules about the
  tile and the chip's memory (VMEM, shared memory, registers) decide only
  here, and on the chip.

  Args:
    step: the step, as for `pallas_loop.iterate`.
    params: its parameters.
    h0: the initial state.
    x: the per-row inputs (or None).
    iters: the per-row counts (or None: every row `max_iters`).
    max_iters: the counts' static bound.
    grads: the gradient modes to check ("full", `Truncated(k)`,
      `Implicit()`, `Phantom(k)`); () checks the forward only.
    targets: among "tpu" and "gpu".
    options: how `iterate` runs, a `pallas_loop.Options` (None: the
      defaults). Its default `implementation=None` checks what a user gets
      (the kernel, or XLA with a warning); `implementation="pallas"` checks
      that a declined kernel raises the library's own error.
    **kwargs: further `iterate` keywords (`tol`, `halt`, `key`,
      `step_index`, `per_example`, ...).

  Returns:
    A `CompileReport`; `print` it.

  Raises:
    AssertionError: a compiler or an export failed (never expected: the
      rules should have declined what the compiler cannot take; please
      report it), with the report.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(128), jnp.zeros((256, 128)), jnp.ones((256, 128))
    >>> report = pallas_loop.testing.check_compiles(step, w, h0, x, max_iters=4,
    ...                                             targets=["tpu"])
    >>> report.runs("tpu", "full", "backward")
    'kernel'
  """
  unknown = sorted(set(targets) - set(deviceless.TARGETS))
  if unknown:
    raise ValueError(f"targets {unknown} are not among {sorted(deviceless.TARGETS)}.")
  options_lib.reject_keywords(
      "check_compiles", {k: v for k, v in kwargs.items() if k in options_lib.FIELDS})
  options = options_lib.check_options(options)
  if "grad" in kwargs or "return_info" in kwargs:
    raise TypeError("check_compiles sets grad and return_info itself: pass the gradient "
                    "modes as grads=[...].")
  strict = options.implementation == "pallas"
  if strict and options.interpret is None:
    options = options.replace(interpret=False)  # the compiled kernel, not interpret mode

  def call(grad: Any) -> Callable[..., Any]:
    extra = {} if grad is None else {"grad": grad}
    run = lambda p, h, x_: iterate_lib.iterate(step, p, h, x_, iters=iters, max_iters=max_iters,
                                               options=options, **extra, **kwargs)
    if grad is None:
      return run

    def vjp(p: Any, h: Any, x_: Any) -> Any:
      # The value and its gradient, as a training step needs both (a
      # gradient alone may leave a forward kernel out of the module).
      out, back = jax.vjp(run, p, h, x_)
      return out, back(_cotangent(out, 0))
    return vjp

  lines: list[CompileLine] = []
  for name in targets:
    target = deviceless.TARGETS[name]
    mesh, compiler = deviceless.compiler(target)
    for grad in (None, *grads):
      label = "forward" if grad is None else _mode_name(grad)
      fn = call(grad)
      with dispatch.observe_plans() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warnings: the report has them
        try:
          text = deviceless.exported_text(fn, (params, h0, x), target)
        except Exception as e:  # pylint: disable=broad-except  # reported, then raised
          if strict and isinstance(e, ValueError):  # the library's own error
            lines.append(CompileLine(name, label, "-", "raises", str(e), "exported"))
          else:
            lines.append(CompileLine(name, label, "-", "-", "", "failed",
                                     f"export: {type(e).__name__}: {e}"))
          continue
      # Every platform's branch is traced: this target's plans, each once.
      planned: list[CompileLine] = []
      for what, backend, plan in seen:
        line = _plan_line(target, label, what, plan, strict, text)
        if backend == target.backend and line not in planned:
          planned.append(line)
      if mesh is None:
        proof, detail = "exported", f"not compiled: {compiler}"
      else:
        try:
          deviceless.compile_for(fn, (params, h0, x), mesh)
          proof, detail = "compiled", compiler
        except Exception as e:  # pylint: disable=broad-except  # reported, then raised
          proof, detail = "failed", f"{compiler}: {type(e).__name__}: {str(e)[:500]}"
      lines += [line if line.proof == "failed" else dataclasses.replace(
          line, proof=proof, detail=detail) for line in planned]
  report = CompileReport(tuple(lines))
  failed = [line for line in lines if line.proof == "failed"]
  if failed:
    raise AssertionError("pallas_loop.testing.check_compiles: a compiler or an export failed "
                         "(the rules should have declined it first; please report it):\n"
                         + str(report))
  return report
