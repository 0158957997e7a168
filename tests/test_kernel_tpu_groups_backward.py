"""The TPU's group backward (`kernel_tpu_groups_backward.py`) against the reference.

Run in Pallas' TPU interpret mode (`interpret=pltpu.InterpretParams()`), which
takes the TPU's own kernels: small chunks (`block_rows=16`) so that a batch
spans several chunks and groups, padding poisoned with NaN so a padded row
that leaked into a gradient would show. Gradients are of sum(tanh(output)),
w.r.t. the parameters, the initial state and the inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop._src import dispatch
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src.kernels import kernel_backward
from pallas_loop._src.kernels import kernel_tpu_groups
from pallas_loop._src.kernels import kernel_tpu_groups_backward as groups_backward
from pallas_loop._src.step import step_fn
from benchmarks import blocks
from tests import cases
from tests import lowering
from tests import oracle

TPU_INTERPRET = pallas_loop.Options(implementation="pallas", interpret=pltpu.InterpretParams())


def _grads(step, params, h0, x, *, block_rows=16, sort_rows=True, ref_kw=None, **kw):
  """(ours, the reference's) gradients, and the backward plans ours took
  (`ref_kw`: the reference's keywords where they differ from ours)."""
  options = TPU_INTERPRET.replace(block_rows=block_rows, sort_rows=sort_rows)
  loss = lambda f: lambda p, h, x_: sum(
      jnp.sum(jnp.tanh(a.astype(jnp.float32))) for a in jax.tree.leaves(f(step, p, h, x_, **kw))
      if jnp.issubdtype(a.dtype, jnp.floating))
  ours = lambda *a, **k: pallas_loop.iterate(*a, **k, options=options)
  with dispatch.observe_plans() as seen, pallas_loop.testing.poisoned_padding():
    got = jax.grad(loss(ours), argnums=(0, 1, 2), allow_int=True)(params, h0, x)
  ref_kw = {k: v for k, v in kw.items() if k != "grad"} if ref_kw is None else ref_kw
  ref = lambda *a, **k: reference.iterate(*a, **ref_kw)
  want = jax.grad(loss(ref), argnums=(0, 1, 2), allow_int=True)(params, h0, x)
  if any(a.dtype == jnp.bfloat16 for a in jax.tree.leaves((params, h0, x))):
    # bfloat16: judged against the float32 reference (`oracle.assert_trees_close`).
    want_f32 = jax.grad(loss(ref), argnums=(0, 1, 2), allow_int=True)(
        *(oracle.to_f32(a) for a in (params, h0, x)))
    want = (want, want_f32)
  return got, want, [p for what, _, p in seen if what == "backward"]


def _dropout_rnn(params, h, x, *, key):
  """The tanh RNN with dropout on its new state: a keyed step."""
  w, u, b = params
  return pallas_loop.random.dropout(key, jnp.tanh(h @ w + x @ u + b), 0.25)


def _floats(tree):
  return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)]


_BLOCKS = (("tanh_rnn", "float32"), ("tanh_rnn", "bfloat16"), ("lstm", "float32"),
           ("residual_mlp", "bfloat16"))
# The quick set: every block with ragged counts at a batch of several chunks,
# and each count pattern once; the rest of the cross product is a slow sweep.
_QUICK = ({(b, d, "ragged", 100) for b, d in _BLOCKS}
          | {("tanh_rnn", "bfloat16", p, 7) for p in cases.PATTERNS})


@pytest.mark.parametrize("block,dtype,pattern,batch", [
    pytest.param(b, d, p, n, marks=() if (b, d, p, n) in _QUICK else pytest.mark.slow)
    for b, d in _BLOCKS for p in cases.PATTERNS for n in (7, 100)])
