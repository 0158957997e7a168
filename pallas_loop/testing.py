"""Checks to run on a new block before trusting the kernel with it.

Two functions, meant to be the first thing a user runs on their own `step`:

* `check_row_independence(step, params, h, x)`: `iterate` calls `step` on
  tiles of rows, after reordering and padding the batch, so a step that mixes
  rows (a mean, a sort or a matmul over the row axis) gives silently wrong
  results there. This checks that permuting the rows permutes the output,
  that a subset of the rows gives those rows' output, and that changing one
  row changes no other row's output.
* `check_against_reference(step, params, h0, x, iters=..., max_iters=...)`:
  runs `pallas_loop.iterate` (by default the Pallas kernel; interpret mode on
  CPU) and the oracle (a plain masked `lax.scan`) on the user's own
  inputs, forward and gradients, and raises an `AssertionError` naming the
  output or gradient leaf, the rows and the size of every difference.

Both raise `AssertionError` (so they read naturally inside a test) and return
quietly otherwise; `check_against_reference` returns the measured errors.

`poisoned_padding()` makes the kernels pad their tiles with NaN, so that a
test shows any padded row reaching a result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import jax
from jax import tree_util
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike
import numpy as np

import pallas_loop._reference as reference
from pallas_loop._src import iterate as iterate_lib
from pallas_loop._src import grad_modes
from pallas_loop._src import row_checks
from pallas_loop._src import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src import validation

__all__ = [
    "Comparison",
    "ReferenceCheck",
    "check_against_reference",
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

# Options of `iterate` that only concern how it runs: never given to the reference.
_ITERATE_ONLY = ("implementation", "interpret", "block_rows", "sort_rows", "grad")
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

  @property
  def ok(self) -> bool:
    return self.n_bad == 0

  def describe(self) -> str:
    """One line: what differs, where, and by how much."""
    what = "rows" if self.by_row else "elements"
    head = f"{self.name} ({self.dtype}{list(self.shape)}): "
    if self.ok:
      head += "ok"
    else:
      listed = ", ".join(str(i) for i in self.bad)
      more = ", ..." if self.n_bad > len(self.bad) else ""
      head += f"{self.n_bad} of {self.n_total} {what} differ ({what} {listed}{more})"
    return (f"{head}; max abs err {self.max_abs:.3g}, max rel err {self.max_rel:.3g} "
            f"(rtol={self.rtol:g}, atol={self.atol:g})")


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
  bad = ~same & ~(diff <= atol * scale + rtol * np.abs(w))
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
                    listed, n_bad, n_total, by_row)


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
    **options: Any,
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

  Options are split by who understands them: `implementation`, `interpret`,
  `block_rows`, `sort_rows` and `grad` go only to `iterate`; `tol`, `halt`,
  `min_iters` (and any other keyword the oracle accepts, such as `key`) go
  to both. Gradients are compared for the exact modes:
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
    **options: keyword options of `iterate`. Default
      `implementation="pallas"`: the kernel, in interpret mode on CPU (pass
      `implementation="xla"` to check the XLA loop, or `interpret=False` on
      a GPU/TPU to check the compiled kernel).

  Returns:
    A `ReferenceCheck` holding every leaf's `Comparison` (max abs/rel error);
    `print` it to see how close the implementations are.

  Raises:
    AssertionError: some leaf differs beyond tolerance. The message lists
      every such leaf by its pytree path ("output h[1]", "gradient w.r.t.
      params['w']"), the first differing rows (or parameter elements), and
      the max abs and max rel error.

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
    output h (float32[16, 8]): ok; max abs err ...
  """
  if "return_info" in options:
    raise TypeError("check_against_reference sets return_info itself; do not pass it.")
  ref_accepts = set(inspect.signature(reference.iterate).parameters)
  iterate_accepts = set(inspect.signature(iterate_lib.iterate).parameters)
  unknown = sorted(set(options) - ref_accepts - iterate_accepts)
  if unknown:
    raise TypeError(f"unknown options {unknown}: neither pallas_loop.iterate nor "
                    "reference.iterate takes them.")
  options = {"implementation": "pallas", **options}
  shared = {k: v for k, v in options.items()
            if k in ref_accepts and k not in _ITERATE_ONLY}
  # Gradients are compared where the reference computes the same ones ("full",
  # or Truncated(k) by stop_gradient): the mode says with which arguments.
  reference_grad = grad_modes.as_mode(options.get("grad", "full")).reference_grad()
  if reference_grad is not None:
    shared.update(reference_grad)
  compare_grads = grads and reference_grad is not None
  halting = options.get("tol") is not None or options.get("halt") is not None

  def with_info(result: tuple) -> tuple[Any, Any]:
    # (h, info), or (h, ys, info) with per-step outputs: ((h, ys), info).
    *out, info = result
    return (out[0] if len(out) == 1 else tuple(out)), info

  def impl(p: Any, h: Any, x_: Any) -> Any:
    return with_info(iterate_lib.iterate(step, p, h, x_, iters=iters, max_iters=max_iters,
                                         return_info=True, **options))

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
    chosen = ", ".join(f"{k}={v!r}" for k, v in options.items() if k in _ITERATE_ONLY)
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
    ...                           max_iters=2, implementation="pallas",
    ...                           block_rows=8)
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
