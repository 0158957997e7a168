"""The XLA implementation: `lax.while_loop`s that run the step only on running rows.

The default on CPU and the fallback elsewhere (`dispatch.py`).

Legend (shapes in comments):
  B: rows of the batch    S: rows of the current bucket (a static size <= B)
  ...: a leaf's trailing (per-row) dimensions

A masked loop over the whole batch costs B rows per step however few rows are
still running. Here the rows are kept ordered so that the running ones form a
prefix, and each step runs the body on that prefix only, padded up to one of
a few static sizes (the *ladder*, `bucket_sizes`), so the rows computed track
sum(n_i) instead of B * max(n_i).

* Rows are first ordered by descending count. Without halting, row r runs at
  trip t iff t < count[r], so the running rows are always a prefix, and its
  length only shrinks.
* The loop is a sequence of *stages*, one per ladder size S (largest first):
  stage S is a `lax.while_loop` over the first S rows that runs while more
  than the next ladder size rows are running. Because the running prefix only
  shrinks, the stages run in order, each at a static shape, with no per-step
  branch (this is equivalent to selecting the bucket per step with
  `lax.switch`, without the branch and the carry copies around it).
* With halting (tol/halt), a row may stop anywhere in the prefix. At each
  stage change the stage's rows are *compacted*: stably reordered so that the
  running rows come first, after which the next, smaller stage again holds
  every running row. A halted row just rides along (masked) until then.
* Every row carries its position in the input (`order`), so the caller's
  order is restored at the end, and its index in the caller's batch (`rows`),
  which the body gets with the step index (random keys depend on both).

Per row, the applied steps, the halting rule, the residual and the masking
are those of `loop_lib.run_loop` (the reference semantics), evaluated on the
bucket's rows; rows in a bucket that are not running are computed and
discarded, never read by another row.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
from jax import tree_util
import jax.numpy as jnp

from pallas_loop._src import loop as loop_lib
from pallas_loop._src import tiling
from pallas_loop._src.operands import LoopOperands, LoopOutputs

# The ladder: linear steps of ~B/LINEAR_STEPS rows (bounded waste per step),
# then halving (bounded relative waste on the tail), no bucket under MIN_ROWS
# rows (per-step overhead dominates there, and each stage is one more loop to
# compile: ~0.1 s each on the CPU). Why 4 linear steps, not 8, and why 16 rows
# (`benchmarks/ladder.py`): RESULTS.md, "Figures behind the code's choices".
LINEAR_STEPS = 4
MIN_ROWS = 16
ALIGN = 8
# A batch of at most this many rows runs as one stage: there the per-step
# overhead outweighs the rows a ladder would skip, and every stage is one
# more loop to compile (a small DEQ's jit(value_and_grad) compiled in half
# the time, and ran no slower; RESULTS.md, "Figures behind the code's
# choices").
ONE_STAGE_ROWS = 64


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def bucket_sizes(batch: int) -> tuple[int, ...]:
  """The static row counts the step runs at, largest (= batch) first.

  Multiples of a granularity g = B/4 (rounded up to a multiple of 8 rows,
  at least 16), then g/2, g/4, ... down to 16 rows. So a step on `a`
  running rows computes at most g extra rows when a >= g, fewer than `a`
  extra below that, and at most 16 rows when a <= 16. A batch of at most
  `ONE_STAGE_ROWS` rows is one stage.

  Args:
    batch: B, the number of rows (>= 0).

  Returns:
    Strictly decreasing sizes, the first equal to `batch` (empty if B = 0).

  Example:
    >>> bucket_sizes(1024)
    (1024, 768, 512, 256, 128, 64, 32, 16)
    >>> bucket_sizes(64)
    (64,)
  """
  if batch <= 0:
    return ()
  if batch <= ONE_STAGE_ROWS:
    return (batch,)
  g = max(MIN_ROWS, _round_up(-(-batch // LINEAR_STEPS), ALIGN))
  sizes = {min(batch, k * g) for k in range(1, -(-batch // g) + 1)}
  small = g // 2
  while small >= MIN_ROWS and small < batch:
    sizes.add(small)
    small //= 2
  return tuple(sorted(sizes, reverse=True))


class _Rows(NamedTuple):
  """The per-row loop state, in the loop's row order. h/x leaves [R, ...]."""

  h: Any
  x: Any
  counts: jax.Array    # int32 [R, 1]: step budgets
  order: jax.Array     # int32 [R, 1]: each row's position in the input
  rows: jax.Array      # int32 [R, 1]: each row's index in the caller's batch
  residual: jax.Array  # float32 [R, 1]
  steps: jax.Array     # int32 [R, 1]
  halted: jax.Array    # int32 [R, 1], 0/1
  ys: Any = None       # leaves [R, T, ...]: per-step outputs (0 where not applied), or None


