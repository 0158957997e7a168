"""Flax NNX and Equinox modules as blocks; closed-over arrays are differentiated.

Each library's tests skip (with the install command) when it is missing;
CI installs both (`pip install -e ".[test,flax,equinox]"`).
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop import testing
from tests import cases
from tests import oracle

B, D, HIDDEN, MAX_ITERS = 13, 16, 32, 5
IMPLS = {"xla": pallas_loop.Options(implementation="xla"),
         "pallas": pallas_loop.Options(implementation="pallas", interpret=True, block_rows=8)}
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _nnx():
  return pytest.importorskip("flax.nnx", reason="flax is not installed: pip install -e '.[flax]'")


def _eqx():
  return pytest.importorskip("equinox", reason="equinox is not installed: pip install -e '.[equinox]'")


def _load_example(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _inputs():
  k = jax.random.split(jax.random.key(3), 2)
  h0 = 0.5 * jax.random.normal(k[0], (B, D))
  x = jax.random.normal(k[1], (B, D))
  return h0, x, cases.counts("ragged", B, MAX_ITERS)


# ---------------------------------------------------------------- Flax NNX


@pytest.mark.parametrize("impl", list(IMPLS))
def test_flax_module_as_block_matches_reference(impl):
  nnx = _nnx()
  cell = _load_example("flax_block").ResidualCell(D, HIDDEN, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(cell, nnx.Param)
  step = lambda p, h, x: nnx.merge(graphdef, p)(h, x)
  h0, x, n = _inputs()
  testing.check_row_independence(step, params, h0, x)
  report = testing.check_against_reference(step, params, h0, x, iters=n,
                                           max_iters=MAX_ITERS, options=IMPLS[impl])
  # Forward, then one gradient per Param leaf (up/inp/down kernels and biases), h0 and x.
  grad_names = [c.name for c in report.comparisons if "params" in c.name]
  assert len(grad_names) == len(jax.tree.leaves(params)) == 5, grad_names
  assert any("'down'" in name and "'kernel'" in name for name in grad_names), grad_names


@pytest.mark.parametrize("impl", list(IMPLS))
def test_flax_closed_over_module_is_differentiated(impl):
  """nnx.grad of a loss whose step closes over the module (no split)."""
  nnx = _nnx()
  cell = _load_example("flax_block").ResidualCell(D, HIDDEN, rngs=nnx.Rngs(1))
  h0, x, n = _inputs()

  def loss(run, kw):
    def f(module):
      out = run(lambda p, h, x_: module(h, x_), None, h0, x, iters=n, max_iters=MAX_ITERS, **kw)
      return cases.tree_sum(jnp.sin(out))
    return f

  got = nnx.grad(loss(pallas_loop.iterate, {"options": IMPLS[impl]}))(cell)
  want = nnx.grad(loss(reference.iterate, {}))(cell)
  oracle.assert_trees_close(got, want, what="gradient w.r.t. a closed-over module")
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(got))


def test_flax_stateful_module_closed_over_raises():
  """A module that mutates its state in __call__ (Dropout's RNG counter) cannot
  be closed over: step is traced in its own trace, and Flax refuses the
  mutation with a TraceContextError (documented in the README, "Using Flax / Equinox modules")."""
  nnx = _nnx()
  from flax import errors

  class Noisy(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(D, D, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h, x):
      return jnp.tanh(self.drop(self.lin(h)) + x)

  h0, x, n = _inputs()
  module = Noisy(nnx.Rngs(0))
  with pytest.raises(errors.TraceContextError, match="Cannot mutate RngCount from a different trace level"):
    pallas_loop.iterate(lambda p, h, x_: module(h, x_), None, h0, x, iters=n,
                        max_iters=MAX_ITERS, options=pallas_loop.Options(implementation="xla"))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("example,library", [("flax_block", _nnx), ("equinox_block", _eqx)])
def test_module_example_trains(example, library, impl, capsys):
  library()
  assert _load_example(example).main(["--quick", "--implementation", impl]) == 0
  out = capsys.readouterr().out
  assert "max |grad - reference grad|" in out and "OK" in out


# ---------------------------------------------------------------- Flax linen


def _linen():
  return pytest.importorskip("flax.linen", reason="flax is not installed: pip install -e '.[flax]'")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_linen_module_as_block_matches_reference(impl):
  """A linen module, unbound (created outside any parent), applied in the step."""
  nn = _linen()
  cell = _load_example("flax_dropout").LinenCell(D, HIDDEN, rate=0.0)
  h0, x, n = _inputs()
  variables = cell.init(jax.random.key(0), h0[0], x[0], train=False)
  step = lambda v, h, x: cell.apply(v, h, x, train=False)   # rows: Dense acts on the last axis
  assert isinstance(cell, nn.Module) and cell.parent is None
  testing.check_against_reference(step, variables, h0, x, iters=n, max_iters=MAX_ITERS,
                                  options=IMPLS[impl])


@pytest.mark.parametrize("library", ["linen", "nnx"])
def test_flax_dropout_mask_is_the_rows_key_at_each_step(library):
  """Per example, the module's dropout RNG is row i's key at step t: the
  result equals an independent loop that applies the module to each row with
  `pallas_loop.random.step_keys(key, i, t)`."""
  _nnx()
  example = _load_example("flax_dropout")
  h0, x, n = _inputs()
  if library == "linen":
    cell = example.LinenCell(D, HIDDEN, rate=0.5)
    params = cell.init(jax.random.key(0), h0[0], x[0], train=False)
    step = example.linen_step(cell)
  else:
    graphdef, params = _nnx().split(example.NnxCell(D, HIDDEN, 0.5, rngs=_nnx().Rngs(0)),
                                    _nnx().Param)
    step = example.nnx_step(graphdef)
  key = jax.random.key(7)
  got = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=MAX_ITERS, key=key,
                            per_example=True, options=pallas_loop.Options(implementation="xla"))
  words = pallas_loop.random.key_data(key).reshape(1, 2)
  for i in range(B):
    h = h0[i]
    for t in range(int(n[i])):
      k = pallas_loop.random.step_keys(words, jnp.full((1, 1), i), jnp.full((1, 1), t))[0]
      h = step(params, h, x[i], k)
    np.testing.assert_allclose(got[i], h, rtol=1e-5, atol=1e-6)
  deterministic = pallas_loop.iterate(
      lambda p, h, x, key: step(p, h, x, key * 0), params, h0, x, iters=n, max_iters=MAX_ITERS,
      key=key, per_example=True, options=pallas_loop.Options(implementation="xla"))
  assert not np.allclose(got, deterministic)  # the masks differ across rows and steps


# ---------------------------------------------------------------- Equinox


@pytest.mark.parametrize("impl", list(IMPLS))
def test_equinox_module_as_block_matches_reference(impl):
  eqx = _eqx()
  cell = _load_example("equinox_block").ResidualCell(D, HIDDEN, key=jax.random.key(0))
  params, static = eqx.partition(cell, eqx.is_inexact_array)
  step = lambda p, h, x: eqx.combine(p, static)(h, x)
  h0, x, n = _inputs()
  testing.check_row_independence(step, params, h0, x)
  report = testing.check_against_reference(step, params, h0, x, iters=n,
                                           max_iters=MAX_ITERS, options=IMPLS[impl])
  grad_names = [c.name for c in report.comparisons if "params" in c.name]
  assert len(grad_names) == len(jax.tree.leaves(params)) == 5, grad_names
  assert "gradient w.r.t. params.down.weight" in grad_names, grad_names


@pytest.mark.parametrize("impl", list(IMPLS))
def test_equinox_closed_over_module_is_differentiated(impl):
  """eqx.filter_grad of a loss whose step closes over the module (no partition)."""
  eqx = _eqx()
  cell = _load_example("equinox_block").ResidualCell(D, HIDDEN, key=jax.random.key(1))
  h0, x, n = _inputs()

  def loss(run, kw):
    def f(module):
      out = run(lambda p, h, x_: module(h, x_), None, h0, x, iters=n, max_iters=MAX_ITERS, **kw)
      return cases.tree_sum(jnp.sin(out))
    return f

  got = eqx.filter_grad(loss(pallas_loop.iterate, {"options": IMPLS[impl]}))(cell)
  want = eqx.filter_grad(loss(reference.iterate, {}))(cell)
  oracle.assert_trees_close(got, want, what="gradient w.r.t. a closed-over module")
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(got))


# ---------------------------------------------------------------- plain closures


@pytest.mark.parametrize("impl", list(IMPLS))
def test_closed_over_array_is_differentiated(impl):
  """jax.grad w.r.t. an array the step closes over (step_fn.py hoists it into
  an operand of the custom_vjp), equal to autodiff through the reference; and
  the same array passed as params gives the same gradient."""
  h0, x, n = _inputs()
  w = jax.random.normal(jax.random.key(5), (D, D)) * 0.3

  def loss(run, kw, w):
    step = lambda p, h, x_: jnp.tanh(h @ w + x_)
    return cases.tree_sum(jnp.sin(run(step, None, h0, x, iters=n, max_iters=MAX_ITERS, **kw)))

  got = jax.grad(lambda w: loss(pallas_loop.iterate, {"options": IMPLS[impl]}, w))(w)
  want = jax.grad(lambda w: loss(reference.iterate, {}, w))(w)
  oracle.assert_trees_close(got, want, what="gradient w.r.t. a closed-over array")
  as_params = jax.grad(lambda w: cases.tree_sum(jnp.sin(pallas_loop.iterate(
      lambda p, h, x_: jnp.tanh(h @ p + x_), w, h0, x, iters=n, max_iters=MAX_ITERS,
      options=IMPLS[impl]))))(w)
  np.testing.assert_allclose(got, as_params, rtol=1e-6, atol=1e-6)