def test_full_gradient_matches_reference(block, dtype, pattern, batch):
  step, params, h0, x = blocks.make(block, batch, 16, jnp.dtype(dtype))
  n = cases.counts(pattern, batch)
  got, want, plans = _grads(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  assert plans and all(isinstance(p, groups_backward.GroupWindowPlan) for p in plans)
  if dtype == "bfloat16":
    oracle.assert_trees_close(_floats(got), _floats(want[0]), _floats(want[1]), what="gradient")
  else:
    oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_several_groups_and_chunks():
  step, params, h0, x = blocks.make("gru", 300, 16)
  n = cases.counts("ragged", 300, max_iters=9, seed=4)
  got, want, plans = _grads(step, params, h0, x, iters=n, max_iters=9)
  assert plans[0].groups > 1 and plans[0].group_rows // plans[0].chunk_rows > 1
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


@pytest.mark.parametrize("every", [1, 2, 5, 9, 40])
def test_checkpoint_intervals(every):
  # K=1: a checkpoint every step; K=2 and 5: segments, the last one short;
  # K=9, the window: no checkpointing pass, one segment; K=40 holds 9 states.
  step, params, h0, x = blocks.make("tanh_rnn", 60, 16)
  n = cases.counts("ragged", 60, max_iters=9, seed=8)
  got, want, plans = _grads(step, params, h0, x, iters=n, max_iters=9,
                            grad=pallas_loop.Full(checkpoint_every=every))
  assert plans[0].every == min(every, 9)
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_truncated_windows_start_at_each_rows_own_step():
  # Truncated(k): each row's window is its last min(k, n) steps, from its
  # own first step index t0 = n - min(k, n): a keyed step draws that step's bits.
  _, params, h0, x = blocks.make("tanh_rnn", 50, 16)
  n = cases.counts("ragged", 50, seed=9)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, key=jax.random.key(1))
  got, want, plans = _grads(_dropout_rnn, params, h0, x, grad=pallas_loop.Truncated(2), **kw,
                            ref_kw=dict(kw, truncate=2))
  assert isinstance(plans[0], groups_backward.GroupWindowPlan)
  assert plans[0].reads_t and plans[0].reads_rows
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_keyed_full_gradient():
  _, params, h0, x = blocks.make("tanh_rnn", 70, 16)
  n = cases.counts("ragged", 70, seed=5)
  got, want, plans = _grads(_dropout_rnn, params, h0, x, iters=n, max_iters=cases.MAX_ITERS,
                            key=jax.random.key(3))
  assert isinstance(plans[0], groups_backward.GroupWindowPlan) and plans[0].reads_rows
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_integer_leaf_and_a_constant_closed_over():
  scale = jnp.full((16,), 0.7)

  def step(params, state, x):
    h, count = state
    return jnp.tanh(h @ params * scale + x), count + 1

  w = jax.random.normal(jax.random.key(0), (16, 16)) * 0.3
  h0 = (jax.random.normal(jax.random.key(1), (40, 16)), jnp.zeros((40,), jnp.int32))
  x = jax.random.normal(jax.random.key(2), (40, 16))
  n = cases.counts("ragged", 40, seed=6)
  got, want, plans = _grads(step, w, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  assert isinstance(plans[0], groups_backward.GroupWindowPlan)
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_halting_differentiates_the_steps_taken():
  step, params, h0, x = blocks.make("deq", 90, 16)
  got, want, plans = _grads(step, params, h0, x, max_iters=30, tol=1e-3)
  assert isinstance(plans[0], groups_backward.GroupWindowPlan)
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_one_clock_unsorted_rows_and_bool_leaves_take_the_tile_kernel():
  step, params, h0, x = blocks.make("tanh_rnn", 20, 16)
  n = cases.counts("ragged", 20)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  indexed = lambda p, h, x_, *, index: step(p, h, x_) + 0.01 * index.astype(h.dtype)
  for f, extra in ((step, dict(sort_rows=False)), (indexed, dict(step_index=True)),
                   (lambda p, h, x_: (step(p, h, x_), h[:, 0]), dict(step_outputs=True))):
    got, want, plans = _grads(f, params, h0, x, **kw, **extra)
    assert isinstance(plans[0], kernel_backward.WindowPlan), extra
    oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")

  def flagged(p, state, x_):
    h, flag = state
    return step(p, h, x_), flag | (jnp.max(h, axis=1) > 0)

  got, want, plans = _grads(flagged, params, (h0, jnp.zeros((20,), jnp.bool_)), x, **kw)
  assert isinstance(plans[0], kernel_backward.WindowPlan)
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")


def test_mosaic_plan():
  # Planned for a TPU v5e (no compile): chunks of the forward's default
  # height, groups of whole chunks within the VMEM the kernel asks for; by
  # default the whole window is one segment where its states fit (no
  # checkpointing pass), else K ~ sqrt(W).
  step, params, h0, x = blocks.make("tanh_rnn", 32768, 128, jnp.bfloat16)
  fn = step_fn.StepFn(step_fn.with_halt(step, None), ())
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=lowering.AbstractDevice(
      device_kind="TPU v5 lite", num_cores=None, platform="tpu"))
  plan = lambda **kw: groups_backward.plan(backend_mosaic_tpu.MOSAIC_TPU, fn, params, (), h0,
                                           x, **{"block_rows": None, "every": None, **kw})
  with jax.sharding.use_abstract_mesh(mesh):
    for bound, every, want in ((64, None, 64), (128, None, 128), (1024, None, 32),
                               (64, 8, 8)):
      p = plan(bound=bound, every=every)
      assert isinstance(p, groups_backward.GroupWindowPlan)
      assert p.every == want and p.checkpoints == -(-bound // want), (bound, p.every)
      assert p.chunk_rows == 2048 and p.group_rows % p.chunk_rows == 0
      assert p.config.estimate["vmem_bytes"] <= p.config.estimate["vmem_limit_bytes"]
      assert not p.reads_t and not p.reads_rows
    # A 16-bit state in chunks of 8 rows is no whole number of Mosaic's
    # 16-row tiles as a dynamic slice: the tile kernel takes it (8-row blocks).
    p = groups_backward.plan(backend_mosaic_tpu.MOSAIC_TPU, fn, params, (), h0[:256],
                             x[:256], block_rows=8, bound=64, every=None)
    assert isinstance(p, kernel_backward.WindowPlan) and not p.problems


def test_sum_of_groups_is_deterministic():
  step, params, h0, x = blocks.make("tanh_rnn", 300, 16)
  n = cases.counts("ragged", 300, seed=10)
  a, _, _ = _grads(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  b, _, _ = _grads(step, params, h0, x, iters=n, max_iters=cases.MAX_ITERS)
  for u, v in zip(_floats(a), _floats(b)):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("block,dtype", [("tanh_rnn", "float32"), ("lstm", "bfloat16")])
def test_partial_chunk_pieces(monkeypatch, block, dtype):
  # Every pass's partial chunk (checkpointing, recompute, reverse) at C/2 or
  # C/4 rows where those hold the rows whose window has the step: with 8-row
  # pieces allowed, 32-row chunks run pieces of 16 and 8 rows.
  monkeypatch.setattr(kernel_tpu_groups, "SMALLEST_PIECE", 8)
  step, params, h0, x = blocks.make(block, 150, 16, jnp.dtype(dtype))
  n = cases.counts("ragged", 150, seed=5)
  got, want, plans = _grads(step, params, h0, x, block_rows=32, iters=n,
                            max_iters=cases.MAX_ITERS,
                            grad=pallas_loop.Full(checkpoint_every=3))
  assert plans and [rows for rows, _ in plans[0].pieces] == [16, 8]
  if dtype == "bfloat16":
    oracle.assert_trees_close(_floats(got), _floats(want[0]), _floats(want[1]))
  else:
    oracle.assert_trees_close(_floats(got), _floats(want))


@pytest.mark.parametrize("mode", ["full", pallas_loop.Truncated(2)])
def test_slabs(monkeypatch, mode):
  # A batch of several slabs (`kernel_tpu_groups`' slab sizes patched to about
  # 64 rows): each slab's windows are sorted, run and put back on their own,
  # the shared gradients summed over every slab's groups; a keyed step reads
  # its rows' indices and first step indices through the slabs.
  monkeypatch.setattr(kernel_tpu_groups, "SLAB_BYTES", 64 * 192)
  monkeypatch.setattr(kernel_tpu_groups, "SLABS_FROM_BYTES", 64 * 192)
  _, params, h0, x = blocks.make("tanh_rnn", 150, 16)
  n = cases.counts("ragged", 150, seed=10)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS, key=jax.random.key(2))
  ref_kw = dict(kw, truncate=mode.k) if isinstance(mode, pallas_loop.Truncated) else None
  got, want, plans = _grads(_dropout_rnn, params, h0, x, grad=mode, ref_kw=ref_kw, **kw)
  assert isinstance(plans[0], groups_backward.GroupWindowPlan)
  assert plans[0].slabs == 3 and plans[0].slab_rows == 64, (plans[0].slabs, plans[0].slab_rows)
  oracle.assert_trees_close(_floats(got), _floats(want), what="gradient")