def _prefix(tree, size: int):
  return tree_util.tree_map(lambda a: a[:size], tree)


def _put_prefix(tree, sub):
  def put(a, b):
    if a.shape[0] == b.shape[0]:
      return b
    # `.at[].set` rather than a raw dynamic_update_slice: it reconciles the
    # shardings when some operands carry a mesh (explicit sharding) and
    # others do not.
    return a.at[:b.shape[0]].set(b)
  return tree_util.tree_map(put, tree, sub)


def _running(s: _Rows, t) -> jax.Array:
  """bool [R, 1]: rows that apply a step at trip t."""
  return (t < s.counts) & (s.halted == 0)


def _count(flags: jax.Array) -> jax.Array:
  return jnp.sum(flags.astype(jnp.int32))


def _runs_more_than(s: _Rows, t, until: int, halting, ordered: bool = True) -> jax.Array:
  """bool scalar: more than `until` rows of `s` run at trip t (`ordered`:
  the rows are in descending order of count)."""
  if halting is None and not ordered:
    return jnp.max(s.counts, initial=0) > t
  if halting is None:
    # Rows ordered by descending count, and row r runs at trip t iff
    # t < count[r]: more than `until` rows run iff the (until+1)-th largest
    # count exceeds t. Read, not counted: no reduction per trip.
    return s.counts[until, 0] > t
  return _count(_running(s, t)) > until


def _compact(s: _Rows, t) -> _Rows:
  """Stably moves the rows still running at trip t to the front."""
  not_running = jnp.logical_not(_running(s, t))[:, 0].astype(jnp.int32)
  order = jnp.argsort(not_running, stable=True)
  return tiling.take_rows(s, order)


def _write_output(ys: Any, t: jax.Array, running: jax.Array, y: Any) -> Any:
  """`ys` (leaves [R, T, ...]) with slot t set to y for the running rows."""
  def write(buf, value):
    old = lax.dynamic_index_in_dim(buf, t, 1, keepdims=False)
    new = jnp.where(loop_lib.row_mask(running, old.shape), value.astype(buf.dtype), old)
    return lax.dynamic_update_index_in_dim(buf, new, t, 1)
  return tree_util.tree_map(write, ys, y)


def _run_stage(body, params, s: _Rows, t, until: int, halting, elems_per_row: int,
               residual: bool, ordered: bool):
  """Steps the rows of `s` while more than `until` of them are running
  (`ordered`: the rows are in descending order of count).

  Returns:
    (t, s): the trip counter after the stage and the stage's rows.
  """
  size = s.counts.shape[0]

  def step(carry):
    t, s = carry
    running = _running(s, t)
    # Each row's step index is the trip counter (a running row has applied
    # t steps); its batch index travels with it (random keys depend on both).
    h_new, y, flag = body(params, s.h, s.x, jnp.broadcast_to(t, (size, 1)), s.rows, t)
    if s.ys is not None:
      s = s._replace(ys=_write_output(s.ys, t, running, y))
    s = loop_lib.apply_update(s, running, t, h_new, flag, halting, elems_per_row, residual)
    return t + 1, s

  t, s = lax.while_loop(lambda c: _runs_more_than(c[1], c[0], until, halting, ordered), step,
                        (t, s))
  if halting is not None and until > 0:
    # Halted rows may sit anywhere in the stage: bring the running ones (at
    # most `until` of them) to the front for the next, smaller stage. Without
    # halting the running rows already are a prefix (rows ordered by
    # descending count), so no reordering is needed.
    s = _compact(s, t)
  return t, s


