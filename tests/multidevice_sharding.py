"""Rows sharded over 8 simulated CPU devices: an absltest program.

The number of CPU devices is fixed when JAX initialises, so these checks
cannot run inside the pytest process (JAX is long initialised there).
`tests/test_sharding.py` runs this module as its own program,
`python -m tests.multidevice_sharding`, which asks for 8 CPU devices before
JAX starts (`setUpModule`). Run it directly the same way to debug one case:
`python -m tests.multidevice_sharding -k per_shard`.

Shapes are chosen so that the per-device arrays can be told apart from the
global ones in the compiled HLO: B = 48 rows, 6 per device on an 8-way row
axis, tiles of 4 rows (each shard pads 6 -> 8), state width 3.
"""

from __future__ import annotations

import functools
import re
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from tests import cases
from tests import hlo
from tests import oracle

B, D, MAX_ITERS = 48, 3, 5
DEVICES = 8
IMPLS = tuple(cases.IMPLEMENTATIONS)


def setUpModule():
  # Raises if JAX has already started with another device count (e.g. this
  # module collected inside pytest): only a fresh process can have 8.
  jax.config.update("jax_num_cpu_devices", DEVICES)
  assert jax.device_count() == DEVICES, jax.devices()


def _step(params, h, x):
  w, b = params
  return jnp.tanh(h @ w + x * b)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  w = jnp.asarray(rng.normal(size=(D, D)) * 0.6, jnp.float32)
  b = jnp.asarray(rng.normal(size=(D,)), jnp.float32)
  h0 = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
  return (w, b), h0, x, cases.counts("ragged", B, MAX_ITERS, seed)


def _loss(run, params, h0, x, n):
  out = run(_step, params, h0, x, iters=n, max_iters=MAX_ITERS)
  weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
  return jnp.sum(weights * out)


def _row_mesh():
  return jax.make_mesh((DEVICES,), ("rows",))


class ShardedRowsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # As tests/conftest.py does for the pytest suite: silent upcasts fail.
    self.enterContext(jax.numpy_dtype_promotion("strict"))

  @parameterized.parameters(*IMPLS)
  def test_forward_and_grads_match_reference_per_shard(self, impl):
    params, h0, x, n = _inputs()
    mesh = _row_mesh()
    rows = NamedSharding(mesh, P("rows"))
    s_h0, s_x, s_n = jax.device_put((h0, x, n), rows)
    run = functools.partial(pallas_loop.iterate,
                            options=cases.IMPLEMENTATIONS[impl].replace(block_rows=4))

    forward = jax.jit(lambda p, h, x_, n_: run(_step, p, h, x_, iters=n_, max_iters=MAX_ITERS))
    got = forward(params, s_h0, s_x, s_n)
    want = reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS)
    oracle.assert_trees_close(got, want)
    assert got.sharding.spec == P("rows", None), got.sharding

    text = forward.lower(params, s_h0, s_x, s_n).compile().as_text()
    assert hlo.collectives(text) == {}, hlo.collectives(text)
    # Each device holds and iterates its own 6 rows (padded to 8 for tiles of
    # 4); the global [48, 3] state never exists on a device.
    assert f"f32[{B // 8},{D}]" in text
    assert f"f32[{B},{D}]" not in text

    grads = jax.jit(jax.grad(functools.partial(_loss, run), argnums=(0, 1, 2)))
    g_params, g_h0, g_x = grads(params, s_h0, s_x, s_n)
    want_grads = jax.grad(functools.partial(_loss, reference.iterate), argnums=(0, 1, 2))(
        params, h0, x, n)
    oracle.assert_trees_close((g_params, g_h0, g_x), want_grads, what="gradients")
    assert g_h0.sharding.spec == P("rows", None) and g_x.sharding.spec == P("rows", None)

    text = grads.lower(params, s_h0, s_x, s_n).compile().as_text()
    found = hlo.collectives(text)
    # The only communication: the parameter gradients summed over the mesh
    # (one all-reduce; XLA may combine w's and b's into one tuple-shaped op).
    assert set(found) == {"all-reduce"}, found
    param_shapes = {f"f32[{D},{D}]", f"f32[{D}]"}
    for line in found["all-reduce"]:
      shapes = set(re.findall(r"f32\[[\d,]*\]", line.split(" all-reduce")[0]))
      assert shapes and shapes <= param_shapes, line
    assert f"f32[{B},{D}]" not in text

  def test_two_axis_mesh_rows_on_data_with_info_and_halting(self):
    # Rows over "data" (4 ways), replicated over "model" (2 ways), the mesh set
    # as context; the state is a pytree whose leaf "b" also splits its feature
    # axis over "model" (gathered for the loop, split again on the way out);
    # iters a scalar, halting on, IterateInfo returned.
    params, h0, x, n = _inputs(1)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = {"a": h0, "b": h0[:, :2] * 2}
    step = lambda p, h, x_: {"a": _step(p, h["a"], x_), "b": jnp.cos(h["b"]) * p[1][:2]}
    kw = dict(iters=4, max_iters=MAX_ITERS, tol=0.05, min_iters=1, return_info=True)
    s_state = {"a": jax.device_put(state["a"], NamedSharding(mesh, P("data"))),
               "b": jax.device_put(state["b"], NamedSharding(mesh, P("data", "model")))}
    s_x = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
      got, info = jax.jit(lambda p, h, x_: pallas_loop.iterate(
          step, p, h, x_, **kw,
          options=pallas_loop.Options(implementation="pallas", interpret=True, block_rows=4)))(
              params, s_state, s_x)
    want, want_info = reference.iterate(step, params, state, x, **kw)
    oracle.assert_trees_close(got, want)
    np.testing.assert_array_equal(info.steps, want_info.steps)
    np.testing.assert_array_equal(info.halted, want_info.halted)
    assert {k: v.sharding.spec for k, v in got.items()} == {"a": P("data", None),
                                                             "b": P("data", "model")}
    assert info.steps.sharding.spec == P("data")

  def test_rows_over_both_axes_of_a_two_axis_mesh(self):
    # Rows split over ("data", "model") = 8 ways.
    params, h0, x, n = _inputs(2)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rows = NamedSharding(mesh, P(("data", "model")))
    s_h0, s_x, s_n = jax.device_put((h0, x, n), rows)
    f = jax.jit(lambda p, h, x_, n_: pallas_loop.iterate(
        _step, p, h, x_, iters=n_, max_iters=MAX_ITERS,
        options=pallas_loop.Options(implementation="xla")))
    got = f(params, s_h0, s_x, s_n)
    oracle.assert_trees_close(
        got, reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS))
    assert got.sharding.spec == P(("data", "model"), None)
    assert hlo.collectives(f.lower(params, s_h0, s_x, s_n).compile().as_text()) == {}

  def test_vmap_over_an_unsharded_axis_keeps_rows_per_shard(self):
    params, h0, x, n = _inputs(3)
    mesh = _row_mesh()
    stacked = jnp.stack([h0, -h0])  # [2, B, D]: vmapped axis 0, rows on axis 1
    s_stacked = jax.device_put(stacked, NamedSharding(mesh, P(None, "rows")))
    s_x, s_n = jax.device_put((x, n), NamedSharding(mesh, P("rows")))

    def one(h, x_, n_):
      return pallas_loop.iterate(_step, params, h, x_, iters=n_, max_iters=MAX_ITERS,
                                 options=pallas_loop.Options(implementation="pallas",
                                                             interpret=True, block_rows=4))

    f = jax.jit(jax.vmap(one, in_axes=(0, None, None)))
    got = f(s_stacked, s_x, s_n)
    want = jax.vmap(lambda h: reference.iterate(_step, params, h, x, iters=n,
                                                max_iters=MAX_ITERS))(stacked)
    oracle.assert_trees_close(got, want)
    assert got.sharding.spec == P(None, "rows", None)
    assert hlo.collectives(f.lower(s_stacked, s_x, s_n).compile().as_text()) == {}

  def test_replicated_inputs_on_a_mesh_run_unsharded(self):
    params, h0, x, n = _inputs(4)
    mesh = _row_mesh()
    s_h0 = jax.device_put(h0, NamedSharding(mesh, P()))
    got = jax.jit(lambda h: pallas_loop.iterate(
        _step, params, h, x, iters=n, max_iters=MAX_ITERS))(s_h0)
    oracle.assert_trees_close(
        got, reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS))
    assert got.sharding.spec == P(None, None)

  def test_rows_sharded_through_x_only_stay_sharded(self):
    # h0 replicated, x split by rows: each device slices its rows of h0
    # locally and the output keeps the rows split (no gather back).
    params, h0, x, n = _inputs(9)
    mesh = _row_mesh()
    s_h0 = jax.device_put(h0, NamedSharding(mesh, P()))
    s_x = jax.device_put(x, NamedSharding(mesh, P("rows")))
    f = jax.jit(lambda h, x_: pallas_loop.iterate(
        _step, params, h, x_, iters=n, max_iters=MAX_ITERS,
        options=pallas_loop.Options(implementation="xla")))
    got = f(s_h0, s_x)
    oracle.assert_trees_close(
        got, reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS))
    assert got.sharding.spec == P("rows", None)
    assert hlo.collectives(f.lower(s_h0, s_x).compile().as_text()) == {}

  def test_auto_axes_warn_and_explicit_axes_is_the_way_out(self):
    params, h0, x, n = _inputs(5)
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("rows"))
    s_h0, s_x, s_n = jax.device_put((h0, x, n), rows)
    call = lambda h, x_, n_: pallas_loop.iterate(
        _step, params, h, x_, iters=n_, max_iters=MAX_ITERS,
        options=pallas_loop.Options(implementation="pallas", interpret=True, block_rows=4))
    with self.assertWarnsRegex(UserWarning, r"Auto axes .*explicit_axes"):
      jax.jit(call).lower(s_h0, s_x, s_n)

    explicit = jax.sharding.explicit_axes(call, axes="rows", in_sharding=P("rows"))
    with jax.set_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("error")
      f = jax.jit(explicit)
      got = f(s_h0, s_x, s_n)
      text = f.lower(s_h0, s_x, s_n).compile().as_text()
    oracle.assert_trees_close(
        got, reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS))
    assert hlo.collectives(text) == {}, hlo.collectives(text)

  def test_auto_axes_xla_implementation_warns_and_is_correct(self):
    """With Auto axes the XLA loop cannot be split by rows either (it orders the
    rows by count across the batch): iterate says so once; results are right."""
    params, h0, x, n = _inputs(6)
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Auto,))
    s_h0, s_x, s_n = jax.device_put((h0, x, n), NamedSharding(mesh, P("rows")))
    f = jax.jit(lambda h, x_, n_: pallas_loop.iterate(
        _step, params, h, x_, iters=n_, max_iters=MAX_ITERS,
        options=pallas_loop.Options(implementation="xla")))
    pallas_loop._src.notices._warned.clear()
    with self.assertWarnsRegex(UserWarning, "Auto axes.*XLA implementation.*every device"):
      got = f(s_h0, s_x, s_n)
    oracle.assert_trees_close(
        got, reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS))

  def test_grads_on_two_axis_mesh_rows_on_one_axis(self):
    # Rows over "data"; the "model" devices of a data shard repeat its work.
    # Their cotangents are summed over "model" (an all-reduce of this shard's
    # h0/x cotangent: see docs/sharding.md, Limits); nothing is gathered.
    params, h0, x, n = _inputs(7)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    s_h0, s_x, s_n = jax.device_put((h0, x, n), NamedSharding(mesh, P("data")))
    run = functools.partial(pallas_loop.iterate,
                            options=pallas_loop.Options(implementation="pallas", interpret=True,
                                                        block_rows=4))
    grads = jax.jit(jax.grad(functools.partial(_loss, run), argnums=(0, 1, 2)))
    got = grads(params, s_h0, s_x, s_n)
    want = jax.grad(functools.partial(_loss, reference.iterate), argnums=(0, 1, 2))(
        params, h0, x, n)
    oracle.assert_trees_close(got, want, what="gradients")
    assert got[1].sharding.spec == P("data", None)
    found = hlo.collectives(grads.lower(params, s_h0, s_x, s_n).compile().as_text())
    assert set(found) == {"all-reduce"}, found

  def test_eager_call_with_a_numpy_input(self):
    # Outside jit the real mesh is used; x, a NumPy array, is split like h0.
    params, h0, x, n = _inputs(8)
    mesh = _row_mesh()
    rows = NamedSharding(mesh, P("rows"))
    got = pallas_loop.iterate(_step, params, jax.device_put(h0, rows), np.asarray(x),
                              iters=n, max_iters=MAX_ITERS,
                              options=pallas_loop.Options(implementation="pallas", interpret=True,
                                                          block_rows=4))
    oracle.assert_trees_close(
        got, reference.iterate(_step, params, h0, x, iters=n, max_iters=MAX_ITERS))
    assert got.sharding.is_equivalent_to(rows, got.ndim), got.sharding

  @parameterized.product(impl=["xla", "pallas"],
                          mode=[pallas_loop.Truncated(2), pallas_loop.Phantom(2)])
  def test_gradient_modes_and_keys_per_shard(self, impl, mode):
    """Other gradient modes and per-row keys: row i keeps its batch index's key
    (the global index, not the index within its shard)."""
    params, h0, x, n = _inputs(2)
    rows = NamedSharding(_row_mesh(), P("rows"))
    s_h0, s_x, s_n = jax.device_put((h0, x, n), rows)
    key = jax.random.key(3)
    step = lambda p, h, x_, key: _step(p, h, x_) + 0.1 * pallas_loop.random.normal(key, h.shape)
    run = functools.partial(pallas_loop.iterate,
                            options=cases.IMPLEMENTATIONS[impl].replace(block_rows=4))

    def loss(run_, p, h, x_, n_, **kw):
      out = run_(step, p, h, x_, iters=n_, max_iters=MAX_ITERS, key=key, grad=mode, **kw)
      return jnp.sum(jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape) * out)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, run), argnums=(0, 1, 2)))(
        params, s_h0, s_x, s_n)
    xla = pallas_loop.Options(implementation="xla")
    want = jax.value_and_grad(functools.partial(loss, pallas_loop.iterate, options=xla),
                              argnums=(0, 1, 2))(params, h0, x, n)
    oracle.assert_trees_close(got, want, what="value and gradients")


if __name__ == "__main__":
  absltest.main()
