"""Rows sharded over the devices of several processes: one process's program.

`tests/test_multiprocess.py` starts this absltest program twice on this
machine, as two JAX processes of one distributed system:

    python -m tests.multiprocess_sharding --process_id=0 --num_processes=2 \\
        --coordinator=127.0.0.1:PORT &
    python -m tests.multiprocess_sharding --process_id=1 --num_processes=2 \\
        --coordinator=127.0.0.1:PORT

(PORT: any free TCP port.) Each process asks for 4 CPU devices before JAX
starts (`setUpModule`), joins the others through `jax.distributed.initialize`
(process 0 runs the coordinator, bound to the loopback address), and uses
Gloo for the collectives between processes, over loopback only. The 8
devices of the 2 processes form one global mesh; every test runs the same
computations in the same order in every process (a collective waits for all
of them), builds the global arrays from each process's own rows
(`jax.make_array_from_process_local_data`, as a multi-host user would), and
checks what this process can see: its own shards of the sharded results and
the replicated parameter gradients, against `pallas_loop._reference.iterate`
computed unsharded in this process, and against `iterate` itself run
unsharded on one device of this process.

The parameter gradient is the one value that crosses processes: an
all-reduce over the 8 devices, of which 4 are in the other process.

`--timeout_s` bounds a process: past it, faulthandler prints every thread's
stack and the process exits (a peer that died leaves the others waiting in a
collective; the launcher also kills them).

Shapes: B = 48 rows, 6 per device on an 8-way row axis, 24 per process;
tiles of 4 rows; state width 3 (as in tests/multidevice_sharding.py).
"""

from __future__ import annotations

import faulthandler
import functools
import os

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from tests import cases
from tests import hlo
from tests import oracle

_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (0 runs the "
                                   "coordinator).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Number of processes.")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of the coordinator, e.g. "
                                   "127.0.0.1:12345 (process 0 binds it).")
_LOCAL_DEVICES = flags.DEFINE_integer("local_devices", 4, "CPU devices per process.")
_TIMEOUT_S = flags.DEFINE_integer("timeout_s", 300, "Seconds before this process dumps its "
                                  "stacks and exits.")
_CRASH_AFTER_INIT = flags.DEFINE_bool(
    "crash_after_init", False, "Exit with status 3 right after joining the others (tests "
    "that the launcher stops the peers left waiting).")

B, D, MAX_ITERS = 48, 3, 5
# The implementations held to the reference. The kernel in TPU interpret
# mode is left out: see docs/sharding.md, "Several hosts".
IMPLS = ("xla", "pallas")


def _loopback_cpu_collectives() -> None:
  """Makes the CPU backend's Gloo collectives listen on 127.0.0.1 only.

  Left to itself, Gloo chooses the address it listens on (on the machine
  this was written on, the host name's address, which was 127.0.0.1; on
  another, possibly a public interface). JAX 0.11 has no public option for
  it, so this replaces the CPU backend factory (before any backend
  exists) with one that passes `hostname="127.0.0.1"` to JAX's own Gloo TCP
  collectives. Test-only: real multi-host runs keep the default.
  """
  from jax._src import distributed
  from jax._src import xla_bridge
  from jax._src.lib import _jax

  def make_client():
    gloo = _jax.make_gloo_tcp_collectives(
        distributed_client=distributed.global_state.client, hostname="127.0.0.1")
    return xla_bridge.make_cpu_client(collectives=gloo)

  xla_bridge.register_backend_factory("cpu", make_client, priority=0, fail_quietly=False)


def setUpModule():
  faulthandler.dump_traceback_later(_TIMEOUT_S.value, exit=True)
  if _PROCESS_ID.value is None or _COORDINATOR.value is None:
    raise SystemExit("pass --process_id and --coordinator (see the module doc)")
  # Raises if JAX has already started (e.g. this module imported inside
  # pytest): only a fresh process can set its device count.
  jax.config.update("jax_num_cpu_devices", _LOCAL_DEVICES.value)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  _loopback_cpu_collectives()
  port = _COORDINATOR.value.rsplit(":", 1)[1]
  jax.distributed.initialize(
      coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value, coordinator_bind_address=f"127.0.0.1:{port}",
      initialization_timeout=60, heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  assert jax.process_count() == _NUM_PROCESSES.value, jax.process_count()
  assert jax.local_device_count() == _LOCAL_DEVICES.value, jax.local_devices()
  assert jax.device_count() == _NUM_PROCESSES.value * _LOCAL_DEVICES.value, jax.devices()
  if _CRASH_AFTER_INIT.value:
    print(f"process {_PROCESS_ID.value}: crashing on purpose (--crash_after_init)", flush=True)
    os._exit(3)


def tearDownModule():
  faulthandler.cancel_dump_traceback_later()


def _step(params, h, x):
  w, b = params
  return jnp.tanh(h @ w + x * b)


def _inputs(seed=0):
  """The global batch, as NumPy arrays: identical in every process."""
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(D, D)).astype(np.float32) * np.float32(0.6)
  b = rng.normal(size=(D,)).astype(np.float32)
  h0 = rng.normal(size=(B, D)).astype(np.float32)
  x = rng.normal(size=(B, D)).astype(np.float32)
  return (w, b), h0, x, np.asarray(cases.counts("ragged", B, MAX_ITERS, seed))


