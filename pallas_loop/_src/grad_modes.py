"""The gradient modes of `iterate` (its `grad=` argument), each owning its rule.

A mode says what the forward saves (`GradMode.saves`) and how the backward
runs from it (`GradMode.backward`); `iterate` wires any mode into its
custom_vjp the same way. `Full`, `Truncated` and `Phantom` are each one VJP
of a per-row window of steps (`loop_reverse.py`); `Implicit` is the implicit
adjoint core (`implicit_adjoint.py`, which `pallas_loop.deq` calls too), its
adjoint fixed point solved with `iterate` itself. When to use which, and what each
costs in memory: the documentation's "Gradients and memory" page.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src import implicit_adjoint
from pallas_loop._src import loop as loop_lib
from pallas_loop._src import loop_reverse
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src import tiling
from pallas_loop._src import validation
from pallas_loop._src.operands import Gradients, LoopOperands, LoopOutputs, WindowOperands

# Whether `Implicit`'s adjoint solve runs its rows in the order of the steps
# they took forward (False: the caller's order; `benchmarks.deq_split` times
# both).
ADJOINT_IN_STEP_ORDER = True


@dataclasses.dataclass(frozen=True)
class Context:
  """What a mode's backward may use, beyond what its forward saved.

  Attributes:
    fn: the body as a `step_fn.StepFn`: fn(params, consts, h, x, t, rows)
      -> (h_new, flag).
    forward: the dispatched forward, LoopOperands -> LoopOutputs.
    window: the dispatched window VJP: window(WindowOperands, bound, every)
      -> (g_params, g_consts, g_h_start, g_x); `bound` (static) bounds n,
      `every` is the checkpoint interval (None: the default).
    max_iters: the forward's static step bound.
    iterate: `pallas_loop.iterate` with the call's `Options` (for a mode
      that solves with it, e.g. `Implicit`).
  """

  fn: step_fn_lib.StepFn
  forward: Callable[[LoopOperands], LoopOutputs]
  window: Callable[[WindowOperands, int, int | None], Gradients]
  max_iters: int
  iterate: Callable[..., Any]


class Saved(NamedTuple):
  """What the forward keeps for the backward: the operands (h0 only where
  the mode needs it, never the counts), the steps each row applied (the
  backward replays exactly those, so halting decisions need not be
  reproduced) and the output state (only where the mode needs it)."""

  ops: LoopOperands
  steps: jax.Array
  h_out: Any


def _zero_rows(keep: jax.Array, tree):
  """Rows where `keep` ([B]) from `tree`, zeros elsewhere."""
  return loop_lib.select_rows(keep[:, None], tree, tree_util.tree_map(jnp.zeros_like, tree))


def _last_steps_window(k: int, ctx: Context, saved: Saved, h_start: Any, g: Any,
                       g_ys: Any = None) -> Gradients:
  """The VJP of each row's last min(k, steps) steps, started from `h_start`
  (the state before them) with their own step indices (and the cotangents
  of those steps' outputs, `g_ys`, if any)."""
  ops, steps = saved.ops, saved.steps
  n = jnp.minimum(steps, k)
  window = WindowOperands(ops.params, ops.consts, h_start, ops.x, steps - n, n, ops.row_ids, g,
                          g_ys)
  # A step that takes its scalar index, or returns per-step outputs, runs the
  # windows on one clock (`loop_reverse.reverse_window(aligned=True)`): rows
  # of a group then span up to max_iters trips, not k.
  aligned = ctx.fn.indexed or ctx.fn.outputs
  bound = ctx.max_iters if aligned else min(k, ctx.max_iters)
  return ctx.window(window, bound, None)


class GradMode(abc.ABC):
  """A gradient mode: what the forward saves and how the backward runs.

  A new mode is one subclass: set `keeps_h0`/`keeps_output` and write
  `backward`; `iterate` asks nothing else of it.
  """

  keeps_h0: ClassVar[bool]
  keeps_output: ClassVar[bool]
  # Whether the mode defines the gradient of per-step outputs (`step_outputs`).
  takes_outputs: ClassVar[bool] = False

  def saves(self, ops: LoopOperands, out: LoopOutputs) -> Saved:
    """The residuals of the custom_vjp."""
    return Saved(ops._replace(h0=ops.h0 if self.keeps_h0 else None, counts=None),
                 out.steps, out.h if self.keeps_output else None)

  @abc.abstractmethod
  def backward(self, ctx: Context, saved: Saved, g, g_ys=None) -> Gradients:
    """Cotangents of (params, consts, h0, x) for the output cotangent `g`
    (and `g_ys`, the per-step outputs' [B, T, ...], where `takes_outputs`)."""

  def reference_grad(self) -> dict[str, Any] | None:
    """The keyword arguments with which the oracle (`pallas_loop._reference`)
    computes this mode's gradient, or None when it has no counterpart there."""
    return None

  def traces_backward_early(self, ctx: Context) -> bool:
    """Whether `iterate` traces this mode's backward in the forward too: when
    the backward calls the step at a shape the forward does not, retracing
    it there would touch the arrays the step closes over after their trace
    ended (an `UnexpectedTracerError` under `jax.grad` w.r.t. such an array);
    traced early, the step's jaxpr at that shape is kept (`StepFn.traced`)."""
    del ctx
    return False


@dataclasses.dataclass(frozen=True)
class Full(GradMode):
  """Exact backpropagation through every applied step, checkpointed.

  Attributes:
    checkpoint_every: save the state every this many steps in the backward's
      forward replay and recompute the steps in between. None:
      `ceil(sqrt(max_iters))`, which minimises the states held (about
      `2 sqrt(max_iters)` per row); on a TPU's backward kernel, `max_iters`
      itself where a group of rows holding that many states fits VMEM (no
      replay pass: each step's state is computed twice, not three times),
      else that. 1 keeps every state (no recomputation, O(max_iters)
      memory).

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(4), jnp.ones((3, 4)), jnp.zeros((3, 4))
    >>> loss = lambda w: pallas_loop.iterate(
    ...     step, w, h0, x, iters=jnp.array([1, 5, 64]), max_iters=64,
    ...     grad=pallas_loop.Full(checkpoint_every=8)).sum()
    >>> jax.grad(loss)(w).shape
    (4, 4)
  """

  checkpoint_every: int | None = None

  keeps_h0 = True
  keeps_output = False
  takes_outputs = True

  def __post_init__(self):
    if self.checkpoint_every is not None:
      validation.static_int("Full(checkpoint_every)", self.checkpoint_every, 1)

  def backward(self, ctx: Context, saved: Saved, g, g_ys=None) -> Gradients:
    ops, steps = saved.ops, saved.steps
    window = WindowOperands(ops.params, ops.consts, ops.h0, ops.x, jnp.zeros_like(steps),
                            steps, ops.row_ids, g, g_ys)
    return ctx.window(window, ctx.max_iters, self.checkpoint_every)

  def reference_grad(self) -> dict[str, Any] | None:
    return {}


@dataclasses.dataclass(frozen=True)
class Truncated(GradMode):
  """Backpropagation through each row's last `k` applied steps only.

  A row that applied n <= k steps gets its exact gradient (w.r.t. `h0` too);
  a row with n > k gets the gradient of its last k steps w.r.t. `params` and
  `x` and none w.r.t. `h0` (as if the state before them were
  `stop_gradient`-ed). The n - k earlier steps are rerun in the backward
  without saving anything. The training recipe of recurrent-depth models:
  sample a depth, backpropagate through the last k steps.

  Attributes:
    k: static int >= 1.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(4), jnp.ones((3, 4)), jnp.zeros((3, 4))
    >>> loss = lambda w: pallas_loop.iterate(
    ...     step, w, h0, x, iters=jnp.array([1, 5, 64]), max_iters=64,
    ...     grad=pallas_loop.Truncated(8)).sum()
    >>> jax.grad(loss)(w).shape
    (4, 4)
  """

  k: int

  keeps_h0 = True
  keeps_output = False
  takes_outputs = True

  def __post_init__(self):
    validation.static_int("Truncated(k)", self.k, 1)

  def backward(self, ctx: Context, saved: Saved, g, g_ys=None) -> Gradients:
    ops, steps = saved.ops, saved.steps
    skipped = steps - jnp.minimum(steps, self.k)
    # The state before each row's last k steps: rerun the others, saving nothing.
    h_start = ctx.forward(ops._replace(counts=skipped, halting=None)).h
    g_params, g_consts, g_start, g_x = _last_steps_window(self.k, ctx, saved, h_start, g, g_ys)
    return g_params, g_consts, _zero_rows(skipped == 0, g_start), g_x

  def reference_grad(self) -> dict[str, Any] | None:
    return {"truncate": self.k}


@dataclasses.dataclass(frozen=True)
class Implicit(GradMode):
  """The implicit-function gradient at a fixed point `h* = f(h*, x; params)`.

  With g the output cotangent, solves the adjoint fixed point
  `u = g + u·∂f/∂h(h*)` per row by iterating the step's VJP with `iterate`
  itself (halting at rms update <= `tol`, at most `max_iters` steps; the same
  implementation as the forward), then returns u·∂f/∂(params, x). Exact for
  rows that converged to a fixed point of a contraction; an approximation for
  rows that stopped on their budget. The gradient w.r.t. `h0` is zero, except
  for rows that applied no step (their output is `h0`). Saves only `h*`. The
  adjoint solve runs the rows in the order of the steps they took forward
  (their adjoint stops about as late), so that a kernel's tile holds rows that
  stop together; the cotangents come back in the caller's order.

  Attributes:
    tol: rms tolerance of the adjoint iteration (float > 0), or None (the
      default): the forward call's `tol` (which may be traced), or
      `DEFAULT_TOL` when the forward has none.
    max_iters: its step budget (static int >= 1), or None (the default): the
      forward call's `max_iters`.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(4), jnp.ones((3, 4)), jnp.zeros((3, 4))
    >>> loss = lambda w: pallas_loop.iterate(
    ...     step, w, h0, x, max_iters=100, tol=1e-5,
    ...     grad=pallas_loop.Implicit()).sum()
    >>> jax.grad(loss)(w).shape
    (4, 4)
  """

  tol: float | None = None
  max_iters: int | None = None

  DEFAULT_TOL: ClassVar[float] = 1e-6
  keeps_h0 = False
  keeps_output = True

  def __post_init__(self):
    if self.max_iters is not None:
      validation.static_int("Implicit(max_iters)", self.max_iters, 1)
    if self.tol is None:
      return
    if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float, np.floating)):
      raise TypeError(f"Implicit(tol) must be a Python float > 0 or None (the forward's "
                      f"tol), got {self.tol!r}.")
    if not self.tol > 0:
      raise ValueError(f"Implicit(tol) must be > 0, got {self.tol}.")

  def backward(self, ctx: Context, saved: Saved, g, g_ys=None) -> Gradients:
    ops, steps, h_star = saved.ops, saved.steps, saved.h_out
    # Unless given, the adjoint solve halts like the forward and has its budget.
    budget = ctx.max_iters if self.max_iters is None else self.max_iters
    tol = self.tol
    if tol is None:
      forward_tol = None if ops.halting is None else ops.halting.tol
      tol = self.DEFAULT_TOL if forward_tol is None else forward_tol
    t_last = jnp.maximum(steps - 1, 0)[:, None]
    rows = ops.row_ids[:, None]
    # The adjoint is carried for the float leaves of the state only: integer
    # and bool leaves (counters, flags) have no derivative.
    g_floats = loop_reverse.float_leaves(g)
    if not g_floats:
      return _no_gradients(ops, g)
    # A row that took no step has no adjoint (`settle` zeroes its u): from a
    # zero cotangent its u stays 0 and halts after one step, so every row can
    # be given the one budget, which `iterate` knows at trace time: it then
    # sorts and moves no row (a [B] array of budgets and zeros was sorted).
    g_floats = [_zero_rows(steps > 0, a) for a in g_floats]
    per_row = (ops.x, t_last, rows)
    took = steps
    if ADJOINT_IN_STEP_ORDER:
      # Each row's adjoint solve halts on the tolerance, and a kernel's tile
      # runs until its slowest row stops. How many steps the adjoint takes
      # follows how many the forward took (the same map's contraction at the
      # same point sets both), so the rows are solved in the order of their
      # forward steps: a tile then holds rows that stop together. One sort of
      # the steps, a gather of the rows' operands, and their cotangents put
      # back after.
      _, order = tiling.sorted_descending(steps)
      h_star, per_row, g_floats, took = tiling.take_rows((h_star, per_row, g_floats, steps),
                                                         order)

    def fmap(shared, h, per_row):  # each row at its last step's index and key
      x, t, r = per_row
      return ctx.fn.new_state_per_row(shared, h, x, t, r)

    def solve(step, shared, g0, per_row):  # plain iteration, as the forward halts
      return ctx.iterate(step, shared, g0, per_row, iters=budget, max_iters=budget,
                         tol=tol), None

    settle = lambda u, _: [_zero_rows(took > 0, a) for a in u]
    (g_params, g_consts), (g_x, _, _), _ = implicit_adjoint.vjp(
        fmap, (ops.params, ops.consts), h_star, per_row, g_floats, solve, settle)
    if ADJOINT_IN_STEP_ORDER:
      g_x = tiling.take_rows(g_x, tiling.inverse_permutation(order, by_sort=True))
    return g_params, g_consts, _zero_rows(steps == 0, g), g_x

  def traces_backward_early(self, ctx: Context) -> bool:
    # A step that takes its index runs one row at a time in the adjoint
    # (`StepFn.new_state_per_row`): a shape of one row the forward never uses.
    return ctx.fn.indexed