def forward(body: Callable[..., Any], ops: LoopOperands, residual: bool = True,
            outputs: Any = None) -> LoopOutputs:
  """Runs each row to its budget or halting, computing only running rows.

  Args:
    body: body(params, h, x, t, rows, index) -> (h_new, y, flag), row
      independent; t, rows int32 [R, 1] (step index, index in the caller's
      batch), index the int32 scalar step index of the trip; flag is
      None or bool [R]/[R, 1] (the user's halt criterion on this update).
      Takes the caller's consts itself (`ops.consts` is not used here).
    ops: the loop's operands (h0/x leaves [B, ...]).
    residual: track each row's last residual (else it is returned as 0).
    outputs: None, or the per-step outputs' buffer avals: a pytree of
      `ShapeDtypeStruct` [B, T, ...] (rows, steps, the output's own axes);
      slot t of a row holds the output of its step t, 0 where not applied.

  Returns:
    The outputs, in the caller's row order.

  Example:
    >>> from pallas_loop._src.operands import LoopOperands
    >>> body = lambda p, h, x, t, rows, index: (2 * h, None, None)
    >>> ops = LoopOperands(None, [], jnp.ones((3, 2)), None, jnp.array([1, 0, 2]),
    ...                    jnp.arange(3, dtype=jnp.int32), None)
    >>> forward(body, ops).h
    Array([[2., 2.],
           [1., 1.],
           [4., 4.]], dtype=float32)
  """
  batch = ops.counts.shape[0]
  sizes = bucket_sizes(batch)
  elems = loop_lib.elems_per_row(ops.h0)
  halting = ops.halting

  def on_sorted_rows(per_row, counts):
    h0, x, row_ids = per_row
    column = lambda dtype: jnp.zeros((batch, 1), dtype)
    s = _Rows(h=h0, x=x, counts=counts[:, None],
              order=jnp.arange(batch, dtype=jnp.int32)[:, None], rows=row_ids[:, None],
              residual=column(jnp.float32), steps=column(jnp.int32),
              halted=column(jnp.int32),
              ys=None if outputs is None else tree_util.tree_map(
                  lambda a: jnp.zeros(a.shape, a.dtype), outputs))
    t = jnp.int32(0)
    for k, size in enumerate(sizes):
      until = sizes[k + 1] if k + 1 < len(sizes) else 0

      def stage(t, s, size=size, until=until):
        t, sub = _run_stage(body, ops.params, _prefix(s, size), t, until, halting, elems,
                            residual, ordered=len(sizes) > 1)
        if halting is None:
          # Only the state and its statistics changed (no compaction): writing
          # back x and the row bookkeeping too would copy them for nothing.
          changed = ("h", "residual", "steps", "halted") + (("ys",) if outputs else ())
          return t, s._replace(**_put_prefix({f: getattr(s, f) for f in changed},
                                             {f: getattr(sub, f) for f in changed}))
        return t, _put_prefix(s, sub)

      if len(sizes) == 1:  # one stage: its loop's condition is the only test
        t, s = stage(t, s)
        continue
      # A stage with nothing to do (its rows finished in a larger bucket, or
      # the counts jump past it) is skipped whole: its slices and the work XLA
      # hoists out of its loop (e.g. x @ U of an RNN cell) then cost nothing.
      t, s = lax.cond(_runs_more_than(_prefix(s, size), t, until, halting), stage,
                      lambda t, s: (t, s), t, s)
    out = (s.h, s.residual[:, 0], s.steps[:, 0], s.halted[:, 0], s.ys)
    if halting is not None:
      # Compaction moved rows: back to the order they came in.
      out = tiling.take_rows(out, tiling.inverse_permutation(s.order[:, 0]))
    return out, None

  # Without halting the running rows are a prefix of rows ordered by count.
  # One stage runs every row to the end whatever their order: no sort.
  (h, residual_out, steps, halted, ys), _ = tiling.in_tiles(
      on_sorted_rows, (ops.h0, ops.x, ops.row_ids), ops.counts, rows=batch,
      sort=len(sizes) > 1, must_be_finite=False)
  return LoopOutputs(h, residual_out, steps, halted > 0, ys)
