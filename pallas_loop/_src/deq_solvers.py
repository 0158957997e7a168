"""Per-row fixed-point solvers for `pallas_loop.deq` (damped iteration, Anderson).

# R: rows of a tile  D: the row's flattened state  m: Anderson's window

A solver is an object with `init(z) -> state` and
`update(state, z, fz) -> (z_next, state)`, both on one tile of rows: `z` and
`fz = f(z)` are [R, D], `state` a pytree of arrays with a leading R axis.
Rows are independent (no reduction across rows) so the update runs inside
`iterate`'s step, in the XLA loop and in the Pallas kernel alike. Everything
here is elementwise arithmetic, `where` and sums over the last axis: the
Anderson window is a tuple of m separate [R, D] arrays (shifted, never
indexed) and its m x m least-squares solve is Gaussian elimination written on
[R] vectors, without `lax.linalg` (which Pallas does not lower).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def _row_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  """[R, D] x [R, D] -> [R]: the per-row inner product."""
  return jnp.sum(a * b, axis=-1)


class Solver(abc.ABC):
  """A per-row fixed-point solver for `pallas_loop.deq.fixed_point`.

  Subclass it to plug in your own solver (Broyden, a line search, ...): the
  solver owns its state, `fixed_point` owns the map, the halting on the map's
  residual and the implicit gradient (of the map, not of your update).

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> class Halfway(deq.Solver):
    ...   def init(self, z):
    ...     return ()
    ...   def update(self, state, z, fz):
    ...     return 0.5 * (z + fz), state
    >>> h = deq.fixed_point(lambda w, h, x: 0.5 * h + x, None, jnp.zeros((2, 3)),
    ...                     jnp.ones((2, 3)), solver=Halfway(), tol=1e-6, max_steps=100)
    >>> bool(jnp.allclose(h, 2.0, atol=1e-4))
    True
  """

  @abc.abstractmethod
  def init(self, z: jax.Array) -> Any:
    """The solver state before the first step.

    Args:
      z: float [R, D], the initial iterate of each row.

    Returns:
      A pytree of arrays, each with leading axis R (may be empty: `()`).
    """

  @abc.abstractmethod
  def update(self, state: Any, z: jax.Array, fz: jax.Array) -> tuple[jax.Array, Any]:
    """One step: the next iterate from the current one and its image.

    Args:
      state: the solver state (as returned by `init` or the last `update`).
      z: float [R, D], the current iterate.
      fz: float [R, D], the map at `z`.

    Returns:
      `(z_next, state)`: the next iterate [R, D] and the new state.
    """


@dataclasses.dataclass(frozen=True)
class Damped(Solver):
  """Damped (Krasnosel'skii-Mann) iteration: z <- (1 - beta) z + beta f(z).

  `beta=1` is plain iteration. Damping makes a map whose Jacobian has
  eigenvalues with real part < 1 (e.g. -1.2, an oscillating map) converge,
  but not one with a real eigenvalue > 1: use `Anderson` there.

  Attributes:
    beta: the step size, in (0, 1].

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> # f(h) = -1.5 h + 1 oscillates and diverges undamped; beta=0.4 converges.
    >>> f = lambda p, h, x: -1.5 * h + 1.0
    >>> h = deq.fixed_point(f, None, jnp.zeros((2, 1)), solver=deq.Damped(0.4),
    ...                     tol=1e-6, max_steps=100)
    >>> bool(jnp.allclose(h, 0.4, atol=1e-5))
    True
  """

  beta: float = 1.0

  def __post_init__(self):
    if not 0.0 < float(self.beta) <= 1.0:
      raise ValueError(f"Damped({self.beta=}) must be in (0, 1].")

  def init(self, z: jax.Array) -> Any:
    """No state. Args: z: [R, D]. Returns: `()`."""
    return ()

  def update(self, state: Any, z: jax.Array, fz: jax.Array) -> tuple[jax.Array, Any]:
    """Args: state: `()`. z, fz: [R, D]. Returns: `((1-beta) z + beta fz, ())`."""
    return z + self.beta * (fz - z), state


@dataclasses.dataclass(frozen=True)
class Anderson(Solver):
  """Anderson acceleration (type II) with a window of the last m iterates, per row.

  Keeps the last m pairs (z_i, f(z_i)) of each row; with residuals
  g_i = f(z_i) - z_i, finds weights alpha (summing to 1) minimising
  |sum_i alpha_i g_i|^2 + ridge |alpha|^2 (relative to the largest |g_i|^2),
  and moves to z = sum_i alpha_i ((1 - beta) z_i + beta f(z_i)). The m x m
  solve is Gaussian elimination on the row's (symmetric positive definite)
  Gram matrix, elementwise over rows; a row whose solve is not finite falls
  back to a damped step. Solves non-contractive maps that plain iteration
  cannot (it behaves like GMRES on a linear map). State per row: 2m + 1
  vectors of D.

  Attributes:
    m: window size (static int >= 1; m = 1 is damped iteration).
    beta: mixing (damping) in (0, 1].
    ridge: Tikhonov regularisation of the Gram matrix, relative to its
      largest diagonal entry (> 0).
    differentiate_weights: only matters when gradients flow through the
      solver's steps (`UnrolledAdjoint`). False (the default): the mixing
      weights alpha are constants of the backward, so the unrolled gradient
      is that of a combination of map evaluations and tends to the implicit
      one. True: also backpropagate through the least-squares solve, which
      becomes ill-conditioned as the residuals shrink (on
      `examples/deq_training.py`'s problem at initialisation the gradient
      came out about 7700 times too large).

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> # A linear map with an eigenvalue 1.5 (> 1): plain iteration diverges.
    >>> a = jnp.array([[1.5, 0.0], [0.0, 0.5]])
    >>> f = lambda a, h, x: h @ a + x
    >>> h = deq.fixed_point(f, a, jnp.zeros((1, 2)), jnp.ones((1, 2)),
    ...                     solver=deq.Anderson(m=3), tol=1e-6, max_steps=30)
    >>> [round(float(v), 3) for v in h[0]]   # h = (I - A)^-1 x
    [-2.0, 2.0]
  """

  m: int = 5
  beta: float = 1.0
  ridge: float = 1e-8
  differentiate_weights: bool = False

  def __post_init__(self):
    if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1:
      raise ValueError(f"Anderson({self.m=}) must be a Python int >= 1.")
    if not 0.0 < float(self.beta) <= 1.0:
      raise ValueError(f"Anderson({self.beta=}) must be in (0, 1].")
    if not float(self.ridge) > 0.0:
      raise ValueError(f"Anderson({self.ridge=}) must be > 0.")

  def init(self, z: jax.Array) -> Any:
    """Empty window. Args: z: [R, D]. Returns: (zs, fs, filled): m-tuples of [R, D], [R]."""
    zeros = jnp.zeros_like(z)
    # `filled` counts the window's valid entries, as a float (no integer leaf
    # in the state, so the unrolled gradient through the solver works too).
    return (tuple(zeros for _ in range(self.m)), tuple(zeros for _ in range(self.m)),
            jnp.zeros(z.shape[:1], z.dtype))

  def update(self, state: Any, z: jax.Array, fz: jax.Array) -> tuple[jax.Array, Any]:
    """One Anderson step. Args: state, z, fz as `Solver.update`. Returns: (z_next, state)."""
    zs, fs, filled = state
    m = self.m
    # Newest first; the oldest pair leaves the window.
    zs = (z,) + zs[:-1]
    fs = (fz,) + fs[:-1]
    filled = jnp.minimum(filled + 1, m)
    valid = [filled > i for i in range(m)]                       # m x [R] bool
    gs = [f_i - z_i for z_i, f_i in zip(zs, fs)]                 # m x [R, D]
    dots = {(i, j): _row_dot(gs[i], gs[j]) for i in range(m) for j in range(i, m)}
    gram = [[dots[min(i, j), max(i, j)] for j in range(m)] for i in range(m)]
    scale = gram[0][0]
    for i in range(1, m):
      scale = jnp.where(valid[i], jnp.maximum(scale, gram[i][i]), scale)
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    one, zero = jnp.ones_like(scale), jnp.zeros_like(scale)
    # A = G G^T / scale + ridge I on the valid block, the identity elsewhere;
    # the right-hand side is 1 on valid entries: alpha = A^-1 1 / (1^T A^-1 1).
    a = [[jnp.where(valid[i] & valid[j], gram[i][j] / scale + (self.ridge if i == j else 0.0),
                    one if i == j else zero) for j in range(m)] for i in range(m)]
    rhs = [jnp.where(valid[i], one, zero) for i in range(m)]
    w = _solve_spd(a, rhs)
    total = sum(w[1:], w[0])
    alpha = [w_i / total for w_i in w]
    if not self.differentiate_weights:
      alpha = [jax.lax.stop_gradient(a_i) for a_i in alpha]
    mixed = sum((alpha[i][:, None] * (zs[i] + self.beta * gs[i]) for i in range(1, m)),
                alpha[0][:, None] * (zs[0] + self.beta * gs[0]))
    damped = z + self.beta * (fz - z)
    # A non-finite element makes the row's sum non-finite (a float sum, not
    # jnp.all: Triton has no reduce_and).
    ok = jnp.isfinite(jnp.sum(mixed, axis=-1)) & jnp.isfinite(total) & (total != 0)
    return jnp.where(ok[:, None], mixed, damped), (zs, fs, filled)


def _solve_spd(a: list[list[jax.Array]], b: list[jax.Array]) -> list[jax.Array]:
  """Solves A w = b per row by Gaussian elimination without pivoting.

  Args:
    a: m x m nested list of [R] arrays (symmetric positive definite per row).
    b: m [R] arrays.

  Returns:
    m [R] arrays, the solution per row.
  """
  m = len(b)
  a = [list(row) for row in a]
  b = list(b)
  for k in range(m):
    for i in range(k + 1, m):
      factor = a[i][k] / a[k][k]
      for j in range(k, m):
        a[i][j] = a[i][j] - factor * a[k][j]
      b[i] = b[i] - factor * b[k]
  w: list[Any] = [None] * m
  for i in reversed(range(m)):
    acc = b[i]
    for j in range(i + 1, m):
      acc = acc - a[i][j] * w[j]
    w[i] = acc / a[i][i]
  return w