def _no_gradients(ops: LoopOperands, g: Any) -> Gradients:
  """Gradients of a state without float leaves: none (None) for the shared
  operands and inputs, `g` (zeros) for the state."""
  none = lambda tree: tree_util.tree_map(lambda _: None, tree)
  return none(ops.params), none(list(ops.consts)), g, none(ops.x)


@dataclasses.dataclass(frozen=True)
class Phantom(GradMode):
  """The gradient of k steps unrolled from the stopped-gradient output.

  The output value is the forward's `h*`; its gradient is that of
  `step^m(stop_gradient(h*))` with m = min(k, n_i) for row i (a cheap
  approximation of `Implicit` for deep equilibrium models). The unrolled
  steps reuse the step indices (and random keys) of the row's last m steps.
  Rows that applied no step pass `h0` through; the others give no gradient
  w.r.t. `h0`.

  Attributes:
    k: static int >= 1.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(4), jnp.ones((3, 4)), jnp.zeros((3, 4))
    >>> loss = lambda w: pallas_loop.iterate(
    ...     step, w, h0, x, max_iters=30, grad=pallas_loop.Phantom(5)).sum()
    >>> jax.grad(loss)(w).shape
    (4, 4)
  """

  k: int

  keeps_h0 = False
  keeps_output = True

  def __post_init__(self):
    validation.static_int("Phantom(k)", self.k, 1)

  def backward(self, ctx: Context, saved: Saved, g, g_ys=None) -> Gradients:
    g_params, g_consts, _, g_x = _last_steps_window(self.k, ctx, saved, saved.h_out, g)
    return g_params, g_consts, _zero_rows(saved.steps == 0, g), g_x


def as_mode(grad: Any) -> GradMode:
  """`grad=` as a mode object; "full" is `Full()`. Raises on anything else."""
  if isinstance(grad, str) and grad == "full":
    return Full()
  if isinstance(grad, GradMode):
    return grad
  raise ValueError(
      f"grad must be 'full', pallas_loop.Full(...), pallas_loop.Truncated(k), "
      f"pallas_loop.Implicit(...) or pallas_loop.Phantom(k); got {grad!r}.")
