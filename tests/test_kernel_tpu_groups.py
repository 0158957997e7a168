"""The TPU's group kernel (`kernel_tpu_groups.py`) against the reference.

Run in Pallas' TPU interpret mode (`interpret=pltpu.InterpretParams()`),
which takes the TPU's own forward kernel: small chunks (`block_rows=16`) so
that a batch spans several chunks and groups, padding poisoned with NaN so a
padded row that leaked into a result would show.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src import dispatch
from pallas_loop._src import grad_modes
from pallas_loop._src.kernels import kernel_forward
from pallas_loop._src.kernels import kernel_tpu_groups
from pallas_loop._src.step import step_fn
from pallas_loop._src import tiling
from benchmarks import blocks
from tests import cases
from tests import oracle

TPU_INTERPRET = pallas_loop.Options(implementation="pallas", interpret=pltpu.InterpretParams())


def _run(step, params, h0, x, *, block_rows=16, sort_rows=True, **kw):
  """iterate in TPU interpret mode, with the forward plan it took."""
  options = TPU_INTERPRET.replace(block_rows=block_rows, sort_rows=sort_rows)
  with dispatch.observe_plans() as seen, pallas_loop.testing.poisoned_padding():
    out = pallas_loop.iterate(step, params, h0, x, **kw, options=options)
  return out, [p for what, _, p in seen if what == "forward"]


@pytest.mark.parametrize("pattern", cases.PATTERNS + ("descending",))
@pytest.mark.parametrize("block,dtype", [("tanh_rnn", "float32"), ("tanh_rnn", "bfloat16"),
                                         ("lstm", "float32"), ("residual_mlp", "bfloat16")])
@pytest.mark.parametrize("batch", [7, 100])
def test_forward_matches_reference(pattern, block, dtype, batch):
  step, params, h0, x = blocks.make(block, batch, 16, jnp.dtype(dtype))
  if pattern == "descending":  # already in count order: the rows are not moved
    n = jnp.asarray(np.sort(np.asarray(cases.counts("ragged", batch)))[::-1].copy())
  else:
    n = cases.counts(pattern, batch)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  (got, info), plans = _run(step, params, h0, x, return_info=True, **kw)
  assert plans and all(isinstance(p, kernel_tpu_groups.GroupPlan) for p in plans)
  want, want_f32 = oracle.reference_pair(step, params, h0, x, **kw)
  oracle.assert_trees_close(got, want, want_f32)
  ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)[1]
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  assert not np.any(info.halted)


@pytest.mark.parametrize("batch", [5, 64, 130])
def test_without_info_every_row_applies_its_count(batch):
  # No halting and no residual: nothing per row is tracked in the loop.
  step, params, h0, x = blocks.make("tanh_rnn", batch, 16)
  n = cases.counts("ragged", batch, seed=2)
  got, plans = _run(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  assert plans[0].groups >= 1 and plans[0].group_rows % plans[0].chunk_rows == 0
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, iters=n,
                                                   max_iters=cases.MAX_ITERS))


def test_several_groups_and_chunks():
  step, params, h0, x = blocks.make("tanh_rnn", 300, 16)
  n = cases.counts("ragged", 300, max_iters=9, seed=4)
  got, plans = _run(step, params, h0, x, iters=n, max_iters=9)
  assert plans[0].groups > 1 and plans[0].group_rows // plans[0].chunk_rows > 1
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, iters=n, max_iters=9))


@pytest.mark.parametrize("min_iters", [0, 2])
def test_tol_halting(min_iters):
  step, params, h0, x = blocks.make("deq", 90, 16)
  kw = dict(max_iters=30, tol=1e-3, min_iters=min_iters)
  (got, info), plans = _run(step, params, h0, x, return_info=True, **kw)
  assert isinstance(plans[0], kernel_tpu_groups.GroupPlan)
  want, ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.halted, ref_info.halted)
  assert np.any(info.halted) and np.all(info.steps >= min_iters)
  np.testing.assert_allclose(info.residual, ref_info.residual, rtol=1e-4, atol=1e-6)


def _halting_in_pieces_matches_reference(step, params, h0, x, **kw):
  """iterate with `kw` (halting) in 32-row chunks with 16- and 8-row pieces
  against the reference: the state, steps, halted flags and residuals;
  returns the info."""
  (got, info), plans = _run(step, params, h0, x, block_rows=32, return_info=True, **kw)
  assert [rows for rows, _ in plans[0].pieces] == [16, 8]
  want, ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.halted, ref_info.halted)
  np.testing.assert_allclose(info.residual, ref_info.residual, rtol=1e-4, atol=1e-6)
  return info


@pytest.mark.parametrize("order", ["first_rows_stop_last", "first_rows_stop_first"])
def test_tol_halting_runs_the_prefix_up_to_the_last_running_row(monkeypatch, order):
  # The tracked loop cuts each step's prefix after the last row still
  # running: rows that stop in the order they lie (the first rows last, as
  # the implicit adjoint sorts them) run on a prefix that shrinks to the
  # pieces' heights (8- and 16-row pieces of 32-row chunks here); rows that
  # stop the other way keep it whole. Both as the reference.
  monkeypatch.setattr(kernel_tpu_groups, "SMALLEST_PIECE", 8)
  step, params, h0, x = blocks.make("deq", 150, 16)
  if order == "first_rows_stop_first":  # `blocks.deq`'s input scale grows along the
    x = x[::-1]                           # rows, and its rows' steps fall: reversed
  info = _halting_in_pieces_matches_reference(step, params, h0, x, max_iters=40, tol=1e-4)
  steps = np.asarray(info.steps)
  assert np.all(info.halted) and steps.min() < steps.max()


def test_tol_halting_with_ragged_counts_and_pieces(monkeypatch):
  # The cut prefix is the smaller of the rows running by count and the rows
  # up to the last one no criterion stopped: ragged counts (sorted into count
  # order, moved back after) and `tol` together, with 8- and 16-row pieces.
  monkeypatch.setattr(kernel_tpu_groups, "SMALLEST_PIECE", 8)
  step, params, h0, x = blocks.make("deq", 150, 16)
  n = cases.counts("ragged", 150, max_iters=40, seed=6)
  info = _halting_in_pieces_matches_reference(step, params, h0, x, iters=n, max_iters=40,
                                              tol=1e-4)
  halted = np.asarray(info.halted)
  assert halted.any() and not halted.all()  # some rows stop by tol, others by count


def test_custom_halt_with_counts():
  step, params, h0, x = blocks.make("tanh_rnn", 50, 16)
  halt = lambda p, h_new, h, x: jnp.mean(h_new, axis=1) > 0.05
  n = cases.counts("ragged", 50, seed=1)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, halt=halt)
  (got, info), _ = _run(step, params, h0, x, return_info=True, **kw)
  want, ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.halted, ref_info.halted)


def _keyed_indexed_rnn(params, h, x, *, key, index):
  """The tanh RNN reading its step index, with dropout from its rows' keys."""
  w, u, b = params
  new = jnp.tanh(h @ w + x @ u + b + 0.01 * index.astype(h.dtype))
  return pallas_loop.random.dropout(key, new, 0.25)


