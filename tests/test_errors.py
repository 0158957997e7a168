"""Bad input fails at trace time with an error naming the argument and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop

STEP = lambda params, h, x: h * 0.5
H0 = jnp.ones((4, 8))


def _call(**overrides):
  kw = dict(step=STEP, params=None, h0=H0, x=None, iters=2, max_iters=3)
  kw.update(overrides)
  step, params, h0, x = kw.pop("step"), kw.pop("params"), kw.pop("h0"), kw.pop("x")
  return pallas_loop.iterate(step, params, h0, x, **kw)


@pytest.mark.parametrize("iters,error,match", [
    (jnp.ones((3,), jnp.int32), ValueError, r"iters.shape=\(3,\) must be \(\) or \(4,\)"),
    (jnp.ones((4, 1), jnp.int32), ValueError, r"must be \(\) or \(4,\): one count per row"),
    (jnp.ones((4,), jnp.float32), TypeError, r"iters has dtype float32.*integer count"),
    (2.0, TypeError, r"integer count"),
    (True, TypeError, r"iters must be an int"),
])
def test_bad_iters(iters, error, match):
  with pytest.raises(error, match=match):
    _call(iters=iters)


@pytest.mark.parametrize("max_iters,error,match", [
    (-1, ValueError, r"max_iters=-1 must be >= 0"),
    (3.0, TypeError, r"max_iters must be a static Python int"),
    (jnp.int32(3), TypeError, r"not an array"),
    (True, TypeError, r"static Python int"),
])
def test_bad_max_iters(max_iters, error, match):
  with pytest.raises(error, match=match):
    _call(max_iters=max_iters)


def test_traced_max_iters():
  with pytest.raises(TypeError, match="static Python int"):
    jax.jit(lambda m: _call(max_iters=m))(3)


def test_rows_differ_between_leaves():
  with pytest.raises(ValueError, match=r"same number of rows.*h0\[0\]: 4.*h0\[1\]: 5"):
    _call(h0=(jnp.ones((4, 8)), jnp.ones((5, 8))), step=lambda p, h, x: h)
  with pytest.raises(ValueError, match=r"same number of rows.*x: 6"):
    _call(x=jnp.ones((6, 8)))


def test_leaf_without_row_axis():
  with pytest.raises(ValueError, match=r"h0 has shape \(\).*leading row axis"):
    _call(h0=jnp.float32(1.0))


def test_empty_state():
  with pytest.raises(ValueError, match="at least one array"):
    _call(h0=())


def test_step_not_callable():
  with pytest.raises(TypeError, match="step must be callable"):
    _call(step="tanh")


def test_step_returns_another_structure():
  with pytest.raises(TypeError, match="pytree structure of h0"):
    _call(step=lambda p, h, x: (h, h))


def test_step_returns_another_shape_names_the_leaf():
  h0 = {"a": jnp.ones((4, 8)), "b": jnp.ones((4, 3))}
  step = lambda p, h, x: {"a": h["a"], "b": jnp.ones((4, 5))}
  with pytest.raises(TypeError, match=r"float32\[4, 5\] for the state leaf h\['b'\], which is float32\[4, 3\]"):
    _call(h0=h0, step=step)


def test_step_returns_another_dtype():
  with pytest.raises(TypeError, match=r"bfloat16\[4, 8\].*which is float32\[4, 8\].*astype"):
    _call(step=lambda p, h, x: h.astype(jnp.bfloat16))


@pytest.mark.parametrize("kw,error,match", [
    (dict(implementation="triton"), ValueError, "implementation='triton' must be one of"),
    (dict(grad="implicit"), ValueError, "grad must be 'full', pallas_loop.Full"),
    (dict(block_rows=0), ValueError, "block_rows=0 must be a positive int"),
    (dict(block_rows=2.5), TypeError, "block_rows=2.5 must be a positive int"),
    (dict(sort_rows=None), TypeError, "sort_rows=None must be a bool"),
    (dict(implementation="xla", interpret=True), ValueError, "no meaning with implementation='xla'"),
])
def test_bad_options(kw, error, match):
  with pytest.raises(error, match=match):
    _call(**kw)


def test_non_array_leaf():
  with pytest.raises(TypeError, match=r"h0\[1\] is a str, not an array"):
    _call(h0=(H0, "state"))


def test_numpy_inputs_are_accepted():
  out = _call(h0=np.ones((4, 8), np.float32), iters=np.array([0, 1, 2, 3]))
  np.testing.assert_allclose(out[:, 0], [1.0, 0.5, 0.25, 0.125])
