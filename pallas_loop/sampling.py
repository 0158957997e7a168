"""Per-row depth samplers: how many steps each example gets.

Recurrent-depth and stochastic-depth training draw a step count per example
and pass it as `iters=` to `pallas_loop.iterate`. The samplers here return
int32 counts [batch], built on `jax.random` (they run outside kernels, so any
JAX key works: `jax.random.key(seed)` of any implementation, or a legacy
`jax.random.PRNGKey(seed)`). They are jit-compatible; `batch` and the caps
are static, the distribution's parameters may be traced (then they are not
range-checked).

    n = pallas_loop.sampling.lognormal_poisson(key, 32, mean=16, sigma=0.5, cap=64)
    h = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=64)

Truncated backpropagation (`grad=pallas_loop.Truncated(k)`) differentiates
each row's last k steps; `truncated_split` samples the total and reports the
split, so the total keeps the intended distribution.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from pallas_loop import random as prand
from pallas_loop._src import validation

__all__ = ["Split", "geometric", "lognormal_poisson", "truncated_split", "uniform"]


# ---------------------------------------------------------------------------
# Argument checks.


def _check_key(key: jax.Array) -> None:
  prand.key_data(key)  # raises a TypeError/ValueError that says what to pass


def _number(name: str, value: ArrayLike, batch: int, *, integer: bool,
            ok: Callable[[np.ndarray], Any], want: str) -> jax.Array:
  """A scalar or [batch] parameter; checked with `ok` when concrete."""
  concrete = validation.concrete(value)
  if concrete is not None:
    kinds = (jnp.integer,) if integer else (jnp.integer, jnp.floating)
    if concrete.dtype == bool or not any(jnp.issubdtype(concrete.dtype, k) for k in kinds):
      raise TypeError(f"{name} must be {'an int' if integer else 'a real number'} (scalar or "
                      f"[{batch}]), got {value!r}.")
    if not np.all(ok(concrete)):
      raise ValueError(f"{name} must be {want}, got {value!r}.")
  arr = jnp.asarray(value)
  if arr.shape not in ((), (batch,)):
    raise ValueError(f"{name} must be a scalar or have shape ({batch},) (one per row), got "
                     f"{arr.shape=}.")
  return arr.astype(jnp.int32 if integer else jnp.float32)


# ---------------------------------------------------------------------------
# Samplers.


def uniform(key: jax.Array, batch: int, lo: ArrayLike, hi: ArrayLike) -> jax.Array:
  """Counts uniform on the integers lo..hi, both included.

  P(n = j) = 1 / (hi - lo + 1) for lo <= j <= hi.

  Args:
    key: a JAX PRNG key.
    batch: number of rows (static int >= 0).
    lo: int (or int array of shape () or [batch]), 0 <= lo <= hi.
    hi: int (or int array of shape () or [batch]), lo <= hi < 2**31 - 1.

  Returns:
    int32 [batch].

  Examples:
    >>> import jax, pallas_loop
    >>> # stochastic depth: 32 rows, each 1 to 100 steps
    >>> n = pallas_loop.sampling.uniform(jax.random.key(0), 32, 1, 100)
    >>> n.shape, bool(((n >= 1) & (n <= 100)).all())
    ((32,), True)
  """
  _check_key(key)
  batch = validation.static_int("batch", batch, 0)
  lo = _number("lo", lo, batch, integer=True, ok=lambda v: v >= 0, want=">= 0")
  hi = _number("hi", hi, batch, integer=True, ok=lambda v: v < 2**31 - 1, want="< 2**31 - 1")
  lo_c, hi_c = validation.concrete(lo), validation.concrete(hi)
  if lo_c is not None and hi_c is not None and not np.all(lo_c <= hi_c):
    raise ValueError(f"lo must be <= hi, got lo={lo_c} and hi={hi_c}.")
  return jax.random.randint(key, (batch,), lo, hi + 1, dtype=jnp.int32)


def geometric(key: jax.Array, batch: int, *, p: ArrayLike | None = None,
              mean: ArrayLike | None = None, cap: int) -> jax.Array:
  """Geometric counts on 1, 2, ...: the PonderNet prior, capped.

  `P(n = j) = (1 - p)**(j - 1) * p` for j >= 1 (mean 1 / p), then
  `n = min(n, cap)`: the tail mass `sum_{j >= cap} P(j) = (1 - p)**(cap - 1)`
  lands on cap, as PonderNet assigns the remaining halting probability to the
  last step. Capped mean: `(1 - (1 - p)**cap) / p`. Sampled by inversion:
  `n = 1 + floor(log(u) / log(1 - p))` with u uniform in (0, 1].

  Args:
    key: a JAX PRNG key.
    batch: number of rows (static int >= 0).
    p: success probability per step, 0 < p <= 1 (scalar or [batch]).
    mean: instead of p, the uncapped mean 1 / p (>= 1). Give exactly one.
    cap: the largest count (static int >= 1), e.g. iterate's max_iters.

  Returns:
    int32 [batch], values in [1, cap].

  Examples:
    >>> import jax, pallas_loop
    >>> key = jax.random.key(0)
    >>> n = pallas_loop.sampling.geometric(key, 32, mean=8.0, cap=64)
    >>> n.shape, bool((n <= 64).all())
    ((32,), True)
  """
  _check_key(key)
  batch = validation.static_int("batch", batch, 0)
  cap = validation.static_int("cap", cap, 1)
  if (p is None) == (mean is None):
    raise TypeError("geometric takes exactly one of p= (success probability) or mean= (1 / p), "
                    f"got {p=} and {mean=}.")
  if p is not None:
    prob = _number("p", p, batch, integer=False, ok=lambda v: (v > 0) & (v <= 1), want="in (0, 1]")
  else:
    assert mean is not None
    prob = 1.0 / _number("mean", mean, batch, integer=False, ok=lambda v: v >= 1, want=">= 1")
  u = 1.0 - jax.random.uniform(key, (batch,), jnp.float32)  # (0, 1]: log(u) is finite
  # p = 1 gives log(u) / -inf = -0: n = 1. Cap in float before the cast (no overflow).
  failures = jnp.floor(jnp.log(u) / jnp.log1p(-prob))
  return jnp.minimum(1.0 + failures, np.float32(cap)).astype(jnp.int32)


def lognormal_poisson(key: jax.Array, batch: int, *, mean: ArrayLike, sigma: ArrayLike,
                      cap: int) -> jax.Array:
  """The log-normal Poisson depth of recurrent-depth pretraining, capped.

  `tau ~ Normal(log(mean) - sigma**2 / 2, sigma)`, `n = 1 + Poisson(exp(tau))`,
  then `n = min(n, cap)`. exp(tau) is log-normal with mean `mean`, so uncapped
  `E[n] = 1 + mean` and `Var[n] = mean + mean**2 * (exp(sigma**2) - 1)`: most
  rows get around `mean` steps, with a heavy right tail of long ones (Geiping
  et al. 2025, "Scaling up test-time compute with latent reasoning").

  Args:
    key: a JAX PRNG key.
    batch: number of rows (static int >= 0).
    mean: mean of the Poisson rate exp(tau), > 0 (scalar or [batch]).
    sigma: standard deviation of tau, >= 0 (0: n = 1 + Poisson(mean)).
    cap: the largest count (static int >= 1), e.g. iterate's max_iters.

  Returns:
    int32 [batch], values in [1, cap].

  Examples:
    >>> import jax, pallas_loop
    >>> key = jax.random.key(0)
    >>> n = pallas_loop.sampling.lognormal_poisson(key, 32, mean=32, sigma=0.5,
    ...                                            cap=128)
    >>> n.shape, bool((n <= 128).all())
    ((32,), True)
  """
  _check_key(key)
  batch = validation.static_int("batch", batch, 0)
  cap = validation.static_int("cap", cap, 1)
  mean = _number("mean", mean, batch, integer=False, ok=lambda v: v > 0, want="> 0")
  sigma = _number("sigma", sigma, batch, integer=False, ok=lambda v: v >= 0, want=">= 0")
  k_tau, k_poisson = jax.random.split(key)
  tau = jnp.log(mean) - 0.5 * sigma * sigma + sigma * jax.random.normal(k_tau, (batch,))
  # jax.random.poisson saturates at the int32 maximum: cap before adding 1.
  extra = jax.random.poisson(k_poisson, jnp.exp(tau), (batch,), dtype=jnp.int32)
  return 1 + jnp.minimum(extra, cap - 1)


class Split(NamedTuple):
  """A sampled total depth split for truncated backpropagation.

  Unpacks as `(total, grad)`; `no_grad = total - grad`.

  Attributes:
    total: int32 [batch], the steps per row (the `iters` of `iterate`).
    grad: int32 [batch], `min(k, total)`: the last steps, run with gradient.
  """

  total: jax.Array  # int32 [batch]: steps per row, the `iters` of iterate
  grad: jax.Array   # int32 [batch]: min(k, total), the steps run with gradient

  @property
  def no_grad(self) -> jax.Array:
    """int32 [batch]: total - grad, the leading steps run without gradient."""
    return self.total - self.grad


def truncated_split(key: jax.Array, batch: int, k: ArrayLike, *,
                    sampler: Callable[..., jax.Array] = lognormal_poisson,
                    **sampler_args: Any) -> Split:
  """Samples each row's total depth, then splits it into (no-grad, grad) steps.

  total ~ sampler(key, batch, **sampler_args); grad = min(k, total);
  no_grad = total - grad. The total is what is sampled, so it has exactly
  the sampler's distribution; drawing the no-gradient steps n ~ D and then
  adding k would shift every total by k (skewing the depth the model trains
  at) and never give a row fewer than k steps.
  `iterate(..., iters=split.total, grad=pallas_loop.Truncated(k))` applies
  the same split; `grad`/`no_grad` serve two-call recipes (a no-gradient
  `iterate` of `no_grad` steps, then `grad` steps with gradient).

  Args:
    key: a JAX PRNG key.
    batch: number of rows (static int >= 0).
    k: steps to backpropagate through, an int >= 0 (or int array () / [batch]).
    sampler: the total's distribution: `lognormal_poisson` (default, the
      recurrent-depth recipe), `geometric`, `uniform`, or any callable
      `sampler(key, batch, **sampler_args) -> int32 [batch]`.
    **sampler_args: the sampler's parameters (e.g. mean=, sigma=, cap=).

  Returns:
    `Split(total, grad)`: int32 [batch] each, grad + no_grad == total.

  Examples:
    >>> import jax, pallas_loop
    >>> total, k_grad = pallas_loop.sampling.truncated_split(
    ...     jax.random.key(0), 32, 8, mean=32, sigma=0.5, cap=128)
    >>> bool((k_grad <= total).all())
    True
  """
  batch = validation.static_int("batch", batch, 0)
  k = _number("k", k, batch, integer=True, ok=lambda v: v >= 0, want=">= 0")
  if not callable(sampler):
    raise TypeError(f"sampler must be a callable sampler(key, batch, **args), got {sampler!r}.")
  total = jnp.asarray(sampler(key, batch, **sampler_args))
  if total.shape != (batch,) or not jnp.issubdtype(total.dtype, jnp.integer):
    raise ValueError(f"sampler must return int counts of shape ({batch},), got "
                     f"{total.shape=} {total.dtype=}.")
  total = total.astype(jnp.int32)
  return Split(total=total, grad=jnp.minimum(k, total))