def test_keys_and_step_index():
  # The rows' indices travel into count order with the rows: a keyed step
  # draws the same bits as in the reference.
  step = _keyed_indexed_rnn
  _, params, h0, x = blocks.make("tanh_rnn", 70, 16)
  n = cases.counts("ragged", 70, seed=5)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, key=jax.random.key(3), step_index=True)
  got, plans = _run(step, params, h0, x, **kw)
  assert plans[0].uses_rows
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, **kw))


def test_integer_leaf_in_the_state():
  def step(params, state, x):
    h, count = state
    return jnp.tanh(h @ params + x), count + 1

  w = jnp.eye(16) * 0.5
  h0 = (jnp.zeros((40, 16)), jnp.zeros((40,), jnp.int32))
  x = jnp.ones((40, 16))
  n = cases.counts("ragged", 40, seed=6)
  got, _ = _run(step, w, h0, x, iters=n, max_iters=cases.MAX_ITERS, block_rows=128)
  want = reference.iterate(step, w, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(got[1], np.clip(n, 0, cases.MAX_ITERS))


def test_gradient_through_the_group_kernel():
  step, params, h0, x = blocks.make("gru", 45, 16)
  n = cases.counts("ragged", 45, seed=7)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  loss = lambda f: lambda p, h: cases.tree_sum(f(step, p, h, x, **kw))
  options = TPU_INTERPRET.replace(block_rows=16)
  ours = jax.grad(loss(lambda *a, **k: pallas_loop.iterate(*a, **k, options=options)),
                  argnums=(0, 1))(params, h0)
  want = jax.grad(loss(reference.iterate), argnums=(0, 1))(params, h0)
  oracle.assert_trees_close(ours, want, what="gradient")


def test_step_outputs_and_unsorted_rows_take_the_tile_kernel():
  step, params, h0, x = blocks.make("tanh_rnn", 20, 16)
  n = cases.counts("ragged", 20)
  _, plans = _run(lambda p, h, x: (step(p, h, x), h[:, 0]), params, h0, x, iters=n,
                  max_iters=cases.MAX_ITERS, step_outputs=True)
  assert isinstance(plans[0], kernel_forward.TilePlan)
  got, plans = _run(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS, sort_rows=False)
  assert isinstance(plans[0], kernel_forward.TilePlan)
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, iters=n,
                                                   max_iters=cases.MAX_ITERS))


