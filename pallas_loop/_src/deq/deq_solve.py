"""`pallas_loop.deq.fixed_point`: per-row solves with `iterate`, implicit gradients of the map.

# B: rows  D: a row's state, flattened  m: a solver's window

The forward is one `iterate` call whose state is (z, residual, solver state):
each step evaluates the map f at z, records rms(f(z) - z) and moves z by the
solver; a row halts (the `halt` machinery, per row) once that residual is at
most its threshold, keeping f(z). The adjoint strategy (`adjoint=`) runs
that solve with its gradient (its `_solve`). `ImplicitAdjoint` wraps it in a
`jax.custom_vjp` whose forward is not differentiated (no gradient through
`iterate`, so the solver state may hold anything) and whose backward is the
implicit adjoint core that `grad=Implicit` uses too (`implicit_adjoint.vjp`):
the adjoint fixed point u = g + u df/dz(z*), solved here by another
`solve_rows` call (same solvers), then u pulled back through f only: the
gradient of the map at its fixed point, whatever solver found it.
`UnrolledAdjoint` instead backpropagates through the solver's steps
(`iterate`'s "full" mode). The map's closed-over arrays become operands by
`step_fn.StepFn`, the closure conversion `iterate` uses for its step.

With `key=`, each row gets one key (iterate's key of that row at step 0),
the same at every solver step and in the adjoint solve: it travels with the
row like `x`. Statistics reach the caller without host callbacks: the
forward's `SolveInfo` is returned, the adjoint's comes back as the gradient
of an `adjoint_probe`. Non-convergence is reported by the policy
(`on_failure`) through `jax.debug.callback`, so it reaches the user under
`jit` as well; the default warning is given once per call site and solve.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Callable, NamedTuple, cast

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop import random as random_lib
from pallas_loop._src.deq import deq_solvers
from pallas_loop._src import implicit_adjoint
from pallas_loop._src import keywords
from pallas_loop._src import notices
from pallas_loop._src import options as options_lib
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src.iterate import iterate
from pallas_loop._src.options import Options
from pallas_loop.halting import row_rms

POLICIES = ("warn", "raise", "nan", "ignore")


class SolveInfo(NamedTuple):
  """Per-row statistics of a forward or adjoint solve.

  Attributes:
    steps: int32 [B], map evaluations the row used (its solver steps).
    residual: float32 [B], rms(f(z) - z) at the z whose f(z) is returned:
      the smallest seen (for a converged row, the first at most `tol`; for
      the adjoint: of u - (g + u df/dz)).
    converged: bool [B], whether the residual met its tolerance within
      `max_iters`.

  Examples:
    The adjoint's statistics under `jit`, without a host callback: the
    gradient of the loss with respect to an `adjoint_probe`.

    >>> import jax, jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> f = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(3), jnp.zeros((2, 3)), jnp.ones((2, 3))
    >>> def loss(w, probe):
    ...   return deq.fixed_point(f, w, h0, x, adjoint_probe=probe).sum()
    >>> g_w, g_probe = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, deq.adjoint_probe(h0))
    >>> adjoint = deq.SolveInfo.from_probe(g_probe)
    >>> adjoint.converged.tolist(), adjoint.steps.dtype
    ([True, True], dtype('int32'))
  """

  steps: jax.Array
  residual: jax.Array
  converged: jax.Array

  @classmethod
  def from_probe(cls, cotangent: "SolveInfo") -> "SolveInfo":
    """The adjoint's `SolveInfo` from the gradient of an `adjoint_probe`.

    Args:
      cotangent: the gradient of the loss w.r.t. the probe passed as
        `fixed_point(..., adjoint_probe=probe)` (float32 fields).

    Returns:
      `SolveInfo(steps int32, residual float32, converged bool)`. Steps 0
      on every row: no adjoint solve ran (the loss does not depend on h*, or
      the adjoint is `UnrolledAdjoint`).
    """
    steps, residual, converged = cotangent
    return cls(jnp.round(steps).astype(jnp.int32), residual.astype(jnp.float32),
               converged > 0.5)


def adjoint_probe(h0: Any) -> SolveInfo:
  """Zeros to differentiate for the adjoint solve's statistics (no host callback).

  Pass the probe to `fixed_point(..., adjoint_probe=probe)` and differentiate
  the loss with respect to it as well: the "gradient" that comes back is
  the adjoint solve's per-row statistics (`SolveInfo.from_probe` gives them
  their dtypes). It works under `jit`, `vmap` and in a training step that
  only returns arrays. Use one probe per `fixed_point` call (gradients of a
  probe used twice add up).

  Args:
    h0: the initial state passed to `fixed_point` (a pytree of [B, ...]
      arrays), or the number of rows B.

  Returns:
    `SolveInfo` of three float32 [B] zero arrays.
  """
  rows = h0 if isinstance(h0, int) else int(np.shape(tree_util.tree_leaves(h0)[0])[0])
  zeros = jnp.zeros((rows,), jnp.float32)
  return SolveInfo(zeros, zeros, zeros)


class NonConvergenceWarning(UserWarning):
  """Rows of a `deq.fixed_point` solve (forward or adjoint) did not converge.

  Given once per call site (the line of your code that calls `fixed_point`)
  and solve, not at every training step; the warning points at that line.
  """


class NonConvergenceError(RuntimeError):
  """Raised (`on_failure="raise"`) when rows of a solve did not converge.

  Under `jit` it reaches the caller wrapped in a `jax.errors.JaxRuntimeError`
  whose message contains this one (the check runs in a host callback).
  """


def _check_policy(name: str, value: Any) -> None:
  if value not in POLICIES:
    raise ValueError(f"{name}={value!r} must be one of {POLICIES}.")


class _Solve(NamedTuple):
  """One `fixed_point` call's forward solve, as its adjoint strategy gets it.

  Attributes:
    fmap: the map on a tile, (shared, z [R, D], per_row) -> [R, D].
    solver: the forward's `Solver`.
    max_iters: the forward's budget.
    options: how iterate runs (every solve of the call).
    tol: the forward's tolerance (a float, or a traced scalar).
    on_failure: the forward's policy.
    site: the caller's (file, line), for the reports.
  """

  fmap: Callable[[Any, jax.Array, Any], jax.Array]
  solver: deq_solvers.Solver
  max_iters: int
  options: Options
  tol: Any
  on_failure: str
  site: tuple[str, int]


class _Adjoint(abc.ABC):
  """How `fixed_point` differentiates its solve (`ImplicitAdjoint`,
  `UnrolledAdjoint`): the strategy runs the forward solve with its gradient."""

  @abc.abstractmethod
  def _solve(self, forward: _Solve, shared: Any, z0: jax.Array, per_row: Any,
             threshold: jax.Array, probe: SolveInfo | None) -> tuple[jax.Array, SolveInfo]:
    """(z*, the forward's SolveInfo), differentiable by this strategy's rule;
    `probe` (None: not asked for) receives the adjoint's statistics as its
    cotangent."""


@dataclasses.dataclass(frozen=True)
class ImplicitAdjoint(_Adjoint):
  """The implicit-function gradient of the map at its fixed point (the default).

  With z* = f(params, z*, x) and g the cotangent of z*, solves the adjoint
  fixed point u = g + u df/dz(z*) per row with a solver (halting per row on
  rms(residual) <= `tol` * rms(g) of the row: relative to the cotangent's
  scale), then returns u df/d(params, x) at z*. The forward's solver never
  enters: the gradient is that of f, whatever iteration found z*. Zero
  gradient w.r.t. `h0`. Exact where the forward converged; at a row that did
  not, the gradient is taken at its best point (an approximation: the
  policy reports it). With `fixed_point(..., key=...)` the adjoint sees the
  same per-row keys as the forward (the same dropout masks).

  Attributes:
    solver: the adjoint's solver (a `Solver` or the name of a shipped one),
      or None (the default): the forward's.
    tol: relative tolerance of the adjoint solve (> 0), or None: the
      forward's `tol`.
    max_iters: its budget of solver steps (int >= 1), or None: the forward's
      (before 0.3: `max_steps`, which now raises a TypeError naming this).
    on_failure: policy for adjoint rows that did not converge ("warn",
      "raise", "nan", "ignore"), or None: the forward's.
    callback: None, or `callback(info: SolveInfo)` called on the host (via
      `jax.debug.callback`, so under `jit` too) with the adjoint solve's
      per-row statistics, as numpy arrays, each time the gradient is
      computed. Without a host round trip: `adjoint_probe`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> f = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(3), jnp.zeros((2, 3)), jnp.ones((2, 3))
    >>> seen = []
    >>> adjoint = deq.ImplicitAdjoint(callback=lambda info: seen.append(info.steps))
    >>> g = jax.grad(lambda w: deq.fixed_point(f, w, h0, x, adjoint=adjoint).sum())(w)
    >>> g.shape, len(seen), seen[0].shape
    ((3, 3), 1, (2,))
  """

  solver: deq_solvers.Solver | str | None = None
  tol: float | None = None
  max_iters: int | None = None
  on_failure: str | None = None
  callback: Callable[[SolveInfo], Any] | None = None

  def __post_init__(self):
    if self.solver is not None:
      object.__setattr__(self, "solver",
                         deq_solvers.as_solver(self.solver, "ImplicitAdjoint(solver)"))
    if self.tol is not None and not float(self.tol) > 0:
      raise ValueError(f"ImplicitAdjoint({self.tol=}) must be > 0 or None.")
    if self.max_iters is not None and (isinstance(self.max_iters, bool)
                                       or not isinstance(self.max_iters, int)
                                       or self.max_iters < 1):
      raise ValueError(f"ImplicitAdjoint({self.max_iters=}) must be an int >= 1 or None.")
    if self.on_failure is not None:
      _check_policy("ImplicitAdjoint(on_failure)", self.on_failure)

  def _solve(self, forward: _Solve, shared: Any, z0: jax.Array, per_row: Any,
             threshold: jax.Array, probe: SolveInfo | None) -> tuple[jax.Array, SolveInfo]:
    # The custom_vjp takes a probe either way; one nobody reads when not asked.
    probe = probe if probe is not None else adjoint_probe(z0.shape[0])
    return _implicit(forward, self)(shared, z0, per_row, threshold, probe)


ImplicitAdjoint.__init__ = keywords.renamed(max_steps="max_iters")(  # type: ignore[method-assign]
    ImplicitAdjoint.__init__)


@dataclasses.dataclass(frozen=True)
class UnrolledAdjoint(_Adjoint):
  """Backpropagation through every solver step (`iterate`'s "full" gradient).

  The gradient of the computation the solver did (solver update included),
  not of the map's fixed point: it tends to the implicit gradient as the
  solve converges, costs a backward through every step (checkpointed), and
  gives a gradient w.r.t. `h0`. For comparisons and for maps where the
  implicit gradient is not wanted.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> f = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(3), jnp.zeros((2, 3)), jnp.ones((2, 3))
    >>> loss = lambda w, adjoint: deq.fixed_point(f, w, h0, x, tol=1e-6,
    ...                                           adjoint=adjoint).sum()
    >>> g_unrolled = jax.grad(loss)(w, deq.UnrolledAdjoint())
    >>> g_implicit = jax.grad(loss)(w, deq.ImplicitAdjoint())
    >>> bool(jnp.allclose(g_unrolled, g_implicit, atol=1e-4))
    True
  """

  def _solve(self, forward: _Solve, shared: Any, z0: jax.Array, per_row: Any,
             threshold: jax.Array, probe: SolveInfo | None) -> tuple[jax.Array, SolveInfo]:
    del probe  # no adjoint solve: its gradient stays zero
    return solve_rows(forward.fmap, shared, z0, per_row, threshold, forward.solver,
                      forward.max_iters, forward.options, grad="full")


class _Flat:
  """Ravels a state pytree of [B, ...] leaves into [B, D] rows and back (any row count)."""

  def __init__(self, h0: Any):
    leaves, self.treedef = tree_util.tree_flatten(h0)
    if not leaves:
      raise ValueError("h0 must hold at least one array.")
    for leaf in leaves:
      if not jnp.issubdtype(leaf.dtype, jnp.floating):
        raise TypeError(f"fixed_point needs a floating state; got a leaf of {leaf.dtype=}.")
    self.tails = [leaf.shape[1:] for leaf in leaves]
    self.dtypes = [leaf.dtype for leaf in leaves]
    self.sizes = [math.prod(t) for t in self.tails]
    self.dtype = jnp.result_type(*self.dtypes)
    self.single = len(leaves) == 1 and len(self.tails[0]) == 1

  def ravel(self, h: Any) -> jax.Array:
    leaves = tree_util.tree_leaves(h)
    if self.single:
      return leaves[0].astype(self.dtype)
    rows = leaves[0].shape[0]
    return jnp.concatenate([a.reshape(rows, -1).astype(self.dtype) for a in leaves], axis=-1)

  def unravel(self, z: jax.Array) -> Any:
    if self.single:
      return tree_util.tree_unflatten(self.treedef, [z.astype(self.dtypes[0])])
    rows, out, start = z.shape[0], [], 0
    for tail, size, dtype in zip(self.tails, self.sizes, self.dtypes):
      out.append(z[:, start:start + size].reshape((rows,) + tail).astype(dtype))
      start += size
    return tree_util.tree_unflatten(self.treedef, out)


def solve_rows(fmap: Callable[[Any, jax.Array, Any], jax.Array], shared: Any, z0: jax.Array,
               per_row: Any, threshold: jax.Array, solver: deq_solvers.Solver, max_iters: int,
               options: Options, grad: Any = "full") -> tuple[jax.Array, SolveInfo]:
  """Solves z = fmap(shared, z, per_row) per row with `iterate`.

  Args:
    fmap: the map on a tile: (shared, z [R, D], per_row [R, ...]) -> [R, D].
    shared: pytree shared by every row (iterate's params).
    z0: [B, D] initial iterates.
    per_row: pytree of [B, ...] arrays, constant across steps.
    threshold: float32 [B]: a row halts once rms(f(z) - z) <= its threshold.
    solver: the `Solver`.
    max_iters: static int >= 1, the step budget of every row.
    options: how iterate runs (`pallas_loop.Options`).
    grad: iterate's gradient mode (only used by `UnrolledAdjoint`).

  Returns:
    (z*, SolveInfo): per row, f(z) at the z with the smallest residual seen
    (the halting one for converged rows: it is the first at most the
    threshold), with that residual.
  """

  def step(shared, state, xs):
    z, _, best_f, best_res, solver_state = state
    per_row, threshold = xs
    fz = fmap(shared, z, per_row)
    residual = row_rms(jax.lax.stop_gradient(fz - z))
    # A row that runs out of budget returns its best point, not its last.
    better = residual <= best_res
    best_f = jnp.where(better[:, None], fz, best_f)
    best_res = jnp.where(better, residual, best_res)
    z_next, solver_state = solver.update(solver_state, z, fz)
    return z_next, residual, best_f, best_res, solver_state

  def halt(shared, new, old, xs):
    return new[1] <= xs[1]

  inf = jnp.full(z0.shape[:1], jnp.inf, jnp.float32)
  state0 = (z0, inf, z0, inf, solver.init(z0))
  (_, _, z, residual, _), info = iterate(step, shared, state0, (per_row, threshold),
                                         max_iters=max_iters, halt=halt, grad=grad,
                                         return_info=True, options=options)
  return z, SolveInfo(info.steps, jax.lax.stop_gradient(residual), info.halted)


def _report(which: str, policy: str, tolerance: str, max_iters: int, info: SolveInfo,
            site: tuple[str, int]) -> None:
  """Reports non-converged rows by `policy`, from a host callback (works under jit).

  "warn" gives one warning per call site and solve (`notices.warn_once_at`),
  attributed to the caller's line; later failures there are counted by the
  caller (SolveInfo, `adjoint_probe`), not warned again.
  """
  if policy in ("ignore", "nan"):
    return

  def on_host(steps, residual, converged):
    bad = ~np.asarray(converged)
    if not bad.any():
      return
    worst = float(np.max(np.asarray(residual)[bad]))
    message = (f"pallas_loop.deq.fixed_point: {int(bad.sum())} of {bad.size} rows did not "
               f"converge in the {which} solve within max_iters={max_iters} ({tolerance}; "
               f"largest residual {worst:.3g}).")
    if policy == "raise":
      raise NonConvergenceError(message + " Raise max_iters, try another solver "
                                "(solver='broyden', deq.Anderson(m=10)), or choose "
                                "on_failure='warn'/'nan'/'ignore'.")
    notices.warn_once_at(
        f"deq {which} {site[0]}:{site[1]}",
        message + f" This warning is given once for this call and solve; count such rows "
        "yourself with return_info=True (forward) and deq.adjoint_probe (adjoint), or choose "
        "on_failure='raise'/'nan'/'ignore'. To converge: raise max_iters or try another "
        "solver (solver='broyden', deq.Anderson(m=10)).",
        NonConvergenceWarning, site)

  jax.debug.callback(on_host, info.steps, info.residual, info.converged)


def _tolerance(which: str, tol: Any) -> str:
  """What the tolerance of a solve is relative to, for the messages."""
  value = "traced" if isinstance(tol, jax.core.Tracer) else f"{float(tol):g}"
  if which == "forward":
    return f"tol={value} on each row's rms(f(h) - h), an absolute tolerance"
  return (f"tol={value} relative: each row stops once rms(u - (g + u df/dh)) <= tol x rms(g), "
          "g the row's cotangent")


def _nan_rows(converged: jax.Array, z: jax.Array) -> jax.Array:
  return jnp.where(converged[:, None], z, jnp.full_like(z, jnp.nan))


def _row_keys(key: Any, batch: int) -> jax.Array:
  """uint32 [B, 2]: row i's key is iterate's key of row i at step 0, a pure
  function of (key, i): it follows the row whatever the tiling or order."""
  data = random_lib.key_data(key).reshape(1, 2)
  return random_lib.step_keys(data, jnp.arange(batch, dtype=jnp.int32)[:, None],
                              jnp.zeros((batch, 1), jnp.int32))


def _check_probe(probe: Any, batch: int) -> SolveInfo:
  if not isinstance(probe, SolveInfo):
    raise TypeError(f"adjoint_probe must be deq.adjoint_probe(h0) (a SolveInfo of float32 "
                    f"zeros), got {type(probe).__name__}.")
  for name, leaf in zip(SolveInfo._fields, probe):
    if np.shape(leaf) != (batch,) or jnp.result_type(leaf) != jnp.float32:
      raise ValueError(f"adjoint_probe.{name} is {jnp.result_type(leaf)}{list(np.shape(leaf))}: "
                       f"it must be float32[{batch}], one entry per row of h0 "
                       "(make it with deq.adjoint_probe(h0)).")
  return probe


@keywords.renamed(max_steps="max_iters")
def fixed_point(
    f: Callable[..., Any],
    params: Any,
    h0: Any,
    x: Any = None,
    *,
    solver: deq_solvers.Solver | str | None = None,
    tol: float = 1e-5,
    max_iters: int = 50,
    key: jax.Array | None = None,
    adjoint: ImplicitAdjoint | UnrolledAdjoint | None = None,
    on_failure: str = "warn",
    return_info: bool = False,
    adjoint_probe: SolveInfo | None = None,
    options: Options | None = None,
    **kwargs: Any,
) -> Any:
  """Solves h = f(params, h, x) for each row, differentiably (a DEQ layer).

  Each row runs `solver` on the map until rms(f(h) - h) <= `tol` (then keeps
  f(h)) or `max_iters` map evaluations (then keeps f(h) at the h of smallest
  residual seen), and stops costing compute when it halts (one `iterate`
  call: the XLA loop, or the Pallas kernel with
  `options=pallas_loop.Options(implementation="pallas")`). The gradient is
  chosen by `adjoint`; by default the implicit gradient of f at the fixed
  point, whatever solver found it. Rows that do not converge are reported by `on_failure`.

  Args:
    f: the map `f(params, h, x) -> h`, written for a tile of rows like
      `iterate`'s step (every leaf of `h`, `x` has a leading row axis; rows
      independent); with `key`, `f(params, h, x, *, key)`. Arrays it closes
      over are differentiated like `params`.
    params: pytree shared by every row (may be None); differentiable.
    h0: pytree of float arrays [B, ...], the initial guess. Its gradient is
      zero under `ImplicitAdjoint`.
    x: pytree of arrays [B, ...] constant across steps, or None;
      differentiable.
    solver: a `Solver` (`deq.Broyden()`, the default, `deq.Anderson(m)`,
      `deq.Damped(beta)`, or your own subclass), or the name of a shipped
      one in its default configuration: "broyden", "anderson", "damped".
    tol: absolute tolerance on rms(f(h) - h) per row (a float, or a float
      scalar array).
    max_iters: static int >= 1, the map evaluations allowed per row (before
      0.3: `max_steps`, which now raises a TypeError naming this).
    key: None, or a JAX PRNG key: `f` then gets `key=`, uint32 [R, 2], one
      key per row, for `pallas_loop.random` (e.g. dropout). A row's key is
      the same at every solver step and in the adjoint solve (the map is a
      fixed function during the solve: a dropout mask stays put, as in
      variational dropout), and is a pure function of (key, the row's index
      in the batch): iterate's key of that row at step 0. Draw a new key per
      training step.
    adjoint: `ImplicitAdjoint(...)` (None: the default one) or
      `UnrolledAdjoint()`.
    on_failure: what happens when rows did not converge (forward solve, and
      the adjoint's unless it says otherwise): "warn" (the default: one
      `NonConvergenceWarning` per call site and solve, pointing at the line
      that calls `fixed_point`, from a host callback, so eagerly and under
      `jit`), "raise" (`NonConvergenceError` every time; under `jit` wrapped
      in a `JaxRuntimeError`), "nan" (those rows of the output, and of the
      adjoint, become NaN) or "ignore".
    return_info: also return the forward's `SolveInfo`.
    adjoint_probe: None, or `deq.adjoint_probe(h0)`: differentiate the loss
      w.r.t. it too, and its gradient is the adjoint solve's statistics
      (`SolveInfo.from_probe`), under `jit`, without a host callback.
    options: how to run, a `pallas_loop.Options` (None: `Options()`),
      forwarded whole to every `iterate` call (the forward solve and the
      adjoint's).
    **kwargs: nothing else is taken; `implementation=`, `block_rows=` and
      the other how-to-run keywords of earlier versions raise a TypeError
      that shows their spelling with `options=`.

  Returns:
    h* with the structure, shapes and dtypes of `h0`; with
    `return_info=True`, `(h*, SolveInfo(steps, residual, converged))`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> f = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, x = 0.5 * jnp.eye(2), jnp.ones((3, 2))
    >>> h, info = deq.fixed_point(f, w, jnp.zeros((3, 2)), x, return_info=True)
    >>> bool(jnp.all(info.converged)), bool(jnp.allclose(f(w, h, x), h, atol=1e-4))
    (True, True)

    Dropout inside the map: one mask per row, kept through the solve.

    >>> import jax, pallas_loop
    >>> g = lambda w, h, x, key: pallas_loop.random.dropout(key, jnp.tanh(h @ w + x), 0.1)
    >>> h = deq.fixed_point(g, w, jnp.zeros((3, 2)), x, key=jax.random.key(0))
  """
  options_lib.reject_keywords("fixed_point", kwargs)
  options = options_lib.check_options(options)
  site = notices.user_site()
  solver = deq_solvers.Broyden() if solver is None else deq_solvers.as_solver(solver)
  adjoint = ImplicitAdjoint() if adjoint is None else adjoint
  _check_policy("on_failure", on_failure)
  if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
    raise ValueError(f"{max_iters=} must be a Python int >= 1.")
  if not isinstance(adjoint, _Adjoint):
    raise TypeError(f"{adjoint=} must be deq.ImplicitAdjoint(...) or deq.UnrolledAdjoint().")
  flat = _Flat(h0)
  z0 = flat.ravel(h0)
  batch = z0.shape[0]
  if adjoint_probe is not None:
    adjoint_probe = _check_probe(adjoint_probe, batch)
  keyed = key is not None
  # The per-row keys travel with the rows, beside x (constant across steps).
  per_row = (x, _row_keys(key, batch)) if keyed else (x, None)

  def map_rows(p, z, xx):
    xx, keys = xx
    out = f(p, flat.unravel(z), xx, key=keys) if keyed else f(p, flat.unravel(z), xx)
    return flat.ravel(out)

  # Arrays f closes over become explicit (differentiated) operands: found at
  # the batch's shape, substituted at each tile's (a custom_vjp or a kernel
  # may capture nothing from outside).
  map_fn = step_fn_lib.StepFn.closing_over(map_rows, params, z0, per_row, name="f")
  consts = map_fn.outer_consts

  def fmap(shared, z, xx):
    p, c = shared
    return map_fn(p, c, z, xx)

  threshold = jnp.broadcast_to(jnp.asarray(tol, jnp.float32), (batch,))
  shared = (params, tuple(consts))
  forward = _Solve(fmap, solver, max_iters, options, tol, on_failure, site)
  # The strategy runs the solve with its gradient (the module's own method).
  z, info = adjoint._solve(  # pylint: disable=protected-access
      forward, shared, z0, per_row, threshold, adjoint_probe)
  _report("forward", on_failure, _tolerance("forward", tol), max_iters, info, site)
  if on_failure == "nan":
    z = _nan_rows(info.converged, z)
  h = flat.unravel(z)
  return (h, info) if return_info else h


def _implicit(forward: _Solve, adjoint: ImplicitAdjoint):
  """The forward solve as a custom_vjp whose backward is the implicit
  adjoint (`implicit_adjoint.vjp`), its fixed point solved by the DEQ's row
  solve with `adjoint`'s solver, tolerance (relative to each row's
  cotangent), budget and policy.

  Its last operand is the adjoint probe: the backward returns the adjoint
  solve's statistics as the probe's cotangent.
  """
  fmap, solver, max_iters, options = (forward.fmap, forward.solver, forward.max_iters,
                                      forward.options)
  # ImplicitAdjoint's __post_init__ made a named solver a Solver.
  adj_solver = solver if adjoint.solver is None else cast(deq_solvers.Solver, adjoint.solver)
  adj_tol = forward.tol if adjoint.tol is None else adjoint.tol
  adj_iters = max_iters if adjoint.max_iters is None else adjoint.max_iters
  adj_policy = forward.on_failure if adjoint.on_failure is None else adjoint.on_failure

  @jax.custom_vjp
  def run(shared, z0, per_row, threshold, probe):
    del probe
    return solve_rows(fmap, shared, z0, per_row, threshold, solver, max_iters, options)

  def run_fwd(shared, z0, per_row, threshold, probe):
    del probe
    z, info = solve_rows(fmap, shared, z0, per_row, threshold, solver, max_iters, options)
    return (z, info), (shared, per_row, z, threshold)

  def run_bwd(saved, cotangents):
    shared, per_row, z_star, threshold = saved
    g = cotangents[0]
    # Relative to the row's cotangent; the forward's tol (maybe traced) travels
    # in `threshold`, never closed over (a custom_vjp rule must not capture).
    rel = threshold if adjoint.tol is None else jnp.full_like(threshold, adjoint.tol)
    adj_threshold = rel * row_rms(g)

    def solve(step, shared, g0, rows):
      return solve_rows(step, shared, g0, rows, adj_threshold, adj_solver, adj_iters, options)

    def settle(u, info):
      callback = adjoint.callback
      if callback is not None:
        jax.debug.callback(lambda *a: callback(SolveInfo(*a)), *info)
      _report("adjoint", adj_policy, _tolerance("adjoint", adj_tol), adj_iters, info,
              forward.site)
      return _nan_rows(info.converged, u) if adj_policy == "nan" else u

    g_shared, g_per_row, info = implicit_adjoint.vjp(fmap, shared, z_star, per_row, g, solve,
                                                     settle)
    stats = SolveInfo(info.steps.astype(jnp.float32), info.residual.astype(jnp.float32),
                      info.converged.astype(jnp.float32))
    return g_shared, jnp.zeros_like(z_star), g_per_row, jnp.zeros_like(threshold), stats

  run.defvjp(run_fwd, run_bwd)
  return run
