"""Ready halting criteria for `iterate(..., halt=...)`.

A criterion is `halt(params, h_new, h, x) -> bool [rows]`, evaluated on every
update; a row halts after the first update that meets it (once `min_iters`
steps have been applied). The criteria here use only row-wise arithmetic and
reductions over trailing axes, so they run inside the Pallas kernels too.
`tol=` of `iterate` is the absolute test `rms(h_new - h) <= tol`; these cover
the other common cases.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np

from pallas_loop._src import keywords
from pallas_loop._src import loop as loop_lib

Criterion = Callable[[Any, Any, Any, Any], jax.Array]


def _row_sum(a: jax.Array) -> jax.Array:
  """[R, ...] -> [R]: sum over the trailing axes, one at a time (lowers everywhere)."""
  while a.ndim > 1:
    a = jnp.sum(a, axis=-1)
  return a


def row_rms(tree: Any) -> jax.Array:
  """Root-mean-square over all elements of each row of `tree`, in float32.

  Args:
    tree: a pytree of arrays [R, ...] (e.g. the state `h`).

  Returns:
    float32 [R]: sqrt(mean of squares over every element of the row, all
    leaves together).

  Examples:
    >>> import jax.numpy as jnp
    >>> from pallas_loop import halting
    >>> halting.row_rms(jnp.array([[3.0, 4.0], [0.0, 0.0]]))
    Array([3.535534, 0.      ], dtype=float32)
  """
  squares = sum(_row_sum(jnp.square(a.astype(jnp.float32)))
                for a in tree_util.tree_leaves(tree))
  return jnp.sqrt(squares * (1.0 / max(loop_lib.elems_per_row(tree), 1)))


def relative_change(rtol: float, atol: float = 0.0) -> Criterion:
  """Halts a row once `rms(h_new - h) <= rtol * rms(h) + atol`.

  Scale-free convergence, for states whose magnitude varies across rows.
  The rms is over all state elements of the row, in float32.

  Args:
    rtol: relative tolerance (>= 0).
    atol: absolute floor (>= 0), so a state converging to 0 still halts.

  Returns:
    A criterion for `iterate(..., halt=...)`.

  Examples:
    >>> import jax.numpy as jnp, pallas_loop
    >>> step = lambda w, h, x: 0.5 * h + x            # converges to 2x
    >>> h0, x = jnp.zeros((2, 3)), jnp.ones((2, 3))
    >>> halt = pallas_loop.halting.relative_change(1e-3)
    >>> h, info = pallas_loop.iterate(step, None, h0, x, max_iters=100,
    ...                               halt=halt, return_info=True)
    >>> info.steps
    Array([10, 10], dtype=int32)
  """
  if not (rtol >= 0 and atol >= 0):
    raise ValueError(f"{rtol=} and {atol=} must be >= 0.")

  def halt(params: Any, h_new: Any, h: Any, x: Any) -> jax.Array:
    del params, x
    diff = tree_util.tree_map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32),
                              h_new, h)
    return row_rms(diff) <= rtol * row_rms(h) + atol

  return halt


def below(score: Callable[[Any, Any, Any, Any], jax.Array], threshold: float) -> Criterion:
  """Halts a row once a per-row score of the update is <= threshold.

  Turns any per-row scalar you compute from an update into a criterion:
  e.g. the KL divergence between the output distributions of successive
  steps (PonderNet/ACT-style exits), or a task-specific confidence gap.

  Args:
    score: score(params, h_new, h, x) -> float [rows]. Must be row-wise and
      lowerable inside the kernel (see `iterate`).
    threshold: the row halts when score <= threshold (NaN never halts).

  Returns:
    A criterion for `iterate(..., halt=...)`.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> def kl(params, h_new, h, x):         # successive softmax outputs
    ...   p = jax.nn.log_softmax(h_new @ params)
    ...   q = jax.nn.log_softmax(h @ params)
    ...   return jnp.sum(jnp.exp(p) * (p - q), axis=-1)
    >>> halt = pallas_loop.halting.below(kl, 1e-4)
  """

  def halt(params: Any, h_new: Any, h: Any, x: Any) -> jax.Array:
    s = score(params, h_new, h, x)
    return s.reshape(s.shape[0]) <= threshold

  return halt


def any_of(*criteria: Criterion) -> Criterion:
  """Halts a row when any of `criteria` holds (e.g. converged OR confident).

  Args:
    *criteria: one or more `halt(params, h_new, h, x) -> bool [rows]`
      criteria (e.g. from this module).

  Returns:
    A criterion: the elementwise OR of theirs.

  Examples:
    >>> from pallas_loop import halting
    >>> rms = lambda params, h_new, h, x: halting.row_rms(h_new - h)
    >>> halt = halting.any_of(halting.relative_change(1e-3),
    ...                       halting.below(rms, 1e-4))
  """
  if not criteria:
    raise ValueError("any_of needs at least one criterion.")

  def halt(params: Any, h_new: Any, h: Any, x: Any) -> jax.Array:
    flags = [c(params, h_new, h, x) for c in criteria]
    out = flags[0]
    for f in flags[1:]:
      out = out | f
    return out

  return halt


# ----------------------------------------------------------------------------
# Adaptive Computation Time (Graves 2016)
# ----------------------------------------------------------------------------


class ACTState(NamedTuple):
  """What `act` carries through `iterate`: the block's state and ACT's books.

  U below is the shape of one halting unit inside a row: `()` when each row
  (example) halts as a whole, `(T,)` when each of the row's T tokens halts on
  its own. Every leaf has the row axis first.

  Attributes:
    state: the block's own state (a pytree of [R, ...] leaves). A unit that
      has halted keeps the state of its last step.
    output: the probability-weighted output `sum_n w_n y_n` accumulated so
      far (the structure of the block's `y`).
    cum_prob: float32 [R, *U]: `sum_n h_n` over the steps before the halting
      one; once halted it is `sum_{n<N} h_n`.
    remainder: float32 [R, *U]: `R = 1 - sum_{n<N} h_n` once halted, 0 before.
    steps: int32 [R, *U]: steps applied; `N` once halted.
    halted: bool [R, *U]: whether the unit has halted.
  """

  state: Any
  output: Any
  cum_prob: jax.Array
  remainder: jax.Array
  steps: jax.Array
  halted: jax.Array

  @property
  def ponder_cost(self) -> jax.Array:
    """float32 [R, *U]: Graves' ponder cost `N + R` of each unit."""
    return self.steps.astype(jnp.float32) + self.remainder


class ACT(NamedTuple):
  """The pieces `act` builds: pass them to `iterate` (see `act`).

  Attributes:
    init: init(params, state0, x) -> ACTState, the initial state (zero
      output, probabilities and counters, nothing halted).
    step: the step for `iterate`: step(params, h: ACTState, x, **extras) ->
      ACTState; it hands iterate's keyword extras (`index`, `key`) to the
      block.
    halt: the criterion for `iterate(..., halt=...)`: a row halts once all
      of its units have.
    max_iters: the cap M; pass it as `iterate`'s `max_iters`.
    step_index: whether the block takes the step index (`index`, e.g. untied
      per-step layers); pass it as `iterate`'s `step_index`.
  """

  init: Callable[[Any, Any, Any], ACTState]
  step: Callable[..., ACTState]
  halt: Criterion
  max_iters: int
  step_index: bool = False

  @property
  def max_steps(self) -> int:
    raise AttributeError("ACT.max_steps is now spelled ACT.max_iters (as iterate's "
                         "max_iters): iterate(a.step, ..., max_iters=a.max_iters).")


def _keyword_params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
  """The parameters of `fn` that a keyword can fill, by name ({} if unknown)."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):  # builtins, some C callables
    return {}
  return {name: p for name, p in sig.parameters.items()
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _expand_to(a: jax.Array, ndim: int) -> jax.Array:
  """[R, *U] -> [R, *U, 1, ...] with `ndim` axes, to broadcast onto a leaf."""
  return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _row_all(flags: jax.Array) -> jax.Array:
  """bool [R, *U] -> bool [R]: all over the unit axes (int min: lowers everywhere)."""
  a = flags.astype(jnp.int32)
  while a.ndim > 1:
    a = jnp.min(a, axis=-1)
  return a > 0


@keywords.renamed(max_steps="max_iters")
def act(block: Callable[..., tuple[Any, Any, jax.Array]], *,
        max_iters: int, eps: float = 0.01) -> ACT:
  """Adaptive Computation Time (Graves 2016) as a step and a halt for `iterate`.

  `block(params, state, x) -> (state_new, y, p)` is one ponder step: the
  new state, the step's output `y` (a pytree, leaves [R, *U, ...]) and the
  halting probability `p = h_n` in [0, 1] (float [R, *U], e.g. a sigmoid of
  `state_new`), with U = () for one halting decision per row or U = (T,) for
  one per token. With the same parameters every step the layers are tied;
  a block with an `index` parameter, `block(params, state, x, *, index)`,
  gets the step index (0 for step n = 1, an int32 scalar shared by the
  call's rows) and can read per-step layers from a stack, `params[index]`
  (untied layers, e.g. Scenic's Universal Transformer with
  `share_parameters=False`); run it with `iterate(..., step_index=True)`
  (`ACT.step_index` says so). A block with a `key` parameter gets
  iterate's per-row keys (`iterate(..., key=...)`, see `pallas_loop.random`).

  The rule is the paper's: a unit applies steps n = 1, 2,
  ... and stops after step `N = min(M, min{n : sum_{m<=n} h_m >= 1 - eps})`;
  the weights are `w_n = h_n` for n < N and the remainder
  `w_N = R = 1 - sum_{n<N} h_n` (so they sum to 1, also when the cap M
  stops the unit); the output is `sum_n w_n y_n` and the ponder cost
  `N + R`. A unit that has halted is frozen (state, output and books); a
  row stops (`halt`) once all of its units have halted, at most M steps.
  The widely copied Universal Transformer code differs (a strict `>`, an
  interpolated output, no remainder at the cap): see the docs' ACT page.

  Args:
    block: block(params, state, x) -> (state_new, y, p), optionally with the
      keyword parameters `index` and `key`; row-wise like any step of
      `iterate` (units inside a row may mix, e.g. attention over the row's
      tokens).
    max_iters: M >= 1, the most steps a unit may take (before 0.3:
      `max_steps`, which now raises a TypeError naming this one).
    eps: the paper's epsilon, 0 <= eps < 1 (0.01 in the paper): a unit may
      halt after one step when `h_1 >= 1 - eps`.

  Returns:
    An `ACT`: `init`, `step`, `halt`, `max_iters` and `step_index` for
    `iterate`. The result's `output`, `ponder_cost`, `steps` (N) and
    `remainder` (R) are ACT's outputs.

  Examples:
    >>> import jax, jax.numpy as jnp, pallas_loop
    >>> def block(w, s, x):
    ...   s = jnp.tanh(s @ w + x)
    ...   return s, s, jax.nn.sigmoid(s.sum(-1))     # state, y, h_n
    >>> a = pallas_loop.halting.act(block, max_iters=5, eps=0.01)
    >>> w, x = 0.5 * jnp.eye(3), jnp.array([[2.0] * 3, [-3.0] * 3])
    >>> h0 = a.init(w, jnp.zeros((2, 3)), x)
    >>> h = pallas_loop.iterate(a.step, w, h0, x, max_iters=a.max_iters,
    ...                         halt=a.halt)
    >>> import numpy as np
    >>> print(h.steps, np.round(np.asarray(h.ponder_cost), 3))   # N, N + R
    [2 5] [2.053 5.809]

    Untied layers: a stack of 5 weights, the block reads its step's.

    >>> def untied(ws, s, x, *, index):
    ...   s = jnp.tanh(s @ ws[index] + x)
    ...   return s, s, jax.nn.sigmoid(s.sum(-1))
    >>> a = pallas_loop.halting.act(untied, max_iters=5)
    >>> ws = jnp.stack([0.5 * jnp.eye(3)] * 5)
    >>> h = pallas_loop.iterate(a.step, ws, a.init(ws, jnp.zeros((2, 3)), x), x,
    ...                         max_iters=a.max_iters, halt=a.halt, step_index=a.step_index)
    >>> print(a.step_index, h.steps)
    True [2 5]
  """
  if isinstance(max_iters, bool) or not isinstance(max_iters, (int, np.integer)):
    raise TypeError(f"{max_iters=} must be a Python int >= 1 (static: the loop's budget).")
  max_iters = int(max_iters)
  if max_iters < 1:
    raise ValueError(f"{max_iters=} must be >= 1: ACT applies at least one step.")
  if not 0.0 <= eps < 1.0:
    raise ValueError(f"{eps=} must be in [0, 1): a unit halts once sum h_n >= 1 - eps.")
  threshold = 1.0 - eps
  takes = _keyword_params(block)
  step_index = "index" in takes
  needs_index = step_index and takes["index"].default is inspect.Parameter.empty

  def call_block(params: Any, state: Any, x: Any, extras: dict[str, Any]):
    if needs_index and "index" not in extras:
      raise TypeError(
          "block takes the step index (`index`, e.g. per-step layers read as "
          "params[index]) but iterate did not pass it: run iterate(act.step, ..., "
          "step_index=True) (ACT.step_index is True for this block).")
    return block(params, state, x, **extras)

  def init(params: Any, state0: Any, x: Any) -> ACTState:
    rows = tree_util.tree_leaves(state0)[0].shape[0]
    probe: dict[str, Any] = {}
    if step_index:
      probe["index"] = jax.ShapeDtypeStruct((), jnp.int32)
    if "key" in takes:
      probe["key"] = jax.ShapeDtypeStruct((rows, 2), jnp.uint32)
    _, y, p = jax.eval_shape(lambda p_, s_, x_, kw: block(p_, s_, x_, **kw),
                             params, state0, x, probe)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype)
    return ACTState(state=state0, output=tree_util.tree_map(zeros, y),
                    cum_prob=jnp.zeros(p.shape, jnp.float32),
                    remainder=jnp.zeros(p.shape, jnp.float32),
                    steps=jnp.zeros(p.shape, jnp.int32),
                    halted=jnp.zeros(p.shape, jnp.bool_))

  def step(params: Any, h: ACTState, x: Any, **extras: Any) -> ACTState:
    state_new, y, p = call_block(params, h.state, x, extras)
    p = p.astype(jnp.float32).reshape(h.cum_prob.shape)
    active = jnp.logical_not(h.halted)
    steps = jnp.where(active, h.steps + 1, h.steps)
    last = active & ((h.cum_prob + p >= threshold) | (steps >= max_iters))
    remainder = jnp.where(last, 1.0 - h.cum_prob, h.remainder)
    weight = jnp.where(last, remainder, p)        # w_n: h_n, or R on the last step
    cum_prob = jnp.where(active & jnp.logical_not(last), h.cum_prob + p, h.cum_prob)

    def accumulate(acc, y_n):
      w = _expand_to(weight, y_n.ndim).astype(y_n.dtype)
      return jnp.where(_expand_to(active, y_n.ndim), acc + w * y_n, acc)

    def freeze(new, old):
      return jnp.where(_expand_to(active, old.ndim), new, old)

    return ACTState(state=tree_util.tree_map(freeze, state_new, h.state),
                    output=tree_util.tree_map(accumulate, h.output, y),
                    cum_prob=cum_prob, remainder=remainder, steps=steps,
                    halted=h.halted | last)

  def halt(params: Any, h_new: ACTState, h: ACTState, x: Any) -> jax.Array:
    del params, h, x
    return _row_all(h_new.halted)

  return ACT(init=init, step=step, halt=halt, max_iters=max_iters, step_index=step_index)