def test_mosaic_plan_rules():
  # Planned for the chip (no compile): a 16-bit state needs chunks of whole
  # 16-row tiles, a 1-D leaf chunks of whole 128-lane rows.
  step, params, h0, x = blocks.make("tanh_rnn", 256, 128, jnp.bfloat16)
  fn = step_fn.StepFn(step_fn.with_halt(step, None), ())
  plan = lambda **kw: kernel_tpu_groups.plan(backend_mosaic_tpu.MOSAIC_TPU, fn, params, (),
                                             h0, x, max_iters=8, **kw)
  assert not plan().problems and plan().chunk_rows == 128
  assert any("multiple of 16" in m for m in plan(block_rows=8).problems)
  assert not plan(block_rows=16).problems
  fn = step_fn.StepFn(step_fn.with_halt(lambda p, h, x: h * 0.5, None), ())
  problems = kernel_tpu_groups.plan(backend_mosaic_tpu.MOSAIC_TPU, fn, None, (),
                                    jnp.zeros((512,)), None, block_rows=64,
                                    max_iters=8).problems
  assert any("a chunk of its rows" in m and "multiple of 128" in m for m in problems)


@pytest.mark.parametrize("compare_all", [True, False])
def test_active_rows_is_the_running_prefix(monkeypatch, compare_all):
  # Both ways of building the table: every count against every step, and the
  # binary search (the limit patched to take it).
  if not compare_all:
    monkeypatch.setattr(kernel_tpu_groups, "COMPARE_ALL_LIMIT", 0)
  rng = np.random.default_rng(0)
  for groups, rows, steps in ((2, 4, 6), (4, 64, 9), (1, 100, 1)):
    counts = -np.sort(-rng.integers(0, steps + 1, (groups, rows)), axis=1)
    got = kernel_tpu_groups.active_rows(jnp.asarray(counts.reshape(-1), jnp.int32), groups,
                                        steps)
    want = np.array([[(g > t).sum() for t in range(steps)] for g in counts])
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("batch,chunk,limit", [(100, 16, None), (32768, 2048, None),
                                               (262144, 2048, 50000), (4096, 2048, None)])
