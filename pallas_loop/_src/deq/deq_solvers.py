"""Per-row fixed-point solvers for `pallas_loop.deq` (damped iteration, Anderson, Broyden).

# R: rows of a tile  D: the row's flattened state  m: a solver's window / memory

A solver is an object with `init(z) -> state` and
`update(state, z, fz) -> (z_next, state)`, both on one tile of rows: `z` and
`fz = f(z)` are [R, D], `state` a pytree of arrays with a leading R axis.
Rows are independent (no reduction across rows) so the update runs inside
`iterate`'s step, in the XLA loop and in the Pallas kernel alike. Everything
here is elementwise arithmetic, `where` and sums over the last axis: the
Anderson window is a tuple of m separate [R, D] arrays (shifted, never
indexed) and its m x m least-squares solve is Gaussian elimination written on
[R] vectors, without `lax.linalg` (which Pallas does not lower); Broyden's
low-rank inverse Jacobian is m pairs of [R, D] vectors applied with per-row
dot products.
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

  Subclass it to plug in your own solver (a line search, ...): the
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
    ...                     jnp.ones((2, 3)), solver=Halfway(), tol=1e-6, max_iters=100)
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
  but not one with a real eigenvalue > 1: use `Broyden` or `Anderson` there.

  Attributes:
    beta: the step size, in (0, 1].

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> # f(h) = -1.5 h + 1 oscillates and diverges undamped; beta=0.4 converges.
    >>> f = lambda p, h, x: -1.5 * h + 1.0
    >>> h = deq.fixed_point(f, None, jnp.zeros((2, 1)), solver=deq.Damped(0.4),
    ...                     tol=1e-6, max_iters=100)
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
  """Safeguarded Anderson acceleration (type II) with a window of the last m iterates, per row.

  Keeps the last m pairs (z_i, f(z_i)) of each row; with residuals
  g_i = f(z_i) - z_i, finds weights alpha (summing to 1) minimising
  |sum_i alpha_i g_i|^2 + lambda |alpha|^2, and moves to
  z = sum_i alpha_i ((1 - beta) z_i + beta f(z_i)). The m x m solve is
  Gaussian elimination on the row's Gram matrix (symmetric positive definite
  with the ridge), elementwise over rows, in float32 or wider.

  Safeguards, per row:

  * Regularisation scaled to the residuals and to float precision: lambda is
    `max(ridge, 10 eps)` times the largest |g_i|^2 in the window (eps of the
    solve's dtype, float32 or wider: 1.2e-7 in float32). Residuals that are
    (nearly) collinear, as every residual of a scalar-like map such as
    f(z) = -2 z + 1 is, make the Gram matrix singular to float precision; a
    ridge below it (1e-8 in float32) gives finite but wrong weights. With the
    floor that map converges in 6 steps from `h0 = ones` instead of 40.
  * A step that blows the residual up, rms(f(z) - z) > `safeguard` x the
    row's best so far, falls back: the next iterate is a damped step from
    the best point, z_b + beta (f(z_b) - z_b), and the window restarts from
    that pair.
  * A row that goes `restart` steps (default 2m) without a new best residual
    (Anderson stagnates when its window's residuals become nearly dependent)
    takes a damped step from where it is and restarts its window.
  * A solve that is not finite takes a damped step.

  A row that runs out of budget returns f at its best iterate (the solve
  keeps it; see `fixed_point`). The measurements behind these choices are on
  the docs' DEQ page (`python -m benchmarks.deq_solvers`). State per row:
  2m + 2 vectors of D and three numbers.

  Attributes:
    m: window size (static int >= 1; m = 1 is damped iteration).
    beta: mixing (damping) in (0, 1].
    ridge: Tikhonov regularisation of the Gram matrix relative to its largest
      diagonal entry (> 0); raised to 10 eps of the solve's dtype.
    safeguard: the blow-up factor (> 1), or None: no fallback on growth.
    restart: steps without a new best residual before the window restarts
      (int >= 1), None (the default): 2m, or 0: never.
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
    ...                     solver=deq.Anderson(m=3), tol=1e-6, max_iters=30)
    >>> [round(float(v), 3) for v in h[0]]   # h = (I - A)^-1 x
    [-2.0, 2.0]
  """

  m: int = 5
  beta: float = 1.0
  ridge: float = 1e-8
  safeguard: float | None = 10.0
  restart: int | None = None
  differentiate_weights: bool = False

  def __post_init__(self):
    if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1:
      raise ValueError(f"Anderson({self.m=}) must be a Python int >= 1.")
    if not 0.0 < float(self.beta) <= 1.0:
      raise ValueError(f"Anderson({self.beta=}) must be in (0, 1].")
    if not float(self.ridge) > 0.0:
      raise ValueError(f"Anderson({self.ridge=}) must be > 0.")
    if self.safeguard is not None and not float(self.safeguard) > 1.0:
      raise ValueError(f"Anderson({self.safeguard=}) must be > 1 (or None: no fallback).")
    if self.restart is not None and (isinstance(self.restart, bool)
                                     or not isinstance(self.restart, int) or self.restart < 0):
      raise ValueError(f"Anderson({self.restart=}) must be an int >= 0 (0: never) or None (2m).")

  def init(self, z: jax.Array) -> Any:
    """Empty window, no best point yet.

    Args:
      z: [R, D].

    Returns:
      (zs, fs, filled, z_best, f_best, best, since): m-tuples of [R, D], the
      window's valid count [R], the best pair [R, D] x 2, its residual
      (float32 [R], +inf) and the steps since it was found ([R]).
    """
    zeros = jnp.zeros_like(z)
    rows = z.shape[:1]
    # Counters are floats (no integer leaf in the state, so the unrolled
    # gradient through the solver works too).
    return (tuple(zeros for _ in range(self.m)), tuple(zeros for _ in range(self.m)),
            jnp.zeros(rows, z.dtype), zeros, zeros, jnp.full(rows, jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32))

  def update(self, state: Any, z: jax.Array, fz: jax.Array) -> tuple[jax.Array, Any]:
    """One safeguarded Anderson step. Args: state, z, fz as `Solver.update`. Returns: (z_next, state)."""
    zs, fs, filled, z_best, f_best, best, since = state
    m = self.m
    residual = _row_rms(fz - z)
    grew = (residual > self.safeguard * best) if self.safeguard is not None else None
    better = residual < best
    since = jnp.where(better, 0.0, since + 1.0)
    z_best = jnp.where(better[:, None], z, z_best)
    f_best = jnp.where(better[:, None], fz, f_best)
    best = jnp.where(better, residual, best)
    restart = 2 * m if self.restart is None else self.restart
    stalled = since >= restart if restart else None

    # Newest first; the oldest pair leaves the window.
    zs = (z,) + zs[:-1]
    fs = (fz,) + fs[:-1]
    filled = jnp.minimum(filled + 1, m)
    mixed, ok = self._mix(zs, fs, filled)
    damped = z + self.beta * (fz - z)
    z_next = jnp.where(ok[:, None], mixed, damped)

    # Fallbacks: a damped step and a window holding only the pair it starts from.
    fallback = None
    if stalled is not None:
      z_next = jnp.where(stalled[:, None], damped, z_next)
      since = jnp.where(stalled, 0.0, since)
      fallback = stalled
    if grew is not None:
      z_next = jnp.where(grew[:, None], z_best + self.beta * (f_best - z_best), z_next)
      zs = (jnp.where(grew[:, None], z_best, zs[0]),) + zs[1:]
      fs = (jnp.where(grew[:, None], f_best, fs[0]),) + fs[1:]
      fallback = grew if fallback is None else fallback | grew
    if fallback is not None:
      filled = jnp.where(fallback, jnp.ones_like(filled), filled)
    return z_next, (zs, fs, filled, z_best, f_best, best, since)

  def _mix(self, zs: tuple, fs: tuple, filled: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Anderson point of the window and whether its solve was finite, per row."""
    m = self.m
    # float32 or wider (promote_types would refuse float64 under strict promotion).
    dtype = zs[0].dtype if jnp.finfo(zs[0].dtype).bits >= 32 else jnp.dtype(jnp.float32)
    valid = [filled > i for i in range(m)]                       # m x [R] bool
    gs = [(f_i - z_i).astype(dtype) for z_i, f_i in zip(zs, fs)]  # m x [R, D]
    dots = {(i, j): _row_dot(gs[i], gs[j]) for i in range(m) for j in range(i, m)}
    gram = [[dots[min(i, j), max(i, j)] for j in range(m)] for i in range(m)]
    scale = gram[0][0]
    for i in range(1, m):
      scale = jnp.where(valid[i], jnp.maximum(scale, gram[i][i]), scale)
    scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    one, zero = jnp.ones_like(scale), jnp.zeros_like(scale)
    ridge = max(float(self.ridge), 10.0 * float(jnp.finfo(dtype).eps))
    # A = G G^T / scale + ridge I on the valid block, the identity elsewhere;
    # the right-hand side is 1 on valid entries: alpha = A^-1 1 / (1^T A^-1 1).
    a = [[jnp.where(valid[i] & valid[j], gram[i][j] / scale + (ridge if i == j else 0.0),
                    one if i == j else zero) for j in range(m)] for i in range(m)]
    rhs = [jnp.where(valid[i], one, zero) for i in range(m)]
    w = _solve_spd(a, rhs)
    total = sum(w[1:], w[0])
    alpha = [(w_i / total).astype(zs[0].dtype) for w_i in w]
    if not self.differentiate_weights:
      alpha = [jax.lax.stop_gradient(a_i) for a_i in alpha]
    gs = [f_i - z_i for z_i, f_i in zip(zs, fs)]
    mixed = sum((alpha[i][:, None] * (zs[i] + self.beta * gs[i]) for i in range(1, m)),
                alpha[0][:, None] * (zs[0] + self.beta * gs[0]))
    # A non-finite element makes the row's sum non-finite (a float sum, not
    # jnp.all: Triton has no reduce_and).
    ok = jnp.isfinite(jnp.sum(mixed, axis=-1)) & jnp.isfinite(total) & (total != 0)
    return mixed, ok


@dataclasses.dataclass(frozen=True)
class Broyden(Solver):
  """Limited-memory ("good") Broyden, per row: a low-rank inverse Jacobian of f(z) - z.

  With g(z) = f(z) - z, keeps per row an approximation H of the inverse
  Jacobian of g, H = -I + sum_i u_i v_i^T (at most m rank-one terms), and
  moves to z - H g(z) (the first step is plain iteration, z <- f(z)). After
  each step, with dz = z_k - z_{k-1} and dg = g_k - g_{k-1}, Broyden's
  second ("good") update makes H map dg to dz:
  v = H^T dz, u = (dz - H dg) / (v . dg). When the m terms are used up the
  approximation restarts from -I (restarting beat dropping the oldest term
  on every map measured: dropping breaks the secant equations the newer
  terms were built on). A rank-one update whose denominator is zero or
  whose terms are not finite is skipped; a step that is not finite becomes
  a plain one. Everything is per-row dot products and vector updates (3m
  dots of D per step), so it runs inside the Pallas kernels like Anderson.
  On a linear map it needs at most 2D steps (exact arithmetic, without
  restarts) and usually far fewer; on the maps of the docs' DEQ page it
  converged on the most rows (`python -m benchmarks.deq_solvers`).

  The Jacobian approximation is a constant of the backward when gradients
  flow through the solver's steps (`UnrolledAdjoint`): the unrolled
  gradient is that of the steps z - H g(z) with H fixed. In directions the
  steps never explored H is -I and the unrolled tangent iteration is plain
  iteration, which diverges where the map is not a contraction: use the
  implicit gradient (the default) with this solver (the docs' DEQ page has
  the measurements). State per row: 2m + 2 vectors of D and one number.

  Attributes:
    m: the most rank-one terms kept before a restart (static int >= 1).

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import deq
    >>> # f(z) = -2 z + 1: plain iteration diverges; Broyden is exact in 3 steps.
    >>> f = lambda p, h, x: -2.0 * h + 1.0
    >>> h, info = deq.fixed_point(f, None, jnp.ones((2, 3)), solver=deq.Broyden(),
    ...                           tol=1e-6, return_info=True)
    >>> bool(jnp.allclose(h, 1 / 3, atol=1e-6)), info.steps.tolist()
    (True, [3, 3])
  """

  m: int = 20

  def __post_init__(self):
    if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1:
      raise ValueError(f"Broyden({self.m=}) must be a Python int >= 1.")

  def init(self, z: jax.Array) -> Any:
    """No terms yet.

    Args:
      z: [R, D].

    Returns:
      (us, vs, z_prev, g_prev, count): m-tuples of [R, D] (the terms, newest
      first), the last iterate and residual [R, D], and the number of terms
      in use ([R, 1]; -1 before the first step).
    """
    zeros = jnp.zeros_like(z)
    # Per-row scalars are [R, 1] columns here, so that no [R] boolean is ever
    # reshaped to a column: Mosaic (TPU) rejects that shape cast.
    return (tuple(zeros for _ in range(self.m)), tuple(zeros for _ in range(self.m)), zeros,
            zeros, jnp.full(z.shape[:1] + (1,), -1.0, z.dtype))

  @staticmethod
  def _apply(us: tuple, vs: tuple, a: jax.Array) -> jax.Array:
    """H a = -a + sum_i u_i (v_i . a), per row."""
    out = -a
    for u, v in zip(us, vs):
      out = out + u * _row_dot_col(v, a)
    return out

  @staticmethod
  def _apply_t(us: tuple, vs: tuple, a: jax.Array) -> jax.Array:
    """H^T a = -a + sum_i v_i (u_i . a), per row: `_apply` with u and v swapped."""
    return Broyden._apply(vs, us, a)

  def update(self, state: Any, z: jax.Array, fz: jax.Array) -> tuple[jax.Array, Any]:
    """One Broyden step. Args: state, z, fz as `Solver.update`. Returns: (z_next, state)."""
    us, vs, z_prev, g_prev, count = state
    g = fz - z
    # Full: restart from -I before adding the new term.
    full = count >= self.m                                       # [R, 1]
    us = tuple(jnp.where(full, jnp.zeros_like(u), u) for u in us)
    vs = tuple(jnp.where(full, jnp.zeros_like(v), v) for v in vs)
    count = jnp.where(full, jnp.zeros_like(count), count)
    dz, dg = z - z_prev, g - g_prev
    v = self._apply_t(us, vs, dz)
    denom = _row_dot_col(v, dg)                                  # [R, 1]
    u = (dz - self._apply(us, vs, dg)) / jnp.where(denom == 0, jnp.ones_like(denom), denom)
    ok = ((count >= 0) & (denom != 0) & jnp.isfinite(jnp.sum(u, axis=-1, keepdims=True))
          & jnp.isfinite(jnp.sum(v, axis=-1, keepdims=True)))
    us = tuple(jnp.where(ok, a, b) for a, b in zip((u,) + us[:-1], us))
    vs = tuple(jnp.where(ok, a, b) for a, b in zip((v,) + vs[:-1], vs))
    count = jnp.where(ok, count + 1, jnp.maximum(count, 0))
    hs = tuple(jax.lax.stop_gradient(t) for t in us), tuple(jax.lax.stop_gradient(t) for t in vs)
    z_next = z - self._apply(*hs, g)
    z_next = jnp.where(jnp.isfinite(jnp.sum(z_next, axis=-1, keepdims=True)), z_next, fz)
    return z_next, (us, vs, z, g, count)


def _row_dot_col(a: jax.Array, b: jax.Array) -> jax.Array:
  """[R, D] x [R, D] -> [R, 1]: the per-row inner product as a column."""
  return jnp.sum(a * b, axis=-1, keepdims=True)


def _row_rms(a: jax.Array) -> jax.Array:
  """[R, D] -> float32 [R]: the rms over the row (as `fixed_point` measures residuals)."""
  a = a.astype(jnp.float32)
  return jnp.sqrt(jnp.sum(a * a, axis=-1) * (1.0 / a.shape[-1]))


NAMES = {"anderson": Anderson, "broyden": Broyden, "damped": Damped}


def as_solver(solver: Any, name: str = "solver") -> Solver:
  """A `Solver` from a solver or the name of a shipped one ("anderson", "broyden", "damped").

  Args:
    solver: a `Solver` instance, or a string naming a shipped solver (its
      default configuration), case-insensitive.
    name: the argument's name, for the error message.

  Returns:
    The solver.

  Raises:
    ValueError: an unknown name. TypeError: neither a Solver nor a string
      (e.g. the class `deq.Anderson` itself, not an instance).

  Example:
    >>> from pallas_loop._src.deq.deq_solvers import as_solver
    >>> as_solver("Anderson")
    Anderson(m=5, beta=1.0, ridge=1e-08, safeguard=10.0, restart=None, differentiate_weights=False)
  """
  if isinstance(solver, Solver):
    return solver
  if isinstance(solver, str):
    cls = NAMES.get(solver.lower())
    if cls is None:
      raise ValueError(f"{name}={solver!r} names no shipped solver: use one of "
                       f"{sorted(NAMES)} or an instance, e.g. deq.Anderson(m=10).")
    return cls()
  if isinstance(solver, type) and issubclass(solver, Solver):
    raise TypeError(f"{name}={solver.__name__} is the class: pass an instance, "
                    f"{solver.__name__}() (or its name as a string).")
  raise TypeError(f"{name}={solver!r} must be a deq.Solver (e.g. deq.Broyden()) or the name "
                  f"of one: {sorted(NAMES)}.")


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
