"""Property-based test: random shapes, dtypes, counts and tilings vs the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import blocks
from tests import cases
from tests import oracle


@st.composite
def problems(draw):
  batch = draw(st.integers(1, 70))
  max_iters = draw(st.integers(0, 9))
  counts = draw(st.lists(st.integers(-2, max_iters + 2), min_size=batch, max_size=batch))
  return dict(
      block=draw(st.sampled_from(["tanh_rnn", "lstm", "residual_mlp"])),
      batch=batch,
      d=draw(st.sampled_from([8, 16])),
      dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
      max_iters=max_iters,
      counts=np.asarray(counts, np.int32),
      impl=draw(st.sampled_from(["xla", "pallas", "pallas_tpu_interpret"])),
      block_rows=draw(st.sampled_from([None, 8, 16, 32])),
      sort_rows=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
      # Halting only in float32, where every implementation computes the same
      # rms bit for bit (a bf16 rms at the threshold could flip a decision).
      tol=draw(st.sampled_from([None, 1e-2, 1e-4])),
  )


def _check(p):
  step, params, h0, x = blocks.make(p["block"], p["batch"], p["d"], p["dtype"],
                                    jax.random.key(p["seed"]))
  kw = dict(iters=jnp.asarray(p["counts"]), max_iters=p["max_iters"])
  if p["dtype"] == jnp.float32 and p["tol"] is not None:
    kw["tol"] = p["tol"]
  options = cases.IMPLEMENTATIONS[p["impl"]].replace(block_rows=p["block_rows"],
                                                     sort_rows=p["sort_rows"])
  with pallas_loop.testing.poisoned_padding():
    got, info = pallas_loop.iterate(step, params, h0, x, return_info=True, **kw, options=options)
  want, want_f32 = oracle.reference_pair(step, params, h0, x, **kw)
  oracle.assert_trees_close(got, want, want_f32)
  ref_info = reference.iterate(step, params, h0, x, return_info=True, **kw)[1]
  np.testing.assert_array_equal(info.steps, ref_info.steps)
  np.testing.assert_array_equal(info.halted, ref_info.halted)


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@settings(max_examples=12, **_SETTINGS)
@given(problems())
def test_random_problems(p):
  _check(p)


@pytest.mark.slow
@settings(max_examples=40, **_SETTINGS)
@given(problems())
def test_random_problems_many(p):
  _check(p)