def test_group_rows(batch, chunk, limit):
  group = kernel_tpu_groups._group_rows(batch, chunk, limit)  # pylint: disable=protected-access
  assert group % chunk == 0 and group >= chunk
  if limit is not None:
    assert group <= limit
  groups = -(-tiling.padded_rows(batch, chunk) // group)
  assert groups * group - batch < groups * chunk  # padding: under a chunk a group


def test_default_chunk_rows():
  assert kernel_tpu_groups.default_chunk_rows(32768) == 2048
  assert kernel_tpu_groups.default_chunk_rows(4096) == 2048
  assert kernel_tpu_groups.default_chunk_rows(1000) == 256
  assert kernel_tpu_groups.default_chunk_rows(7) == 16


@pytest.mark.parametrize("batch", [1, 16, 64, 100, 127, 128, 200, 256, 300, 1000, 4096])
def test_a_1d_leaf_is_sliced_where_mosaic_can_prove_it(batch):
  # A DEQ solver's state carries per-row scalars (1-D leaves: rows on the
  # lanes). A chunk starting at a traced row must then be a multiple of 128
  # rows; a group of one chunk is sliced from row 0, written so (the DEQ
  # example at 64 rows failed Mosaic's alignment proof on the chip before).
  # Planned for the chip without compiling: the plan either declines or
  # keeps to one of the two.
  fn = step_fn.StepFn(step_fn.with_halt(lambda p, h, x: (h[0] * 0.5, h[1] + 1.0), None), ())
  h0 = (jnp.zeros((batch, 32), jnp.float32), jnp.zeros((batch,), jnp.float32))
  plan = kernel_tpu_groups.plan(backend_mosaic_tpu.MOSAIC_TPU, fn, None, (), h0, None,
                                max_iters=8)
  assert (plan.problems or plan.group_rows == plan.chunk_rows
          or plan.chunk_rows % 128 == 0), (plan.chunk_rows, plan.group_rows)


@pytest.mark.parametrize("pattern", ["ragged", "one_long_per_tile", "descending"])
@pytest.mark.parametrize("block,dtype", [("tanh_rnn", "bfloat16"), ("lstm", "float32")])
def test_partial_chunk_pieces(monkeypatch, pattern, block, dtype):
  # A step's partial chunk runs at C/2 or C/4 rows where those hold its
  # running rows: with 8-row pieces allowed, 32-row chunks run pieces of 16
  # and 8 rows, the rows past the prefix inside a piece masked.
  monkeypatch.setattr(kernel_tpu_groups, "SMALLEST_PIECE", 8)
  step, params, h0, x = blocks.make(block, 150, 16, jnp.dtype(dtype))
  n = np.asarray(cases.counts("ragged" if pattern == "descending" else pattern, 150, seed=3))
  if pattern == "descending":
    n = np.sort(n)[::-1].copy()
  kw = dict(iters=jnp.asarray(n), max_iters=cases.MAX_ITERS)
  got, plans = _run(step, params, h0, x, block_rows=32, **kw)
  assert [rows for rows, _ in plans[0].pieces] == [16, 8]
  want, want_f32 = oracle.reference_pair(step, params, h0, x, **kw)
  oracle.assert_trees_close(got, want, want_f32)


def test_pieces_need_the_chunks_constants(monkeypatch):
  # A constant the step makes at the batch's shape differs at a piece's
  # height: no pieces then (the kernel passes the chunk's constants).
  monkeypatch.setattr(kernel_tpu_groups, "SMALLEST_PIECE", 8)
  big = lambda p, h, x: h * p + jnp.asarray(np.arange(h.shape[0] * h.shape[1], dtype=np.float32)
                                            .reshape(h.shape))
  small = lambda p, h, x: jnp.tanh(h * p + x)
  for step, pieces in ((big, 0), (small, 2)):
    fn = step_fn.StepFn.closing_over(step, jnp.float32(0.5), jnp.ones((64, 8)), jnp.ones((64, 8)))
    rows = jnp.ones((64, 8))
    traced = fn.specialize(jnp.float32(0.5), fn.outer_consts, step_fn.avals(rows, 32),
                           step_fn.avals(rows, 32))
    got = kernel_tpu_groups.trace_pieces(fn, jnp.float32(0.5), fn.outer_consts, rows, rows, 32,
                                         traced)
    assert len(got) == pieces


def _primitives(fn, *args) -> set[str]:
  """The primitives of fn's jaxpr, nested jaxprs (custom_vjp, jit, the kernels) included."""
  return {e.primitive.name for e in backend_lib.iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)}


