"""tanh and logistic in the GPU kernels (`pallas_loop/_src/step/fast_math.py`).

The compiled forms (PTX inline assembly) only run on a GPU; here: the
policy (which calls get the hardware tanh), the formulas as interpret mode
emulates them (the approximate tanh at its documented worst case), that the
exported Triton kernels carry the instructions exactly where the policy says,
and that a 16-bit tanh or logistic, which Triton's lowering rejects, lowers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from benchmarks import blocks
from pallas_loop import _reference as reference
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src.kernels import backend_triton
from pallas_loop._src.step import fast_math
from pallas_loop._src.step import jaxpr_eval
from tests import lowering

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("state, approx", [
    (jnp.zeros((4, 8), BF16), True),
    ((jnp.zeros((4, 8), jnp.float16), jnp.zeros((4,), jnp.int32)), True),
    (jnp.zeros((4, 8), F32), False),
    ((jnp.zeros((4, 8), BF16), jnp.zeros((4, 8), F32)), False),  # one wider leaf: exact
    (jnp.zeros((4,), jnp.int32), False),  # no float leaf
])
def test_the_hardware_tanh_is_for_16_bit_states_on_triton_only(state, approx):
  assert jaxpr_eval.for_state(backend_triton.EVAL_RULES, state).approx_tanh is approx
  assert jaxpr_eval.for_state(backend_triton.INTERPRET_EVAL_RULES, state).approx_tanh is approx
  assert not jaxpr_eval.for_state(backend_mosaic_tpu.EVAL_RULES, state).approx_tanh
  assert not jaxpr_eval.for_state(jaxpr_eval.PLAIN, state).approx_tanh


@pytest.mark.parametrize("state, approx", [
    (jnp.zeros((4, 8), BF16), True),
    (jnp.zeros((4, 8), F32), False),
    ((jnp.zeros((4, 8), BF16), jnp.zeros((4, 8), F32)), False),
])
def test_the_tpu_logistic_through_tanh_is_for_16_bit_states(state, approx):
  # On a v5e it is off by 2.2e-5 where lax.logistic is off by 1.0e-6: a
  # float32 LSTM's state drifted 5.5e-5 from the reference in 16 steps.
  assert jaxpr_eval.for_state(backend_mosaic_tpu.EVAL_RULES, state).logistic_via_tanh is approx
  assert jaxpr_eval.for_state(backend_mosaic_tpu.EVAL_RULES, state,
                              approx_tanh=True).logistic_via_tanh
  assert not jaxpr_eval.for_state(backend_triton.EVAL_RULES, state).logistic_via_tanh


def test_logistic_formula_is_float32_accurate():
  x = jnp.concatenate([jnp.linspace(-90.0, 90.0, 20001, dtype=F32),
                       jnp.array([0.0, -0.0, jnp.inf, -jnp.inf], F32)])
  got = fast_math.apply("logistic", x, approx_tanh=False, emulate=True)
  want = jax.nn.sigmoid(x)
  # A few ulp, plus what rounding x log2(e) costs (relative 2^-24 of the
  # exponent), as in XLA's GPU logistic.
  bound = jnp.abs(want) * (4 * 2.0 ** -24 + jnp.abs(jnp.where(jnp.isinf(x), 0, x)) * 2.0 ** -23)
  assert bool(jnp.all(jnp.abs(got - want) <= bound))
  assert jnp.isnan(fast_math.apply("logistic", jnp.array([jnp.nan], F32), approx_tanh=False,
                                   emulate=True)).all()


def test_emulated_tanh_is_at_the_documented_worst_case():
  x = jnp.linspace(-10.0, 10.0, 4001, dtype=F32)
  exact = jnp.tanh(x)
  got = fast_math.apply("tanh", x, approx_tanh=True, emulate=True)
  err = jnp.abs(got - exact)
  assert float(jnp.max(err / jnp.maximum(jnp.abs(exact), 1e-30))) <= 1.01 * 2.0 ** -11
  assert float(jnp.max(jnp.abs(got))) <= 1.0
  moved = (jnp.abs(exact) > 1e-3) & (jnp.abs(exact) < 0.999)
  assert bool(jnp.all(err[moved] > 0))  # really perturbed: tests see the worst case
  np.testing.assert_array_equal(
      fast_math.apply("tanh", x, approx_tanh=False, emulate=True), exact)


@pytest.mark.parametrize("dtype", [BF16, jnp.float16])
def test_16_bit_operands_are_computed_in_float32(dtype):
  x = jnp.linspace(-4.0, 4.0, 101).astype(dtype)
  for prim, exact in (("tanh", jnp.tanh), ("logistic", jax.nn.sigmoid)):
    got = fast_math.apply(prim, x, approx_tanh=False, emulate=True)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(F32), exact(x.astype(F32)).astype(dtype).astype(F32),
                               atol=float(jnp.finfo(dtype).eps))


def _export_gru(dtype, grad: bool, approx_tanh: bool | None = None):
  step, params, h0, x = blocks.make("gru", 64, 32, jnp.dtype(dtype))
  n = jnp.arange(64, dtype=jnp.int32) % 9
  options = pallas_loop.Options(implementation="pallas", interpret=False, approx_tanh=approx_tanh)
  run = lambda p, h, x_: pallas_loop.iterate(step, p, h, x_, iters=n, max_iters=8, options=options)
  f = (jax.grad(lambda p, h, x_: jnp.sum(run(p, h, x_).astype(F32)), argnums=(0, 1, 2))
       if grad else run)
  return lowering.export_text(f, params, h0, x, platform="cuda")


@pytest.mark.parametrize("grad", [False, True])
def test_triton_kernels_carry_the_hardware_instructions_where_the_policy_says(grad):
  bf16, f32 = _export_gru(BF16, grad), _export_gru(F32, grad)
  assert "ex2.approx.ftz.f32" in bf16 and "ex2.approx.ftz.f32" in f32  # logistic: always
  assert "tanh.approx.f32" in bf16
  assert "tanh.approx.f32" not in f32 and "__nv_tanhf" in f32  # a float32 state: exact tanh


def test_approx_tanh_overrides_the_policy():
  assert "tanh.approx.f32" not in _export_gru(BF16, True, approx_tanh=False)
  assert "tanh.approx.f32" in _export_gru(F32, False, approx_tanh=True)
  with pytest.raises(TypeError, match="approx_tanh"):
    pallas_loop.Options(approx_tanh="yes")


def test_mosaic_kernels_keep_the_primitives():
  step, params, h0, x = blocks.make("gru", 64, 128, BF16)
  n = jnp.arange(64, dtype=jnp.int32) % 9
  options = pallas_loop.Options(implementation="pallas", interpret=False)
  f = lambda p, h, x_: pallas_loop.iterate(step, p, h, x_, iters=n, max_iters=8, options=options)
  text = lowering.export_text(f, params, h0, x, platform="tpu")
  assert "approx" not in text


def _bf16_gates(params, h, x):
  # tanh and logistic of bfloat16 values: Triton's lowering has neither
  # (no bf16 division, no bf16 math.tanh) without the float32 detour. Both
  # depend on h, so neither is hoisted out of the kernel.
  w, u = params
  gate = jax.nn.sigmoid(h @ w)
  return (gate * jnp.tanh(h @ u + x) + (1 - gate) * h).astype(h.dtype)


def test_16_bit_tanh_and_logistic_lower_for_triton_and_match_in_interpret_mode():
  key = jax.random.split(jax.random.key(0), 4)
  params = tuple((jax.random.normal(k, (32, 32)) * 0.2).astype(BF16) for k in key[:2])
  h0 = jax.random.normal(key[2], (48, 32)).astype(BF16)
  x = jax.random.normal(key[3], (48, 32)).astype(BF16)
  n = jnp.arange(48, dtype=jnp.int32) % 7
  run = lambda interpret: (lambda p, h, x_: pallas_loop.iterate(
      _bf16_gates, p, h, x_, iters=n, max_iters=6,
      options=pallas_loop.Options(implementation="pallas", interpret=interpret)))
  text = lowering.export_text(run(interpret=False), params, h0, x, platform="cuda")
  assert "tanh.approx.f32" in text and "ex2.approx.ftz.f32" in text
  got = run(interpret="gpu")(params, h0, x).astype(F32)
  want = reference.iterate(_bf16_gates, params, h0, x, iters=n, max_iters=6).astype(F32)
  # One bf16 unit in the last place, a few times over six steps.
  np.testing.assert_allclose(got, want, atol=4 * 2.0 ** -7 * float(jnp.max(jnp.abs(want))))


def test_interpret_mode_runs_the_worst_case_tanh_within_one_ulp_a_step():
  step, params, h0, x = blocks.make("tanh_rnn", 64, 32, BF16, jax.random.key(0))
  n = jnp.full((64,), 1, jnp.int32)
  got = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=1,
                            options=pallas_loop.Options(implementation="pallas",
                                                        interpret="gpu")).astype(F32)
  want = reference.iterate(step, params, h0, x, iters=n, max_iters=1).astype(F32)
  ulp = 2.0 ** (jnp.floor(jnp.log2(jnp.maximum(jnp.abs(want), 2.0 ** -126))) - 7)
  assert bool(jnp.all(jnp.abs(got - want) <= ulp))  # faithful: within one bf16 ulp
  assert bool(jnp.any(got != want))  # and the worst case did change some roundings


def test_equations_without_operands_pass_the_rewrite():
  # An iota has no operands: the rewrite must look at the primitive first.
  def step(params, h, x):
    ramp = jnp.arange(h.shape[-1], dtype=F32) / h.shape[-1]
    return jnp.tanh(h * params + ramp + x)
  h0 = jnp.ones((16, 8), F32)
  n = jnp.arange(16, dtype=jnp.int32) % 4
  got = pallas_loop.iterate(step, jnp.float32(0.5), h0, h0, iters=n, max_iters=4,
                            options=pallas_loop.Options(implementation="pallas", interpret="gpu"))
  want = reference.iterate(step, jnp.float32(0.5), h0, h0, iters=n, max_iters=4)
  np.testing.assert_allclose(got, want, rtol=1e-6)