def _local_rows(sharding: NamedSharding, rows: int) -> slice:
  """The rows of a [rows, ...] array that this process's devices hold."""
  # As docs/sharding.md's `my_rows`, checking that the rows form one block.
  spans = [index[0].indices(rows)
           for index in sharding.addressable_devices_indices_map((rows,)).values()]
  starts, stops = {s[0] for s in spans}, {s[1] for s in spans}
  assert stops - starts == {max(stops)}, spans  # one block, no gaps
  return slice(min(starts), max(stops))


def _global(sharding: NamedSharding, *arrays: np.ndarray):
  """Global arrays assembled from this process's rows of each of `arrays`."""
  mine = _local_rows(sharding, arrays[0].shape[0])
  return tuple(jax.make_array_from_process_local_data(sharding, a[mine], a.shape)
               for a in arrays)


def _assert_shards_close(got: jax.Array, want: np.ndarray, what: str) -> None:
  """Every shard of `got` this process holds equals its slice of `want`."""
  assert got.shape == want.shape, (what, got.shape, want.shape)
  shards = got.addressable_shards
  assert len(shards) == jax.local_device_count(), (what, len(shards))
  for shard in shards:
    oracle.assert_trees_close(shard.data, jnp.asarray(want[shard.index]),
                              what=f"{what} rows {shard.index[0]}")


def _loss(run, params, h0, x, n):
  out = run(_step, params, h0, x, iters=n, max_iters=MAX_ITERS)
  weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
  return jnp.sum(weights * out)


class ShardedOverProcessesTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # As tests/conftest.py does for the pytest suite: silent upcasts fail.
    self.enterContext(jax.numpy_dtype_promotion("strict"))

  @parameterized.named_parameters((impl, impl) for impl in IMPLS)
  def test_forward_and_grads_match_one_process(self, impl):
    params, h0, x, n = _inputs()
    mesh = jax.make_mesh((jax.device_count(),), ("rows",))
    rows = NamedSharding(mesh, P("rows"))
    g_h0, g_x, g_n = _global(rows, h0, x, n)
    assert not g_h0.is_fully_addressable  # the other process holds half the rows
    g_params = jax.device_put(params, NamedSharding(mesh, P()))
    run = functools.partial(pallas_loop.iterate,
                            options=cases.IMPLEMENTATIONS[impl].replace(block_rows=4))

    forward = jax.jit(lambda p, h, x_, n_: run(_step, p, h, x_, iters=n_, max_iters=MAX_ITERS))
    got = forward(g_params, g_h0, g_x, g_n)
    want = jax.jit(lambda p, h, x_, n_: reference.iterate(
        _step, p, h, x_, iters=n_, max_iters=MAX_ITERS))(params, h0, x, n)
    alone = forward(params, h0, x, n)  # NumPy inputs: one device of this process, unsharded
    oracle.assert_trees_close(alone, want)
    _assert_shards_close(got, np.asarray(alone), "forward")
    assert got.sharding.spec == P("rows", None), got.sharding
    text = forward.lower(g_params, g_h0, g_x, g_n).compile().as_text()
    assert hlo.collectives(text) == {}, hlo.collectives(text)
    assert f"f32[{B},{D}]" not in text  # no device ever holds the whole state

    grads = jax.jit(jax.grad(functools.partial(_loss, run), argnums=(0, 1, 2)))
    got_p, got_h0, got_x = grads(g_params, g_h0, g_x, g_n)
    want_p, want_h0, want_x = jax.jit(jax.grad(functools.partial(_loss, reference.iterate),
                                               argnums=(0, 1, 2)))(params, h0, x, n)
    alone_grads = grads(params, h0, x, n)
    oracle.assert_trees_close(alone_grads, (want_p, want_h0, want_x), what="gradients")
    # The parameter gradients were summed over all 8 devices (both
    # processes) and are replicated: every process holds the whole value.
    assert all(g.is_fully_replicated for g in got_p)
    oracle.assert_trees_close(tuple(np.asarray(g) for g in got_p), alone_grads[0],
                              what="parameter gradients")
    _assert_shards_close(got_h0, np.asarray(alone_grads[1]), "h0 gradient")
    _assert_shards_close(got_x, np.asarray(alone_grads[2]), "x gradient")
    assert got_h0.sharding.spec == P("rows", None) and got_x.sharding.spec == P("rows", None)
    # The one collective: the parameter gradients' all-reduce over the 8
    # devices. That it spans both processes is what makes got_p equal the
    # whole batch's gradient above (a per-process sum would miss half the rows).
    found = hlo.collectives(grads.lower(g_params, g_h0, g_x, g_n).compile().as_text())
    assert set(found) == {"all-reduce"}, found

  def test_keys_truncated_gradient_halting_and_info(self):
    """Per-row keys follow a row's index in the global batch, not in its
    process or device; a Truncated gradient, tol halting and IterateInfo
    come out as in one process."""
    params, h0, x, n = _inputs(1)
    mesh = jax.make_mesh((jax.device_count(),), ("rows",))
    rows = NamedSharding(mesh, P("rows"))
    g_h0, g_x, g_n = _global(rows, h0, x, n)
    key = jax.random.key(3)
    # `key` by name: iterate passes it by keyword (a 4th positional argument
    # before pallas_loop 0.2); this signature takes either.
    step = lambda p, h, x_, key: _step(p, h, x_) + 0.1 * pallas_loop.random.normal(key, h.shape)
    kw = dict(max_iters=MAX_ITERS, key=key, grad=pallas_loop.Truncated(2), tol=0.3,
              min_iters=1, return_info=True, options=pallas_loop.Options(implementation="xla"))

    def loss(p, h, x_, n_):
      out, info = pallas_loop.iterate(step, p, h, x_, iters=n_, **kw)
      weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
      return jnp.sum(weights * out), (out, info)

    f = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (value, (out, info)), (g_p, g_h, g_xx) = jax.jit(f)(
        jax.device_put(params, NamedSharding(mesh, P())), g_h0, g_x, g_n)
    (want_value, (want_out, want_info)), want_grads = jax.jit(f)(params, h0, x, n)
    assert np.any(np.asarray(want_info.halted)) and not np.all(np.asarray(want_info.halted))
    oracle.assert_trees_close(np.asarray(value), np.asarray(want_value), what="loss")
    _assert_shards_close(out, np.asarray(want_out), "forward")
    for field in ("steps", "halted", "residual"):
      _assert_shards_close(getattr(info, field), np.asarray(getattr(want_info, field)), field)
    # Every process can also fetch the whole result (an all-gather over processes).
    np.testing.assert_array_equal(multihost_utils.process_allgather(info.steps, tiled=True),
                                  want_info.steps)
    oracle.assert_trees_close(tuple(np.asarray(g) for g in g_p), want_grads[0],
                              what="parameter gradients")
    _assert_shards_close(g_h, np.asarray(want_grads[1]), "h0 gradient")
    _assert_shards_close(g_xx, np.asarray(want_grads[2]), "x gradient")

  def test_two_axis_mesh_hosts_by_local_devices(self):
    """A (processes, local devices) mesh, rows split over both axes (8 ways);
    the kernel in interpret mode, outside jit (eager, also with NumPy x and
    counts) and under jit."""
    params, h0, x, n = _inputs(2)
    mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("hosts", "local"))
    # Each process's devices are one row of the mesh: "hosts" crosses processes.
    for i, row in enumerate(mesh.devices):
      assert {d.process_index for d in row} == {i}, mesh.devices
    rows = NamedSharding(mesh, P(("hosts", "local")))
    g_h0, g_x, g_n = _global(rows, h0, x, n)
    run = lambda p, h, x_, n_: pallas_loop.iterate(
        _step, p, h, x_, iters=n_, max_iters=MAX_ITERS,
        options=pallas_loop.Options(implementation="pallas", interpret=True, block_rows=4))
    want = jax.jit(lambda p, h, x_, n_: reference.iterate(
        _step, p, h, x_, iters=n_, max_iters=MAX_ITERS))(params, h0, x, n)
    with jax.set_mesh(mesh):
      eager = run(params, g_h0, g_x, g_n)
      jitted = jax.jit(run)(params, g_h0, g_x, g_n)
      # x and the counts as NumPy arrays of the whole batch (the same in
      # every process): each device takes its own rows of them.
      eager_numpy = run(params, g_h0, x, n)
    for got in (eager, jitted, eager_numpy):
      _assert_shards_close(got, np.asarray(want), "forward")
      assert got.sharding.is_equivalent_to(rows, got.ndim), got.sharding


if __name__ == "__main__":
  absltest.main()