@pytest.mark.parametrize("grad", [False, True])
def test_one_count_moves_no_row(grad):
  # One count for every row (an int, a 0-d array, None) is known at trace
  # time: neither the forward nor the backward sorts or gathers a row. The
  # same counts as a [B] array are sorted like any others; both agree with
  # the oracle.
  step, params, h0, x = blocks.make("tanh_rnn", 64, 16, jnp.float32)

  def run(iters):
    f = lambda p, h: pallas_loop.iterate(step, p, h, x, iters=iters, max_iters=5,
                                         options=TPU_INTERPRET.replace(block_rows=16))
    return jax.grad(lambda p, h: jnp.sum(f(p, h)), argnums=(0, 1)) if grad else f

  for one in (5, jnp.int32(5), None):
    prims = _primitives(run(one), params, h0)
    assert "sort" not in prims and "gather" not in prims, prims
  assert "sort" in _primitives(run(jnp.full((64,), 5)), params, h0)
  oracle_run = lambda p, h: reference.iterate(step, p, h, x, iters=5, max_iters=5)
  if grad:
    oracle_run = jax.grad(lambda p, h, f=oracle_run: jnp.sum(f(p, h)), argnums=(0, 1))
  want = oracle_run(params, h0)
  for one in (5, jnp.full((64,), 5)):
    got = run(one)(params, h0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def _kernel_rows(fn, *args) -> set[int]:
  """The rows of every output of the Pallas kernels in fn's jaxpr."""
  return {v.aval.shape[0] for e in backend_lib.iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
          if e.primitive.name == "pallas_call" for v in e.outvars}


@pytest.fixture
def small_slabs(monkeypatch):
  """Slabs of 64 rows (a tanh RNN at D=16 in float32: 192 bytes a row)."""
  monkeypatch.setattr(kernel_tpu_groups, "SLAB_BYTES", 64 * 192)
  monkeypatch.setattr(kernel_tpu_groups, "SLABS_FROM_BYTES", 64 * 192)


def test_slabs_sort_and_run_a_slab_at_a_time(small_slabs):
  # A batch larger than a slab: each slab's rows are sorted, run and put back
  # on their own; the padding of the last slab reaches no result.
  step, params, h0, x = blocks.make("tanh_rnn", 300, 16)
  n = cases.counts("ragged", 300, max_iters=9, seed=7)
  kw = dict(iters=n, max_iters=9)
  (got, info), plans = _run(step, params, h0, x, return_info=True, **kw)
  assert plans[0].slabs == 5 and plans[0].slab_rows == 64, (plans[0].slabs, plans[0].slab_rows)
  want, ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  # The kernel runs on a slab's rows (inside the slabs' loop), not the batch's.
  run = lambda h: pallas_loop.iterate(step, params, h, x, **kw,
                                      options=TPU_INTERPRET.replace(block_rows=16))
  assert _kernel_rows(run, h0) == {64}
  assert _kernel_rows(lambda h: pallas_loop.iterate(
      step, params, h, x, iters=5, max_iters=9,
      options=TPU_INTERPRET.replace(block_rows=16)), h0) == {320}  # one count: one batch


def test_slabs_with_halting_keys_and_the_gradient(small_slabs):
  # What travels with a row through its slab: the rows' indices (a keyed
  # step draws the oracle's bits), the tracked columns (tol halting), and
  # the gradient through the forward's residuals.
  step = _keyed_indexed_rnn
  _, params, h0, x = blocks.make("tanh_rnn", 200, 16)
  n = cases.counts("ragged", 200, seed=8)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, key=jax.random.key(3), step_index=True)
  got, plans = _run(step, params, h0, x, **kw)
  assert plans[0].slabs > 1 and plans[0].uses_rows
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, **kw))

  # Counts as a [B] array with `tol`: the rows are sorted (one count would
  # run as one batch) and their residual, steps and halted flags tracked.
  deq, p_deq, h_deq, x_deq = blocks.make("deq", 150, 16)
  halting = dict(iters=cases.counts("ragged", 150, max_iters=30, seed=11), max_iters=30,
                 tol=1e-3, min_iters=2)
  (got, info), plans = _run(deq, p_deq, h_deq, x_deq, return_info=True, **halting)
  assert plans[0].slabs > 1
  assert _kernel_rows(lambda h: pallas_loop.iterate(
      deq, p_deq, h, x_deq, **halting, options=TPU_INTERPRET.replace(block_rows=16)),
      h_deq) == {plans[0].slab_rows}
  want, ref_info = reference.iterate(deq, p_deq, h_deq, x_deq, return_info=True, **halting)
  oracle.assert_trees_close(got, want)
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.halted, ref_info.halted)

  rnn, p_rnn, h_rnn, x_rnn = blocks.make("tanh_rnn", 150, 16)
  m = cases.counts("ragged", 150, seed=9)
  loss = lambda run: (lambda p, h: jnp.sum(run(rnn, p, h, x_rnn, iters=m, max_iters=cases.MAX_ITERS)))
  kernel = lambda *a, **k: pallas_loop.iterate(*a, **k, options=TPU_INTERPRET.replace(block_rows=16))
  got = jax.grad(loss(kernel), argnums=(0, 1))(p_rnn, h_rnn)
  want = jax.grad(loss(reference.iterate), argnums=(0, 1))(p_rnn, h_rnn)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_slab_rows():
  h = jax.ShapeDtypeStruct((300, 16), jnp.float32)
  assert kernel_tpu_groups.slab_rows(300, 16, [h, h, h]) == 300  # 57,600 bytes: one slab
  with pytest.MonkeyPatch.context() as m:
    m.setattr(kernel_tpu_groups, "SLAB_BYTES", 64 * 192)
    m.setattr(kernel_tpu_groups, "SLABS_FROM_BYTES", 64 * 192)
    assert kernel_tpu_groups.slab_rows(300, 16, [h, h, h]) == 64
    assert kernel_tpu_groups.slab_rows(300, 32, [h, h, h]) == 128  # one group of 4 chunks at least
    # 128 bytes a row: at most 96 rows a slab; 4 slabs of 80 rows pad the batch
    # to 320 rows (4 of 96: 384; 5 of 64: 320, more slabs).
    assert kernel_tpu_groups.slab_rows(300, 16, [h, h]) == 80


