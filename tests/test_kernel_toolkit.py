"""The kernels' shared toolkit (`kernel_toolkit.py`): named refs and the one launch."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import tree_util
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import kernel_toolkit as toolkit
from pallas_loop._src.kernels import schedule
from pallas_loop._src import tiling

# 10 rows in tiles of 4: 3 tiles, the last with 2 padding rows.
BATCH, BLOCK_ROWS = 10, 4
PADDED = tiling.padded_rows(BATCH, BLOCK_ROWS)
TILES = PADDED // BLOCK_ROWS


class _Ins(NamedTuple):
  w: Any       # [1, D], in w's structure (a dict): shared
  h: Any       # [TB, D], in h's structure (a tuple of two leaves)
  skip: Any    # None: a group with no leaves takes no ref


class _Outs(NamedTuple):
  y: Any       # list: [TB, D] rows, None at the leaf that is not computed
  total: Any   # f32 [1, D]: the tile's sum of y


_KINDS = (_Ins(w=schedule.SHARED, h=schedule.ROWS_IN, skip=schedule.SHARED),
          _Outs(y=schedule.ROWS_OUT, total=schedule.TILE))


def _body(ins: _Ins, outs: _Outs):
  """The groups arrive by name, in the structures they were launched with."""
  assert isinstance(ins, _Ins) and isinstance(outs, _Outs)
  assert ins.skip is None and outs.y[1] is None
  first, second = ins.h
  y = first[...] * ins.w["scale"][...] + second[...]
  outs.y[0][...] = y
  outs.total[...] = jnp.sum(y, axis=0, keepdims=True)[None]


def _launch(h, by_index=None):
  w = {"scale": jnp.arange(1.0, 9.0).reshape(1, 8)}
  outs = _Outs(y=[jax.ShapeDtypeStruct((PADDED, 8), jnp.float32), None],
               total=jax.ShapeDtypeStruct((TILES, 1, 8), jnp.float32))
  return toolkit.launch(_body, _Ins(w=w, h=h, skip=None), outs, _KINDS, block_rows=BLOCK_ROWS,
                        tiles=TILES, config=backend_lib.KernelConfig(block_rows=BLOCK_ROWS),
                        interpret=True, name="toolkit_test", by_index=by_index)


def test_both_launch_paths_agree_with_the_plain_computation():
  k = jax.random.split(jax.random.key(0), 2)
  h = tuple(jax.random.normal(ki, (BATCH, 8)) for ki in k)
  want = h[0] * jnp.arange(1.0, 9.0) + h[1]
  # One program per tile, on rows padded to whole tiles.
  padded = tuple(jnp.pad(a, ((0, PADDED - BATCH), (0, 0))) for a in h)
  blocked = _launch(padded)
  assert blocked.y[1] is None
  np.testing.assert_allclose(blocked.y[0][:BATCH], want, rtol=1e-6)
  np.testing.assert_allclose(  # the padding rows are 0: they add nothing
      blocked.total[:, 0], jnp.pad(want, ((0, PADDED - BATCH), (0, 0))).reshape(
          TILES, BLOCK_ROWS, 8).sum(axis=1), rtol=1e-5)
  # Rows read and written by index in the caller's order, on 2 programs.
  load, store = tiling.slot_rows(jnp.arange(BATCH, dtype=jnp.int32), PADDED, sort=True)
  indexed = _launch(h, by_index=toolkit.ByIndex(load, store, programs=2))
  np.testing.assert_allclose(indexed.y[0][:BATCH], want, rtol=1e-6)
  # The indexed tiles hold the rows in descending count order: the same
  # rows' sums as the blocked tiles of the reversed batch.
  order = np.asarray(tiling.descending_order(jnp.arange(BATCH, dtype=jnp.int32)))
  by_tile = jnp.pad(want[order], ((0, PADDED - BATCH), (0, 0)))
  # The padding positions of the indexed launch read the last sorted row.
  by_tile = by_tile.at[BATCH:].set(want[order[-1]])
  np.testing.assert_allclose(indexed.total[:, 0],
                             by_tile.reshape(TILES, BLOCK_ROWS, 8).sum(axis=1), rtol=1e-5)


def test_leaf_kinds_follow_the_flattened_order():
  ins = _Ins(w={"b": 1, "a": 2}, h=(3, 4), skip=None)
  kinds = toolkit.leaf_kinds(_KINDS[0], ins)
  assert kinds == [schedule.SHARED] * 2 + [schedule.ROWS_IN] * 2
  assert len(kinds) == len(tree_util.tree_leaves(ins))


def test_unflattened_checks_the_ref_count():
  tree = tree_util.tree_structure(_Ins(w=1, h=(2, 3), skip=None))
  kernel = toolkit.unflattened(lambda lead, ins: None, tree, leading=1)
  kernel("lead", 1, 2, 3)
  with pytest.raises(AssertionError):
    kernel("lead", 1, 2)


def test_unknown_kind_is_named():
  with pytest.raises(ValueError, match="unknown operand kind 'rows'"):
    toolkit.block_spec("rows", jax.ShapeDtypeStruct((8, 1), jnp.int32), 4)
