"""The kernels' schedules and rows read by index (`schedule.py`, `tiling.slot_rows`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop._src.kernels import backend_interpret
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src.kernels import backend_triton
from pallas_loop._src.kernels import schedule
from pallas_loop._src import tiling
from benchmarks import blocks
from tests import lowering
from tests import oracle

# 60 rows in tiles of 8: 8 tiles (the last padded with 4 rows) on 3
# programs, which do not divide them.
BATCH, BLOCK_ROWS, PROGRAMS, MAX_ITERS = 60, 8, 3, 9


@pytest.mark.parametrize("programs,tiles", [(3, 8), (1, 5), (5, 5), (7, 3), (132, 256)])
def test_every_tile_runs_once_longest_first(programs, tiles):
  runs = [schedule.tiles_of_program(p, programs, tiles) for p in range(programs)]
  assert sorted(t for r in runs for t in r) == list(range(tiles))
  for p, r in enumerate(runs):
    assert r == sorted(r) and len(r) == int(schedule.trips(p, programs, tiles))
    if p < tiles:  # the P longest tiles start together, one per program
      assert r[0] == p
  # The k-th round runs tiles kP .. kP + P - 1: never a longer one after a shorter.
  assert [t for k in range(max(map(len, runs))) for r in runs if k < len(r)
          for t in [r[k]]] == list(range(tiles))


def test_program_count_rule():
  assert schedule.programs_per_sm(8) == 1 and schedule.programs_per_sm(4) == 2
  assert schedule.programs(132, 8, 256) == 132
  assert schedule.programs(132, 4, 256) == 256
  assert schedule.programs(132, 8, 40) == 40
  assert backend_triton.gpu("NVIDIA H200").sms == 132
  assert backend_triton.gpu("NVIDIA H20").sms == 78
  assert backend_triton.gpu("NVIDIA H100 PCIe").sms == 114
  assert backend_triton.gpu("NVIDIA B200").sms == 148


def test_program_count_reads_the_device_kind():
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=lowering.AbstractDevice(
      device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    assert backend_triton.persistent_programs(None, 1000) == 132


def test_default_schedule_is_the_grid():
  assert schedule.resolve(backend_triton.TRITON, None) == "grid"
  assert schedule.resolve(backend_triton.TRITON, "persistent") == "persistent"
  assert schedule.resolve(backend_mosaic_tpu.MOSAIC_TPU, "persistent") == "grid"
  assert schedule.resolve(backend_interpret.for_option(True), "persistent") == "persistent"
  assert schedule.resolve(backend_interpret.for_option("gpu"), "persistent") == "persistent"
  with pytest.raises(ValueError, match="schedule"):
    pallas_loop.iterate(lambda p, h, x: h, None, jnp.ones((2, 2)), max_iters=1,
                        options=pallas_loop.Options(schedule="round_robin"))


def test_slot_rows():
  counts = jnp.array([2, 5, 0, 5, 1], jnp.int32)
  load, store = tiling.slot_rows(counts, 8, sort=True)
  np.testing.assert_array_equal(load, [1, 3, 0, 4, 2, 2, 2, 2])
  np.testing.assert_array_equal(store, [1, 3, 0, 4, 2, 5, 6, 7])
  load, store = tiling.slot_rows(counts, 5, sort=False)
  np.testing.assert_array_equal(load, np.arange(5))
  np.testing.assert_array_equal(store, np.arange(5))


def _grids(fn, *args):
  """The grids of the pallas_calls in `fn`'s jaxpr."""
  grids = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        name = str(eqn.params["name"])
        kind = next(k for k in ("iterate_fwd", "iterate_bwd") if k in name)
        grids.append((kind, eqn.params["grid_mapping"].grid))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return grids


@pytest.fixture
def three_programs(monkeypatch):
  # Interpret mode's persistent grid: one program an SM, at most the tiles.
  monkeypatch.setattr(backend_interpret, "INTERPRET_SMS", PROGRAMS)


def _problem(dtype=jnp.float32):
  step, params, h0, x = blocks.make("tanh_rnn", BATCH, 16, dtype)
  n = jnp.asarray(np.random.default_rng(0).integers(0, MAX_ITERS + 1, BATCH), jnp.int32)
  return step, params, h0, x, n


@pytest.mark.parametrize("sched", ["persistent", "grid"])
@pytest.mark.parametrize("sort_rows", [True, False])
def test_forward_matches_reference(three_programs, sched, sort_rows):
  step, params, h0, x, n = _problem()
  run = functools.partial(pallas_loop.iterate,
                          iters=n, max_iters=MAX_ITERS, return_info=True,
                          options=pallas_loop.Options(implementation="pallas", interpret=True,
                                                      block_rows=BLOCK_ROWS, schedule=sched,
                                                      sort_rows=sort_rows))
  tiles = -(-BATCH // BLOCK_ROWS)
  assert _grids(lambda p: run(step, p, h0, x), params) == [
      ("iterate_fwd", (PROGRAMS if sched == "persistent" else tiles,))]
  got, info = run(step, params, h0, x)
  want, want_f32 = oracle.reference_pair(step, params, h0, x, iters=n, max_iters=MAX_ITERS)
  oracle.assert_trees_close(got, want, want_f32)
  np.testing.assert_array_equal(info.steps, n)


def test_gradients_match_reference(three_programs):
  step, params, h0, x, n = _problem()
  run = functools.partial(pallas_loop.iterate,
                          options=pallas_loop.Options(implementation="pallas", interpret=True,
                                                      block_rows=BLOCK_ROWS, schedule="persistent"))

  def loss(iterate, p, h, x_):
    return jnp.sum(jnp.tanh(iterate(step, p, h, x_, iters=n, max_iters=MAX_ITERS)))

  grads = lambda p, h, x_: jax.grad(functools.partial(loss, run), argnums=(0, 1, 2))(p, h, x_)
  assert sorted(_grids(grads, params, h0, x)) == [
      ("iterate_bwd", (PROGRAMS,)), ("iterate_fwd", (PROGRAMS,))]
  got = grads(params, h0, x)
  want = jax.grad(functools.partial(loss, reference.iterate), argnums=(0, 1, 2))(params, h0, x)
  oracle.assert_trees_close(got, want, what="gradient")


def test_persistent_kernel_lowers_for_the_gpu():
  """The persistent forward and backward lower for an H200 (Triton), with
  their rows read by index: no sort of rows and no scatter around them."""
  step, params, h0, x = blocks.make("tanh_rnn", 256, 128, jnp.bfloat16)
  n = jnp.arange(256, dtype=jnp.int32) % 17

  def loss(p, h, x_):
    out = pallas_loop.iterate(step, p, h, x_, iters=n, max_iters=16,
                              options=pallas_loop.Options(implementation="pallas", interpret=False,
                                                          schedule="persistent"))
    return jnp.sum(out.astype(jnp.float32))

  text = lowering.export_text(jax.grad(loss, argnums=(0, 1, 2)), params, h0, x,
                              platform="cuda")
  assert text.count(lowering.kernel_marker("cuda")) == 2
  assert "stablehlo.scatter" not in text
