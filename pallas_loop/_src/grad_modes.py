"""The gradient modes of `iterate` (its `grad=` argument).

Which one to use (see the README's "Gradients" section for memory and cost):

* `"full"` / `Full()`: exact gradients through every applied step. The
  backward recomputes the forward from checkpoints saved every C ~ sqrt(W)
  steps, so memory grows like O(sqrt(max_iters)).
* `Truncated(k)`: exact gradients through each row's last k applied steps
  only (recurrent-depth training); the earlier steps are rerun without
  saving anything and pass no gradient to `h0`.
* `Implicit()`: the implicit-function gradient at a fixed point (deep
  equilibrium models): the adjoint fixed point u = g + u·∂f/∂h is solved by
  `iterate` itself; memory O(1) in the step count.
* `Phantom(k)`: the gradient of k steps unrolled from the stopped-gradient
  output (a cheap approximation of the implicit gradient).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def _static_int(name: str, value, lowest: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a static Python int >= {lowest}, got {value!r} "
                    f"of type {type(value).__name__}.")
  if value < lowest:
    raise ValueError(f"{name} must be >= {lowest}, got {value}.")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Full:
  """Exact backpropagation through every applied step, checkpointed.

  Attributes:
    checkpoint_every: save the state every this many steps in the backward's
      forward replay and recompute the steps in between. None: ceil(sqrt(
      max_iters)), which minimises the states held (about 2 sqrt(max_iters)
      per row). 1 keeps every state (the fastest, O(max_iters) memory).

  Example:
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

  def __post_init__(self):
    if self.checkpoint_every is not None:
      _static_int("Full(checkpoint_every)", self.checkpoint_every, 1)


@dataclasses.dataclass(frozen=True)
class Truncated:
  """Backpropagation through each row's last `k` applied steps only.

  A row that applied n <= k steps gets its exact gradient (w.r.t. `h0` too);
  a row with n > k gets the gradient of its last k steps w.r.t. `params` and
  `x` and none w.r.t. `h0` (as if the state before them were
  `stop_gradient`-ed). The n - k earlier steps are rerun in the backward
  without saving anything. The training recipe of recurrent-depth models:
  sample a depth, backpropagate through the last k steps.

  Attributes:
    k: static int >= 1.

  Example:
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

  def __post_init__(self):
    _static_int("Truncated(k)", self.k, 1)


@dataclasses.dataclass(frozen=True)
class Implicit:
  """The implicit-function gradient at a fixed point h* = f(h*, x; params).

  With g the output cotangent, solves the adjoint fixed point
  u = g + u·∂f/∂h(h*) per row by iterating the step's VJP with `iterate`
  itself (halting at rms update <= `tol`, at most `max_iters` steps; the same
  implementation as the forward), then returns u·∂f/∂(params, x). Exact for
  rows that converged to a fixed point of a contraction; an approximation for
  rows that stopped on their budget. The gradient w.r.t. `h0` is zero, except
  for rows that applied no step (their output is `h0`). Saves only h*.

  Attributes:
    tol: rms tolerance of the adjoint iteration (float > 0), or None (the
      default): the forward call's `tol` (which may be traced), or
      `DEFAULT_TOL` when the forward has none.
    max_iters: its step budget (static int >= 1), or None (the default): the
      forward call's `max_iters`.

  Example:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(4), jnp.ones((3, 4)), jnp.zeros((3, 4))
    >>> loss = lambda w: pallas_loop.iterate(
    ...     step, w, h0, x, max_iters=100, tol=1e-5, grad=pallas_loop.Implicit()).sum()
    >>> jax.grad(loss)(w).shape
    (4, 4)
  """

  tol: float | None = None
  max_iters: int | None = None

  DEFAULT_TOL = 1e-6

  def __post_init__(self):
    if self.max_iters is not None:
      _static_int("Implicit(max_iters)", self.max_iters, 1)
    if self.tol is None:
      return
    if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float, np.floating)):
      raise TypeError(f"Implicit(tol) must be a Python float > 0 or None (the forward's "
                      f"tol), got {self.tol!r}.")
    if not self.tol > 0:
      raise ValueError(f"Implicit(tol) must be > 0, got {self.tol}.")


@dataclasses.dataclass(frozen=True)
class Phantom:
  """The gradient of k steps unrolled from the stopped-gradient output.

  The output value is the forward's h*; its gradient is that of
  `step^m(stop_gradient(h*))` with m = min(k, n_i) for row i (a cheap
  approximation of `Implicit` for deep equilibrium models). The unrolled
  steps reuse the step indices (and random keys) of the row's last m steps.
  Rows that applied no step pass `h0` through; the others give no gradient
  w.r.t. `h0`.

  Attributes:
    k: static int >= 1.

  Example:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: jnp.tanh(h @ w + x)
    >>> w, h0, x = 0.5 * jnp.eye(4), jnp.ones((3, 4)), jnp.zeros((3, 4))
    >>> loss = lambda w: pallas_loop.iterate(
    ...     step, w, h0, x, max_iters=30, grad=pallas_loop.Phantom(5)).sum()
    >>> jax.grad(loss)(w).shape
    (4, 4)
  """

  k: int

  def __post_init__(self):
    _static_int("Phantom(k)", self.k, 1)


def as_mode(grad) -> Full | Truncated | Implicit | Phantom:
  """`grad=` as a mode object; "full" is `Full()`. Raises on anything else."""
  if isinstance(grad, str) and grad == "full":
    return Full()
  if isinstance(grad, (Full, Truncated, Implicit, Phantom)):
    return grad
  raise ValueError(
      f"grad must be 'full', pallas_loop.Full(...), pallas_loop.Truncated(k), "
      f"pallas_loop.Implicit(...) or pallas_loop.Phantom(k); got {grad!r}.")
