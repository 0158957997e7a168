"""`pallas_loop.Options`: its checks, its value semantics, and the old keywords' errors."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_loop
from pallas_loop import deq
from pallas_loop import testing
from pallas_loop import tuning
from pallas_loop._src.deq import deq_solve

STEP = lambda p, h, x: h * 0.5
H0 = jnp.ones((4, 8))

# One value of each how-to-run option other than its default.
CHOSEN = dict(implementation="pallas", interpret=True, block_rows=8, sort_rows=False,
              schedule="persistent", hoist=False, approx_tanh=True)


def test_fields_are_the_seven_options_with_their_defaults():
  assert {f.name: f.default for f in dataclasses.fields(pallas_loop.Options)} == dict(
      implementation=None, interpret=None, block_rows=None, sort_rows=True, schedule=None,
      hoist=True, approx_tanh=None)
  assert set(CHOSEN) == {f.name for f in dataclasses.fields(pallas_loop.Options)}


@pytest.mark.parametrize("kw,error,match", [
    (dict(implementation="triton"), ValueError, "implementation='triton' must be one of"),
    (dict(interpret="yes"), ValueError, "interpret='yes' must be None, True, False, 'tpu' or 'gpu'"),
    (dict(interpret=1.5), TypeError, "interpret=1.5 must be None, True, False, 'tpu', 'gpu' or a"),
    (dict(implementation="xla", interpret=True), ValueError, "no meaning with implementation='xla'"),
    (dict(block_rows=0), ValueError, "block_rows=0 must be a positive int"),
    (dict(block_rows=True), TypeError, "block_rows=True must be a positive int"),
    (dict(block_rows=2.5), TypeError, "block_rows=2.5 must be a positive int"),
    (dict(sort_rows=None), TypeError, "sort_rows=None must be a bool"),
    (dict(schedule="round_robin"), ValueError, "schedule='round_robin' must be None, 'grid'"),
    (dict(hoist=1), TypeError, "hoist=1 must be a bool"),
    (dict(approx_tanh="yes"), TypeError, "approx_tanh='yes' must be None, True or False"),
])
def test_a_bad_value_fails_where_the_options_are_built(kw, error, match):
  with pytest.raises(error, match=re.escape(match)):
    pallas_loop.Options(**kw)
  # replace checks the new value too.
  with pytest.raises(error, match=re.escape(match)):
    pallas_loop.Options().replace(**kw)


def test_good_values_are_kept():
  opts = pallas_loop.Options(**CHOSEN)
  assert {k: getattr(opts, k) for k in CHOSEN} == CHOSEN
  tpu = pallas_loop.Options(implementation="pallas", interpret=pltpu.InterpretParams())
  assert tpu.interpret == pltpu.InterpretParams()
  # A NumPy integer is stored as an int: equal options hash alike.
  assert pallas_loop.Options(block_rows=np.int64(8)) == pallas_loop.Options(block_rows=8)
  assert type(pallas_loop.Options(block_rows=np.int64(8)).block_rows) is int


def test_frozen_hashable_and_comparable():
  opts = pallas_loop.Options(**CHOSEN)
  with pytest.raises(dataclasses.FrozenInstanceError):
    opts.block_rows = 16  # type: ignore[misc]
  assert hash(opts) == hash(pallas_loop.Options(**CHOSEN))
  assert opts == pallas_loop.Options(**CHOSEN) and opts != pallas_loop.Options()
  assert len({opts, pallas_loop.Options(**CHOSEN), pallas_loop.Options()}) == 2


def test_replace_and_repr():
  opts = pallas_loop.Options(implementation="pallas", block_rows=8)
  assert opts.replace(block_rows=16) == pallas_loop.Options(implementation="pallas",
                                                            block_rows=16)
  assert opts.block_rows == 8  # unchanged
  assert dataclasses.replace(opts, hoist=False).hoist is False
  assert repr(opts) == "Options(implementation='pallas', block_rows=8)"
  assert repr(pallas_loop.Options()) == "Options()"
  assert eval(repr(opts), {"Options": pallas_loop.Options}) == opts


def test_options_is_a_static_argument_of_jit():
  calls = []

  def traced(h, options):
    calls.append(options)
    return pallas_loop.iterate(STEP, None, h, iters=2, max_iters=3, options=options)

  run = jax.jit(traced, static_argnames="options")
  xla, kernel = (pallas_loop.Options(implementation="xla"),
                 pallas_loop.Options(implementation="pallas", interpret=True, block_rows=8))
  for options in (xla, kernel, pallas_loop.Options(implementation="xla")):
    np.testing.assert_allclose(run(H0, options=options), 0.25 * H0)
  assert calls == [xla, kernel]  # an equal Options hits the cache


def test_none_means_the_defaults():
  a = pallas_loop.iterate(STEP, None, H0, iters=2, max_iters=3)
  b = pallas_loop.iterate(STEP, None, H0, iters=2, max_iters=3, options=pallas_loop.Options())
  np.testing.assert_array_equal(a, b)


def test_options_must_be_an_options():
  with pytest.raises(TypeError, match=re.escape(
      "options must be a pallas_loop.Options or None, got dict: pass "
      "options=pallas_loop.Options(**{'implementation': 'xla'}).")):
    pallas_loop.iterate(STEP, None, H0, max_iters=1, options={"implementation": "xla"})


@pytest.mark.parametrize("name", list(CHOSEN))
def test_each_old_keyword_shows_the_new_spelling(name):
  value = CHOSEN[name]
  with pytest.raises(TypeError) as e:
    pallas_loop.iterate(STEP, None, H0, max_iters=1, **{name: value})
  assert str(e.value) == (f"iterate({name}={value!r}) is no longer a keyword: pass "
                          f"options=pallas_loop.Options({name}={value!r}).")


def test_several_old_keywords_are_spelled_together():
  with pytest.raises(TypeError, match=re.escape(
      "iterate(implementation='pallas', block_rows=8) are no longer keywords: pass "
      "options=pallas_loop.Options(implementation='pallas', block_rows=8).")):
    pallas_loop.iterate(STEP, None, H0, max_iters=1, implementation="pallas", block_rows=8)


def test_another_unknown_keyword_is_pythons_error():
  with pytest.raises(TypeError, match=re.escape(
      "iterate() got an unexpected keyword argument 'blockrows'")):
    pallas_loop.iterate(STEP, None, H0, max_iters=1, blockrows=8)


def test_the_helpers_that_forward_options_refuse_the_old_keywords_too():
  spelled = re.escape("(block_rows=8) is no longer a keyword: pass "
                      "options=pallas_loop.Options(block_rows=8).")
  with pytest.raises(TypeError, match="fixed_point" + spelled):
    deq.fixed_point(STEP, None, H0, block_rows=8)
  with pytest.raises(TypeError, match=re.escape(
      "fixed_point() got an unexpected keyword argument 'blockrows'")):
    deq.fixed_point(STEP, None, H0, blockrows=8)
  with pytest.raises(TypeError, match="check_against_reference" + spelled):
    testing.check_against_reference(STEP, None, H0, max_iters=1, block_rows=8)
  with pytest.raises(TypeError, match="tune_block_rows" + spelled):
    tuning.tune_block_rows(STEP, None, H0, iters=1, max_iters=1, block_rows=8)


def test_fixed_point_forwards_all_seven_options(monkeypatch):
  """Every iterate call of a DEQ solve (the forward and the adjoint's) gets
  the caller's Options whole."""
  seen = []
  real = deq_solve.iterate

  def recording(*args, options=None, **kw):
    seen.append(options)
    # Run what this machine runs (the kernel needs no GPU to be asked for).
    return real(*args, options=pallas_loop.Options(implementation="xla"), **kw)

  monkeypatch.setattr(deq_solve, "iterate", recording)
  opts = pallas_loop.Options(**CHOSEN)
  f = lambda w, h, x: jnp.tanh(h @ w + x)
  w, x = 0.5 * jnp.eye(4), jnp.ones((3, 4))
  jax.grad(lambda w: jnp.sum(deq.fixed_point(f, w, jnp.zeros((3, 4)), x, options=opts)))(w)
  assert len(seen) == 2 and all(o is opts for o in seen)  # forward and adjoint solves


def test_fixed_point_runs_with_options():
  f = lambda w, h, x: jnp.tanh(h @ w + x)
  w, x, h0 = 0.5 * jnp.eye(4), jnp.ones((16, 4)), jnp.zeros((16, 4))
  want = deq.fixed_point(f, w, h0, x, options=pallas_loop.Options(implementation="xla"))
  got = deq.fixed_point(f, w, h0, x, options=pallas_loop.Options(
      implementation="pallas", interpret=True, block_rows=8, sort_rows=False, hoist=False))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