@pytest.mark.parametrize("in_step_order", [True, False])
def test_implicit_adjoint_sorts_rows_only_by_their_forward_steps(monkeypatch, in_step_order):
  # The implicit adjoint gives every row one budget (a row that took no step
  # starts from a zero cotangent): with one count in the forward too, no row
  # is sorted or gathered in either solve; the rows are sorted once, by the
  # steps they took forward, around the adjoint solve
  # (`grad_modes.ADJOINT_IN_STEP_ORDER`). Rows with no step keep the
  # cotangent of h0 and no adjoint, as with the XLA implementation.
  monkeypatch.setattr(grad_modes, "ADJOINT_IN_STEP_ORDER", in_step_order)
  step, params, h0, x = blocks.make("deq", 64, 16)
  n = jnp.where(jnp.arange(64) % 9 == 0, 0, 30)

  def grads(options, iters):
    loss = lambda p, h: jnp.sum(pallas_loop.iterate(
        step, p, h, x, iters=iters, max_iters=30, tol=1e-4, grad=pallas_loop.Implicit(),
        options=options) ** 2)
    return jax.grad(loss, argnums=(0, 1))

  kernel = TPU_INTERPRET.replace(block_rows=16)
  jaxpr = jax.make_jaxpr(grads(kernel, None))(params, h0).jaxpr
  sorts = [e for e in backend_lib.iter_eqns(jaxpr) if e.primitive.name == "sort"]
  # The order by the forward's steps and its inverse.
  assert len(sorts) == (2 if in_step_order else 0), sorts
  if not in_step_order:
    assert "gather" not in {e.primitive.name for e in backend_lib.iter_eqns(jaxpr)}
  for iters in (None, n):
    got = grads(kernel, iters)(params, h0)
    want = grads(pallas_loop.Options(implementation="xla"), iters)(params, h0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
