"""The TPU's row permutation kernels (`kernel_tpu_rows.py`) against XLA's gathers.

Run in Pallas' TPU interpret mode: every movable dtype and batch shape
gathers and puts back exactly what `tiling.take_rows` does; what the kernels
do not take falls back to XLA's gather; and the group kernels, forward and
backward, move a 128-lane state through them and still match the oracle.
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
from pallas_loop._src.kernels import kernel_tpu_rows
from pallas_loop._src import tiling
from benchmarks import blocks
from tests import cases
from tests import oracle

INTERPRET = pltpu.InterpretParams()
TPU_INTERPRET = pallas_loop.Options(implementation="pallas", interpret=INTERPRET)


def _rows(dtype, batch, width=128, seed=0):
  x = jax.random.normal(jax.random.key(seed), (batch, width)) * 100
  if jnp.issubdtype(dtype, jnp.integer):
    return x.astype(jnp.int32).astype(dtype)
  return x.astype(dtype)


_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint32)


@pytest.mark.parametrize("dtype,batch", [
    *[(d, 128) for d in _DTYPES], (jnp.float32, 384), (jnp.bfloat16, 384),
    # The full sweep: every dtype at three, nine and two programs.
    *[pytest.param(d, b, marks=pytest.mark.slow) for d in _DTYPES for b in (384, 2304, 4096)
      if (d, b) not in ((jnp.float32, 384), (jnp.bfloat16, 384))]])
def test_gather_and_put_back_are_exact(dtype, batch):
  # 128 rows: one program; 384: three of 128 and 2304 nine of 256 (the
  # largest power of two dividing it); 4096: two of 2048. A 16-bit array's
  # float32 scratch is filled by the first program and read back by the last.
  x = _rows(dtype, batch)
  order = jax.random.permutation(jax.random.key(1), batch).astype(jnp.int32)
  assert kernel_tpu_rows.movable(x)
  got = kernel_tpu_rows.gather(x, order, interpret=INTERPRET)
  np.testing.assert_array_equal(got, tiling.take_rows(x, order))
  np.testing.assert_array_equal(kernel_tpu_rows.put_back(got, order, interpret=INTERPRET), x)


def test_what_the_kernels_do_not_take_moves_by_xla():
  # A 1-D leaf, a width that is not whole lanes, a batch that is no multiple
  # of 128, a bool leaf, None: each moves by XLA's gather, in one tree with a
  # movable leaf; every leaf comes back where it was.
  batch = 128
  tree = {"moved": _rows(jnp.bfloat16, batch), "column": jnp.arange(batch, dtype=jnp.int32),
          "narrow": _rows(jnp.float32, batch, width=64), "flags": jnp.arange(batch) % 3 == 0,
          "none": None}
  assert [kernel_tpu_rows.movable(tree[k]) for k in ("moved", "column", "narrow", "flags")] == [
      True, False, False, False]
  assert not kernel_tpu_rows.movable(_rows(jnp.float32, 48))
  assert not kernel_tpu_rows.movable(_rows(jnp.float32, 2064))
  assert not kernel_tpu_rows.movable(_rows(jnp.float32, 65536))  # 32 MiB: over LARGEST_BYTES
  order = jax.random.permutation(jax.random.key(2), batch).astype(jnp.int32)
  got = kernel_tpu_rows.gather(tree, order, interpret=INTERPRET)
  want = tiling.take_rows(tree, order)
  assert got["none"] is None
  for k in ("moved", "column", "narrow", "flags"):
    np.testing.assert_array_equal(got[k], want[k])
  back = kernel_tpu_rows.put_back(got, order, interpret=INTERPRET)
  for k in ("moved", "column", "narrow", "flags"):
    np.testing.assert_array_equal(back[k], tree[k])


def _kernel_names(fn, *args) -> set[str]:
  return {e.params.get("name", "") for e in backend_lib.iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
          if e.primitive.name == "pallas_call"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_group_kernel_moves_its_rows_with_them(dtype):
  # A 128-lane state with ragged counts: the forward gathers and puts back
  # its rows with the kernels (NaN padding: no padded row reaches a result),
  # and equals the oracle and the same forward with XLA's gathers.
  batch = 128
  step, params, h0, x = blocks.make("tanh_rnn", batch, 128, jnp.dtype(dtype))
  n = cases.counts("ragged", batch, seed=3)
  run = lambda h: pallas_loop.iterate(step, params, h, x, iters=n, max_iters=cases.MAX_ITERS,
                                      options=TPU_INTERPRET.replace(block_rows=16))
  names = _kernel_names(run, h0)
  assert {"pallas_loop_rows_gather", "pallas_loop_rows_scatter"} <= names, names
  with pallas_loop.testing.poisoned_padding():
    got = run(h0)
  want, want_f32 = oracle.reference_pair(step, params, h0, x, iters=n,
                                         max_iters=cases.MAX_ITERS)
  oracle.assert_trees_close(got, want, want_f32)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(kernel_tpu_rows, "KERNELS", False)
    jax.clear_caches()  # iterate's traces were made with the kernels
    assert "pallas_loop_rows_gather" not in _kernel_names(run, h0)
    np.testing.assert_array_equal(run(h0), got)


@pytest.mark.slow  # the quick set differentiates through them under vmap (below)
def test_the_group_backward_moves_its_rows_with_them():
  batch = 128
  step, params, h0, x = blocks.make("tanh_rnn", batch, 128, jnp.float32)
  n = cases.counts("ragged", batch, seed=5)
  kw = dict(iters=n, max_iters=cases.MAX_ITERS)
  loss = lambda f: lambda p, h: cases.tree_sum(f(step, p, h, x, **kw))
  options = TPU_INTERPRET.replace(block_rows=16)
  ours = jax.grad(loss(lambda *a, **k: pallas_loop.iterate(*a, **k, options=options)),
                  argnums=(0, 1))
  assert "pallas_loop_rows_scatter" in _kernel_names(ours, params, h0)
  want = jax.grad(loss(reference.iterate), argnums=(0, 1))(params, h0)
  oracle.assert_trees_close(ours(params, h0), want, what="gradient")


def test_slabs_move_their_rows_with_them(monkeypatch):
  # A batch in slabs of 128 rows (a float32 tanh RNN at D=128: 1536 bytes a
  # row): each slab's rows move through the kernels inside the slabs' loop,
  # and the result equals the oracle's.
  from pallas_loop._src.kernels import kernel_tpu_groups  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(kernel_tpu_groups, "SLAB_BYTES", 128 * 1536)
  monkeypatch.setattr(kernel_tpu_groups, "SLABS_FROM_BYTES", 128 * 1536)
  batch = 300
  step, params, h0, x = blocks.make("tanh_rnn", batch, 128, jnp.float32)
  n = cases.counts("ragged", batch, max_iters=9, seed=6)
  run = lambda h: pallas_loop.iterate(step, params, h, x, iters=n, max_iters=9,
                                      options=TPU_INTERPRET.replace(block_rows=16))
  assert {"pallas_loop_rows_gather", "pallas_loop_rows_scatter"} <= _kernel_names(run, h0)
  with pallas_loop.testing.poisoned_padding():
    got = run(h0)
  oracle.assert_trees_close(got, reference.iterate(step, params, h0, x, iters=n, max_iters=9))


@pytest.mark.parametrize("batched", ["both", "rows", "order"])
def test_the_kernels_compose_with_vmap(monkeypatch, batched):
  # Mapped over arrays (or orders), the rows are merged into one launch, or
  # moved by XLA where the merged array is too large; nested maps too.
  maps, batch = 3, 128
  a = jnp.stack([_rows(jnp.bfloat16, batch, seed=s) for s in range(maps)])
  orders = jnp.stack([jax.random.permutation(jax.random.key(s), batch).astype(jnp.int32)
                      for s in range(maps)])
  axes = {"both": (0, 0), "rows": (0, None), "order": (None, 0)}[batched]
  args = (a if axes[0] == 0 else a[0], orders if axes[1] == 0 else orders[0])
  want_gather = jax.vmap(tiling.take_rows, in_axes=axes)(*args)
  gather = lambda x, o: kernel_tpu_rows.gather(x, o, interpret=INTERPRET)
  put_back = lambda x, o: kernel_tpu_rows.put_back(x, o, interpret=INTERPRET)
  np.testing.assert_array_equal(jax.vmap(gather, in_axes=axes)(*args), want_gather)
  np.testing.assert_array_equal(
      jax.vmap(put_back, in_axes=(0, axes[1]))(want_gather, args[1]),
      jnp.broadcast_to(args[0], want_gather.shape))
  if batched == "both":
    assert "pallas_loop_rows_gather" in _kernel_names(jax.vmap(gather), *args)
    nested = jax.vmap(jax.vmap(gather))(a[None], orders[None])
    np.testing.assert_array_equal(nested[0], want_gather)
    # The merged array over LARGEST_BYTES: XLA's gather, the same rows.
    monkeypatch.setattr(kernel_tpu_rows, "LARGEST_BYTES", batch * 128 * 4)
    assert "pallas_loop_rows_gather" not in _kernel_names(jax.vmap(gather), *args)
    np.testing.assert_array_equal(jax.vmap(gather)(*args), want_gather)
    np.testing.assert_array_equal(jax.vmap(put_back)(want_gather, orders), a)


def test_iterate_under_vmap_and_grad():
  # vmap over problems (each its own rows and counts) through the group
  # forward and backward, whose rows move by the kernels.
  step, params, h0, x = blocks.make("tanh_rnn", 128, 128, jnp.float32)
  n = jnp.stack([cases.counts("ragged", 128, seed=s) for s in (1, 2)])
  hs, xs = jnp.stack([h0, 0.5 * h0]), jnp.stack([x, -x])
  options = TPU_INTERPRET.replace(block_rows=16)
  kw = dict(max_iters=cases.MAX_ITERS)
  ours = lambda p, h, x_, k: pallas_loop.iterate(step, p, h, x_, iters=k, **kw, options=options)
  ref = lambda p, h, x_, k: reference.iterate(step, p, h, x_, iters=k, **kw)
  loss = lambda f: lambda p, h: jnp.sum(jax.vmap(f, in_axes=(None, 0, 0, 0))(p, h, xs, n) ** 2)
  got = jax.vmap(ours, in_axes=(None, 0, 0, 0))(params, hs, xs, n)
  oracle.assert_trees_close(got, jax.vmap(ref, in_axes=(None, 0, 0, 0))(params, hs, xs, n))
  oracle.assert_trees_close(jax.grad(loss(ours), argnums=(0, 1))(params, hs),
                            jax.grad(loss(ref), argnums=(0, 1))(params, hs), what="gradient")
