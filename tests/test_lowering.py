"""Lowering the kernels for cuda (Triton) and tpu (Mosaic) on a CPU machine.

`jax.export` for a platform lowers only that platform's branch; the exported
module must contain the kernel's custom call, which proves the Pallas path
(not a fallback) was taken.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_loop
from benchmarks import blocks
from benchmarks import cases as bench_cases
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import kernel_backward
from pallas_loop._src.kernels import kernel_forward
from pallas_loop._src import notices
from tests import cases
from tests import lowering

PLATFORMS = ("cuda", "tpu")


def _compiled(step, grad="full", **options):
  """iterate on `step`, with `options` the fields of its `pallas_loop.Options`."""
  options = pallas_loop.Options(**options)
  return lambda p, h, x, n: pallas_loop.iterate(step, p, h, x, iters=n, max_iters=8, grad=grad,
                                                options=options)


def _fwd_bwd(f):
  loss = lambda p, h, x, n: cases.tree_sum(f(p, h, x, n))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("block", ["tanh_rnn", "residual_mlp", "lstm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_lowers(platform, block, dtype):
  step, params, h0, x = blocks.make(block, 100, 32, jnp.dtype(dtype))
  n = jnp.arange(100, dtype=jnp.int32) % 9
  f = _compiled(step, implementation="pallas", interpret=False)
  for fn in (f, _fwd_bwd(f)):
    text = lowering.export_text(fn, params, h0, x, n, platform=platform)
    assert lowering.kernel_marker(platform) in text
    assert kernel_forward.KERNEL_NAME in text
  # The backward is the fused kernel too, in every gradient mode that runs
  # steps backwards (Implicit's adjoint solve is an iterate: its forward kernel).
  for mode in ("full", pallas_loop.Truncated(3), pallas_loop.Phantom(2)):
    fn = _fwd_bwd(_compiled(step, implementation="pallas", interpret=False, grad=mode))
    text = lowering.export_text(fn, params, h0, x, n, platform=platform)
    assert kernel_backward.KERNEL_NAME in text, mode
  fn = _fwd_bwd(_compiled(step, implementation="pallas", interpret=False,
                          grad=pallas_loop.Implicit(max_iters=4)))
  text = lowering.export_text(fn, params, h0, x, n, platform=platform)
  assert text.count(kernel_forward.KERNEL_NAME) >= 2 and kernel_backward.KERNEL_NAME not in text


@pytest.mark.parametrize("platform", PLATFORMS)
def test_mixed_rank_leaves_and_scalar_params_lower(platform):
  batch = 32
  params = (jnp.float32(0.8), jnp.ones((16, 16)) * 0.1)
  state = (jnp.ones((batch,)), jnp.ones((batch, 16)), jnp.ones((batch, 4, 16)))
  n = jnp.arange(batch, dtype=jnp.int32) % 5
  options = pallas_loop.Options(implementation="pallas", interpret=False,
                                block_rows=32 if platform == "tpu" else 16)
  f = lambda p, s, n: pallas_loop.iterate(cases.mixed_rank_step, p, s, iters=n, max_iters=4,
                                          options=options)
  text = lowering.export_text(f, params, state, n, platform=platform)
  assert lowering.kernel_marker(platform) in text


def test_triton_rule_failure_is_deferred_to_cuda_lowering():
  """D=24 breaks Triton's power-of-2 rule: cuda export raises, tpu export works."""
  step, params, h0, x = blocks.make("tanh_rnn", 64, 24)
  n = jnp.arange(64, dtype=jnp.int32) % 9
  f = _compiled(step, implementation="pallas", interpret=False)
  with pytest.raises(ValueError, match=r"power-of-2.*h0 has block shape \(16, 24\).*implementation='xla'"):
    lowering.export_text(f, params, h0, x, n, platform="cuda")
  assert lowering.kernel_marker("tpu") in lowering.export_text(f, params, h0, x, n, platform="tpu")


def test_tpu_rule_failure_names_the_rule():
  step, params, h0, x = blocks.make("tanh_rnn", 64, 16)
  n = jnp.arange(64, dtype=jnp.int32) % 9
  f = _compiled(step, implementation="pallas", interpret=False, block_rows=12)
  with pytest.raises(ValueError, match=r"\(8, 128\).*block shape \(12, 16\)"):
    lowering.export_text(f, params, h0, x, n, platform="tpu")


def test_auto_falls_back_with_one_warning():
  step, params, h0, x = blocks.make("tanh_rnn", 64, 24)
  n = jnp.arange(64, dtype=jnp.int32) % 9
  f = _compiled(step)  # implementation=None
  notices._warned.clear()
  with pytest.warns(UserWarning, match=r"power-of-2.*using the XLA implementation"):
    text = lowering.export_text(f, params, h0, x, n, platform="cuda")
  assert lowering.kernel_marker("cuda") not in text
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a second lowering must not warn again
    lowering.export_text(f, params, h0, x, n, platform="cuda")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_picks_the_kernel_when_it_fits(platform):
  step, params, h0, x = blocks.make("tanh_rnn", 64, 16)
  n = jnp.arange(64, dtype=jnp.int32) % 9
  text = lowering.export_text(_compiled(step), params, h0, x, n, platform=platform)
  assert lowering.kernel_marker(platform) in text


def test_auto_on_cpu_is_xla():
  step, params, h0, x = blocks.make("tanh_rnn", 64, 16)
  n = jnp.arange(64, dtype=jnp.int32) % 9
  text = jax.jit(_compiled(step)).lower(params, h0, x, n).as_text()
  assert kernel_forward.KERNEL_NAME not in text


@pytest.mark.parametrize("platform", PLATFORMS)
def test_unsupported_primitive_is_named(platform):
  step = lambda p, h, x: jnp.sort(h, axis=-1) * 0.5
  h0 = jnp.ones((32, 16))
  f = lambda h, n: pallas_loop.iterate(step, None, h, iters=n, max_iters=3,
                                       options=pallas_loop.Options(implementation="pallas",
                                                                   interpret=False))
  with pytest.raises(ValueError, match=r"primitive `sort`.*implementation='xla'"):
    lowering.export_text(f, h0, jnp.ones((32,), jnp.int32), platform=platform)


def test_compiled_pallas_on_cpu_says_what_to_do():
  h0 = jnp.ones((16, 16))
  f = jax.jit(lambda h: pallas_loop.iterate(lambda p, h, x: h * 0.5, None, h, iters=2, max_iters=3,
                                            options=pallas_loop.Options(implementation="pallas",
                                                                        interpret=False)))
  with pytest.raises(ValueError, match="interpret=True"):
    f(h0)


@pytest.mark.parametrize("block", ["tanh_rnn", "gru", "residual_mlp"])
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_suite_shapes_lower_with_the_default_tile(block, d):
  """The H200 suite's shapes (B=4096, bf16) take the Triton kernel at the default tile.

  So `benchmarks/gpu_check.py` times the kernel, not a fallback, when a GPU is lent.
  (The residual MLP's [1024, 256] weight at D=256 fits only re-read in K chunks.)
  The backward kernel runs where its weight gradients fit in registers
  (`backend_triton.accumulator_problem`: [128, 128] does, [256, 256] and the
  residual MLP's [128, 512] do not); elsewhere "pallas" refuses up front.
  """
  step, params, h0, x = blocks.make(block, 4096, d, jnp.bfloat16)
  n = jnp.arange(4096, dtype=jnp.int32) % 9
  f = _compiled(step, implementation="pallas", interpret=False)
  text = lowering.export_text(f, params, h0, x, n, platform="cuda")
  assert lowering.kernel_marker("cuda") in text and kernel_forward.KERNEL_NAME in text
  if (block, d) in bench_cases.GPU_BACKWARD_KERNEL:
    text = lowering.export_text(_fwd_bwd(f), params, h0, x, n, platform="cuda")
    assert text.count(lowering.kernel_marker("cuda")) >= 2
  else:
    with pytest.raises(ValueError, match="weight gradient"):
      lowering.export_text(_fwd_bwd(f), params, h0, x, n, platform="cuda")


def _dot_precisions(jaxpr):
  """(operand dtypes, precision) of every dot_general in `jaxpr`, recursively."""
  return [(tuple(str(v.aval.dtype) for v in e.invars), e.params["precision"])
          for e in backend_lib.iter_eqns(jaxpr) if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("interpret", ["triton", "mosaic"])
def test_bf16_dots_in_the_kernels_ignore_highest_precision(interpret):
  """Under `jax.default_matmul_precision("highest")` a traced bf16 dot carries
  HIGHEST; Mosaic lowers that to an fp32 contraction and rejects the bf16
  operands ("Bad lhs type", on a TPU v5e). The kernels' dots on 16-bit floats
  run at DEFAULT (the same exact products), float32 ones keep HIGHEST."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  mode = True if interpret == "triton" else pltpu.InterpretParams()
  step, params, h0, x = blocks.make("gru", 32, 16, jnp.bfloat16)
  options = pallas_loop.Options(implementation="pallas", interpret=mode, hoist=False)
  loss = lambda p, h, x_: jnp.sum(pallas_loop.iterate(
      step, p, h, x_, iters=3, max_iters=4, options=options).astype(jnp.float32))
  with jax.default_matmul_precision("highest"):
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, h0, x).jaxpr
  kernels = [e.params["jaxpr"] for e in backend_lib.iter_eqns(jaxpr)
             if e.primitive.name == "pallas_call"]
  assert len(kernels) == 2  # the forward and the backward kernel
  dots = [d for k in kernels for d in _dot_precisions(k)]
  narrow = [p for dtypes, p in dots if "float32" not in dtypes]
  wide = [p for dtypes, p in dots if set(dtypes) == {"float32"}]
  assert narrow and wide
  assert all(p == (jax.lax.Precision.DEFAULT,) * 2 for p in narrow), narrow
  assert all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in wide), wide
