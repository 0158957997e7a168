"""The kernel configuration rules: footprints, the Triton rule's decisions,
the evaluation rewrites the rules rely on, and the compile report's parsers.

Whether the rules predict the real compilers is checked by
`python -m benchmarks.compile_check` (CI's compile step); these tests pin the
decisions themselves on CPU, so a change to a rule shows here first.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from pallas_loop import _reference as reference
from benchmarks import attention
from benchmarks import blocks
from benchmarks import compile_check
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backend_interpret
from pallas_loop._src import dispatch
from pallas_loop._src import notices
from pallas_loop._src.step import footprint as footprint_lib
from pallas_loop._src.step import jaxpr_eval
from pallas_loop._src.kernels import kernel_tpu_groups
from pallas_loop._src.kernels import kernel_tpu_groups_backward
from pallas_loop._src.kernels import kernel_backward
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src.kernels import backend_triton
from pallas_loop._src.xla import xla_backward
from pallas_loop._src.xla import xla_forward
from tests import cases
from tests import lowering
from tests import oracle

MAX_ITERS = 4


# --- footprints ---------------------------------------------------------------

def test_footprint_counts_dots_and_weight_gradients():
  def step(w, h, g):
    out = jnp.dot(h, w, preferred_element_type=jnp.float32)       # [16, 64] x [64, 32]
    grad_w = jax.lax.dot_general(h, g, (((0,), (0,)), ((), ())))   # sums over the rows
    return out, grad_w

  w = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
  h = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(step)(w, h, g).jaxpr
  fp = footprint_lib.measure([(jaxpr, 1)], batch=4096, block_rows=16, shared_avals=[w],
                             row_block_avals=[h, g])
  forward, gradient = fp.dots
  assert (forward.lhs_shared, forward.rhs_shared) == (False, True)
  assert forward.operand_bytes == (16 * 64 * 2, 64 * 32 * 2)
  assert forward.flops == 2 * 16 * 32 * 64 and not forward.contracts_rows
  assert gradient.contracts_rows and gradient.out == (64, 32)
  assert fp.largest_gradient_accumulator_bytes() == 64 * 32 * 4
  assert fp.shared_dot_bytes() == 64 * 32 * 2
  assert fp.tiles == 256
  assert fp.shared_bytes == 64 * 32 * 2
  assert fp.row_bytes == (64 + 32) * 2


def test_held_weight_used_only_widened_is_counted_widened():
  # A float32 cotangent against a bfloat16 weight. Held, Triton hoists the
  # weight's cast out of the loop with its staging, so it stays staged as
  # float32 (compile report: the implicit adjoint's GRU step, 200 KB), unless
  # a dot also uses the weight at its own width (the backward kernel's
  # recomputed forward step), which keeps it staged as bfloat16.
  def adjoint(w, u):
    return jax.lax.dot_general(u, w.T, (((1,), (0,)), ((), ())))   # u @ w.T

  def backward(w, u, h):
    return adjoint(w, u), jnp.dot(h, w)

  w = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  u = jax.ShapeDtypeStruct((16, 64), jnp.float32)
  h = jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)
  measure = lambda f, *rows: footprint_lib.measure(
      [(jax.make_jaxpr(f)(w, *rows).jaxpr, 1)], batch=4096, block_rows=16,
      shared_avals=[w], row_block_avals=list(rows))
  fp = measure(adjoint, u)
  (dot,) = fp.dots
  assert dot.operand_bytes == (16 * 64 * 4, 64 * 128 * 2)
  assert fp.shared_dot_bytes() == 64 * 128 * 4
  fp = measure(backward, u, h)
  assert fp.shared_dot_bytes() == 2 * 64 * 128 * 2


# --- the Triton rule ------------------------------------------------------------

def _plans(block, d, dtype, *, grad, implementation=None, batch=4096, platform="cuda",
           hoist=True, block_rows=None, sort_rows=True):
  """The plans the rules make for a block, traced by exporting for `platform`."""
  options = {}
  # Flax's and Equinox's layers promote bfloat16 with float32 themselves.
  promotion = "standard" if block in compile_check.ATTENTION else "strict"
  if block in compile_check.ATTENTION:
    with jax.numpy_dtype_promotion(promotion):
      step, params, h0, x, options = attention.make(compile_check.ATTENTION[block], batch, d,
                                                    jnp.dtype(dtype))
  else:
    step, params, h0, x = blocks.make(block, batch, d, jnp.dtype(dtype))
  n = jnp.arange(batch, dtype=jnp.int32) % (MAX_ITERS + 1)
  # The kernel compiled for `platform` (not interpreted) where it is asked for.
  interpret = False if implementation == "pallas" else None
  how = pallas_loop.Options(implementation=implementation, interpret=interpret,
                            hoist=hoist, block_rows=block_rows, sort_rows=sort_rows)
  run = functools.partial(pallas_loop.iterate, step, max_iters=MAX_ITERS, options=how,
                          **options)
  forward = lambda p, h, x_, n_: run(p, h, x_, iters=n_)
  # The loss and its gradient, as a training step needs them: a gradient
  # alone does not need the forward's output, and the forward kernel of a
  # loop that tracks nothing per row is then left out (the TPU's group
  # kernel), so a plan of it would not be lowered.
  f = jax.value_and_grad(lambda *a: cases.tree_sum(forward(*a))) if grad else forward
  backend = "triton" if platform == "cuda" else "mosaic_tpu"
  with dispatch.observe_plans() as seen, warnings.catch_warnings(record=True) as caught, \
       jax.numpy_dtype_promotion(promotion):
    warnings.simplefilter("always")
    text = lowering.export_text(f, params, h0, x, n, platform=platform)
  plans = {what: p for what, name, p in seen if name == backend}
  return plans, text, [str(w.message) for w in caught]


def test_small_weights_are_held_on_chip():
  plans, text, _ = _plans("gru", 64, "bfloat16", grad=True)
  assert plans["forward"].config.shared_on_chip
  assert plans["backward"].config.shared_on_chip
  assert plans["forward"].config.estimate["num_warps"] == 4
  assert text.count(lowering.kernel_marker("cuda")) >= 2


def test_weights_that_do_not_fit_together_are_re_read():
  plans, _, _ = _plans("gru", 128, "bfloat16", grad=True)
  fwd, bwd = plans["forward"].config, plans["backward"].config
  assert fwd.shared_on_chip and not bwd.shared_on_chip
  assert fwd.estimate["num_warps"] == 8
  for c in (fwd, bwd):
    assert c.estimate["shared_memory_bytes"] <= backend_triton.gpu("NVIDIA H200").shared_memory
    assert c.prefer_xla is None


def test_large_weight_gradient_falls_back_with_the_reason():
  notices._warned.clear()
  plans, text, caught = _plans("tanh_rnn", 256, "bfloat16", grad=True)
  assert plans["forward"].config is not None and not plans["forward"].problems
  assert plans["backward"].config is None
  assert any("weight gradient of shape [256, 256]" in p for p in plans["backward"].problems)
  assert any("backward kernel cannot run" in m and "registers" in m for m in caught)
  assert text.count(lowering.kernel_marker("cuda")) == 1  # the forward kernel only


def test_the_xla_loop_is_traced_once_however_many_kernels_fall_back(monkeypatch):
  # tanh RNN at D=256 bf16: the Triton backward declines (weight gradient in
  # registers), so the CPU's default branch and the GPU's fallback both run
  # the XLA backward. Both call the same jitted XLA loop: traced once.
  calls = {"forward": 0, "backward": 0}

  def counted(what, fn):
    def wrapper(*args, **kwargs):
      calls[what] += 1
      return fn(*args, **kwargs)
    return wrapper

  monkeypatch.setattr(xla_forward, "forward", counted("forward", xla_forward.forward))
  monkeypatch.setattr(xla_backward, "backward", counted("backward", xla_backward.backward))
  plans, _, _ = _plans("tanh_rnn", 256, "bfloat16", grad=True)
  assert plans["backward"].config is None  # the GPU falls back for the backward
  assert calls == {"forward": 1, "backward": 1}, calls


def test_large_weight_gradient_is_rejected_before_compiling():
  with pytest.raises(ValueError, match=r"weight gradient.*registers"):
    _plans("tanh_rnn", 256, "bfloat16", grad=True, implementation="pallas")


def test_cost_model_prefers_xla_when_every_tile_re_reads_large_weights():
  notices._warned.clear()
  plans, text, caught = _plans("tanh_rnn", 512, "float32", grad=False)
  config = plans["forward"].config
  assert not config.shared_on_chip and config.prefer_xla
  assert any("expected to be slower" in m for m in caught)
  assert lowering.kernel_marker("cuda") not in text
  # "pallas" runs the kernel anyway: the model is a preference, not a limit.
  _, text, _ = _plans("tanh_rnn", 512, "float32", grad=False, implementation="pallas")
  assert lowering.kernel_marker("cuda") in text


def test_no_configuration_fits_a_dot_too_big_to_stage():
  plans, _, _ = _plans("residual_mlp_ln", 512, "bfloat16", grad=False)
  assert plans["forward"].config is None
  assert "no kernel configuration fits the GPU's shared memory" in plans["forward"].problems[0]
  with pytest.raises(ValueError, match="no kernel configuration fits"):
    _plans("residual_mlp_ln", 512, "bfloat16", grad=False, implementation="pallas")


def test_unknown_gpus_get_the_smallest_shared_memory():
  assert backend_triton.gpu("NVIDIA H200").shared_memory == 232448
  assert backend_triton.gpu("NVIDIA A100-SXM4-80GB").shared_memory == 166912
  assert backend_triton.gpu("NVIDIA GeForce RTX 4090").shared_memory == 101376
  assert backend_triton.gpu(None) == backend_triton.gpu("some new GPU")


# --- the TPU: 1-D parameters, advice -------------------------------------------

def test_tpu_backward_of_a_1d_bias_lowers():
  plans, text, _ = _plans("tanh_rnn", 128, "float32", grad=True, batch=256,
                          implementation="pallas", platform="tpu")
  assert not plans["backward"].problems
  assert text.count(lowering.kernel_marker("tpu")) >= 2


def test_mosaic_advice_names_the_axis_block_rows_cannot_fix():
  rows = backend_lib.Block("h", (12, 128), (48, 128), row_axis=0)
  shared = backend_lib.Block("gradient", (1, 4, 128), (4, 12, 128), row_axis=None)
  (row_problem,) = backend_mosaic_tpu._block_problems([rows])
  (shared_problem,) = backend_mosaic_tpu._block_problems([shared])
  assert "choose block_rows a multiple of 8" in row_problem
  assert "block_rows cannot fix it" in shared_problem


# --- the rewrites, run in interpret mode -------------------------------------

@pytest.fixture
def re_read_interpret(monkeypatch):
  """The interpret backend configured as the Triton rule configures a large
  step: shared operands re-read at each use, weight dots split in K chunks."""
  rules = dataclasses.replace(backend_triton.INTERPRET_EVAL_RULES, split_dot_bytes=1024)
  config = lambda fp, given: (backend_lib.KernelConfig(
      fp.block_rows, shared_on_chip=False, eval_rules=rules), [])
  monkeypatch.setitem(backend_interpret.INTERPRETERS, "tpu",
                      dataclasses.replace(backend_interpret.for_option(True), configure=config))


@pytest.mark.parametrize("block", ["residual_mlp_ln", "gru"])
def test_re_read_and_split_weights_match_the_reference(re_read_interpret, block):
  del re_read_interpret
  step, params, h0, x = blocks.make(block, 19, 32)
  n = cases.counts("ragged", 19, MAX_ITERS)
  run = functools.partial(pallas_loop.iterate,
                          options=pallas_loop.Options(implementation="pallas", interpret=True,
                                                      block_rows=8))
  loss = lambda it, p, h, x_: cases.tree_sum(it(step, p, h, x_, iters=n, max_iters=MAX_ITERS))
  got = jax.value_and_grad(functools.partial(loss, run), argnums=(0, 1, 2))(params, h0, x)
  want = jax.value_and_grad(functools.partial(loss, reference.iterate),
                            argnums=(0, 1, 2))(params, h0, x)
  oracle.assert_trees_close(got, want, what=f"{block} re-read")


@pytest.mark.parametrize("block", ["tanh_rnn", "gru", "lstm", "residual_mlp_ln"])
def test_gpu_rules_in_interpret_mode_match_the_reference(block):
  """interpret="gpu": the Triton rewrites (swapped transposed dots, fences,
  fast math at its worst case) evaluated on the CPU, forward and gradient,
  a keyed dropout among them (the integer-mask select), against the oracle."""
  step, params, h0, x = blocks.make(block, 40, 16)
  keyed = lambda p, h, x_, key: step(p, jax.tree.map(
      lambda a: pallas_loop.random.dropout(key, a, 0.1), h), x_)
  n = cases.counts("ragged", 40, MAX_ITERS)
  kw = dict(iters=n, max_iters=MAX_ITERS, key=jax.random.key(3))
  loss = lambda it, p, h, x_: cases.tree_sum(it(keyed, p, h, x_, **kw))
  run = functools.partial(pallas_loop.iterate, options=pallas_loop.Options(
      implementation="pallas", interpret="gpu", block_rows=16))
  got = jax.value_and_grad(functools.partial(loss, run), argnums=(0, 1, 2))(params, h0, x)
  want = jax.value_and_grad(functools.partial(loss, reference.iterate),
                            argnums=(0, 1, 2))(params, h0, x)
  oracle.assert_trees_close(got, want, what=f"{block} under the GPU's rules")


def test_split_parts():
  assert jaxpr_eval.split_parts(512, 128, 2, 32768) == 4
  assert jaxpr_eval.split_parts(128, 128, 2, 32768) == 1
  assert jaxpr_eval.split_parts(32, 4096, 4, 1024) == 2   # chunks stay >= 16 wide
  assert jaxpr_eval.split_parts(512, 128, 2, None) == 1


# --- the compile report's parsers and verdicts --------------------------------

PTXAS = """ptxas info    : Compiling entry function 'pallas_loop_iterate_fwd' for 'sm_90a'
ptxas info    : Function properties for pallas_loop_iterate_fwd
    0 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 40960 bytes smem
"""
THUNKS = ("kernel_thunk pallas_loop_iterate_fwd grid: [256, 1, 1] threads: [256, 1, 1]  "
          "shared_memory: 40960 bytes\n")
HLO = ('  %pallas_loop_iterate_bwd.3 = f32[8] custom-call(), custom_call_target="tpu_custom_call",'
       ' backend_config={"used_scoped_memory_configs":[{"memory_space":"1","offset":"0",'
       '"size":"524288"}]}')


def test_parsers_read_the_compilers_output():
  assert compile_check.parse_ptxas(PTXAS) == {"pallas_loop_iterate_fwd": {
      "stack_bytes": 0, "spill_store_bytes": 12, "spill_load_bytes": 16, "registers": 255}}
  assert compile_check.parse_thunks(THUNKS) == {"pallas_loop_iterate_fwd": {
      "grid": 256, "threads": 256, "shared_memory_bytes": 40960}}
  assert compile_check.scoped_vmem(HLO) == {"pallas_loop_iterate_bwd": {"vmem_bytes": 524288}}


def _result(case, **kw):
  base = {"case": dataclasses.asdict(case), "label": case.label, "compiled": True,
          "plans": [], "kernel_resources": {}}
  return base | kw


def _plan(kind, estimate=None, problems=()):
  return {"kernel": kind, "backend": "triton", "problems": list(problems), "block_rows": 16,
          "shared_on_chip": False, "prefer_xla": None, "estimate": estimate or {}}


def test_verdicts():
  control = compile_check.Case("h200", control=True)
  assert compile_check.problems_of(_result(control))  # a control that compiles fails
  assert not compile_check.problems_of(_result(
      control, compiled=False, error="RESOURCE_EXHAUSTED: Shared memory size limit exceeded"))
  case = compile_check.Case("h200", "gru", 256, "float32")
  over = _result(case, plans=[_plan("forward", {"shared_memory_bytes": 100})],
                 kernel_resources={"pallas_loop_iterate_fwd": {"shared_memory_bytes": 200}})
  assert any("more than the rule's estimate" in p for p in compile_check.problems_of(over))
  rejected = _result(case, plans=[_plan("backward", problems=["too big"])])
  assert any("did not raise" in p for p in compile_check.problems_of(rejected))
  assert not compile_check.problems_of(rejected | {"strict_raises": "too big"})
  strict = compile_check.Case("h200", "gru", 256, "float32", "forward", implementation="pallas")
  assert not compile_check.problems_of(_result(
      strict, compiled=False, error="ValueError: too big", strict_raises="too big",
      plans=[_plan("forward", problems=["too big"])]))
  assert compile_check.problems_of(_result(strict, compiled=False, error="INTERNAL: crash"))


# --- the Mosaic rule -------------------------------------------------------------

def test_vmem_padding():
  assert backend_mosaic_tpu.padded_bytes((128, 1), "int32") == 128 * 128 * 4
  assert backend_mosaic_tpu.padded_bytes((1, 100), "float32") == 8 * 128 * 4
  assert backend_mosaic_tpu.padded_bytes((100,), "float32") == 8 * 128 * 4
  assert backend_mosaic_tpu.padded_bytes((2, 8, 128), "bfloat16") == 2 * 16 * 128 * 2
  assert backend_mosaic_tpu.vmem("TPU v5 lite") == (16 << 20, 128 << 20)
  assert backend_mosaic_tpu.vmem("TPU v6 lite") == (32 << 20, 128 << 20)
  assert backend_mosaic_tpu.vmem("TPU v9") == (16 << 20, 16 << 20)


def test_mosaic_default_tiles():
  """At least 4 tiles of 128 to 1024 rows (measured on a v5e); a small batch
  is one tile of its rows rounded up to 16."""
  rows = backend_mosaic_tpu.MOSAIC_TPU.default_block_rows
  assert [rows(b) for b in (100, 512, 1024, 4096, 32768)] == [112, 128, 256, 1024, 1024]


def test_mosaic_halves_a_default_tile_too_tall_for_vmem():
  """The group kernels (forward and backward): a default chunk whose step
  does not fit is halved, and its group fills what VMEM a kernel may ask
  for. The tile kernel (rows left unsorted): a default tile needing over
  twice the default scoped VMEM is halved (the transformer at D=64: 1024 rows
  need ~99 MB); a tile the caller chose is kept, with the limit raised."""
  default_limit, physical = backend_mosaic_tpu.vmem("TPU v5 lite")
  plans, _, _ = _plans("transformer", 64, "bfloat16", grad=True, platform="tpu")
  assert isinstance(plans["forward"], kernel_tpu_groups.GroupPlan)
  assert isinstance(plans["backward"], kernel_tpu_groups_backward.GroupWindowPlan)
  for p in plans.values():
    assert p.config is not None
    assert 128 <= p.chunk_rows < kernel_tpu_groups.LARGEST_CHUNK
    assert p.config.estimate["vmem_bytes"] <= physical * 7 // 8
  plans, _, _ = _plans("transformer", 64, "bfloat16", grad=True, platform="tpu",
                       sort_rows=False)
  bwd = plans["backward"]
  assert isinstance(bwd, kernel_backward.WindowPlan)
  assert bwd.config is not None and 128 <= bwd.config.block_rows < 1024
  assert bwd.config.estimate["vmem_bytes"] <= 2 * default_limit
  plans, _, _ = _plans("transformer", 64, "bfloat16", grad=False, platform="tpu",
                       block_rows=512)
  assert plans["forward"].config.block_rows == 512
  assert plans["forward"].config.compiler_params.vmem_limit_bytes > 2 * default_limit
  # 1024 rows chosen do not fit beside their step's values: declined, with
  # what to do said.
  plans, _, _ = _plans("transformer", 64, "bfloat16", grad=False, platform="tpu",
                       block_rows=1024)
  assert plans["forward"].config is None
  (problem,) = plans["forward"].problems
  assert "a smaller block_rows may fit" in problem
  # The D=128 blocks the v5e timed keep their 2048-row chunks, forward and
  # backward, and the tile kernel its 1024-row tiles.
  plans, _, _ = _plans("gru", 128, "bfloat16", grad=True, platform="tpu")
  assert plans["backward"].config.block_rows == kernel_tpu_groups.LARGEST_CHUNK
  assert plans["forward"].config.block_rows == kernel_tpu_groups.LARGEST_CHUNK
  plans, _, _ = _plans("gru", 128, "bfloat16", grad=True, platform="tpu", sort_rows=False)
  assert plans["backward"].config.block_rows == 1024


def test_mosaic_raises_the_vmem_limit_where_the_blocks_need_it():
  plans, _, _ = _plans("tanh_rnn", 128, "bfloat16", grad=True, platform="tpu", block_rows=128)
  for p in plans.values():
    assert p.config.compiler_params.vmem_limit_bytes is None
  plans, _, _ = _plans("gru", 512, "bfloat16", grad=True, platform="tpu", block_rows=128)
  bwd = plans["backward"].config
  assert bwd.estimate["vmem_bytes"] > 16 << 20
  assert bwd.compiler_params.vmem_limit_bytes == bwd.estimate["vmem_limit_bytes"]
  assert 16 << 20 < bwd.compiler_params.vmem_limit_bytes <= 112 << 20


@pytest.mark.parametrize("d, hoist", [(1024, False), (2048, True)])
def test_mosaic_rejects_what_no_vmem_limit_holds(d, hoist):
  # Hoisting takes the input weights U out of the backward kernel, so the
  # hoisted case is wider; both exceed what a kernel may ask for, with the
  # margin over the estimate (`backend_mosaic_tpu.MARGIN`).
  plans, _, _ = _plans("lstm", d, "float32", grad=True, platform="tpu", hoist=hoist)
  assert plans["backward"].config is None
  assert "no kernel configuration fits the TPU's VMEM" in plans["backward"].problems[0]


def test_mosaic_merges_leading_contractions_and_matches_the_reference():
  # A transformer block's weight gradients contract the rows and the tokens
  # of [TB, S, D] values: the TPU rules compute them as 2-D dots.
  step, params, h0, x = blocks.make("transformer", 11, 16)
  n = cases.counts("ragged", 11, MAX_ITERS)
  options = cases.IMPLEMENTATIONS["pallas_tpu_interpret"].replace(block_rows=8)
  run = functools.partial(pallas_loop.iterate, options=options)
  loss = lambda it, p: cases.tree_sum(it(step, p, h0, x, iters=n, max_iters=MAX_ITERS))
  got = jax.grad(functools.partial(loss, run))(params)
  want = jax.grad(functools.partial(loss, reference.iterate))(params)
  oracle.assert_trees_close(got, want, what="transformer gradient")


def _dots(jaxpr):
  return [e for e in backend_lib.iter_eqns(jaxpr) if e.primitive.name == "dot_general"]


def test_mosaic_rewrites_every_dot_to_one_batch_and_one_contracted_axis():
  """JAX 0.10.2's Mosaic rejects a dot with several batch axes or several
  contracted axes at lowering; libtpu 0.0.48.1 aborts on some of the latter
  and rejects a 16-bit accumulator. The TPU rules rewrite each such dot
  (`jaxpr_eval._canonical_dot`, `_merged_dot`) into the same sum."""
  none = ((), ())
  forms = [((16, 8, 64), (16, 8, 32), (((0, 1), (0, 1)), none)),        # weight gradient
           ((16, 8, 4, 32), (4, 32, 64), (((3, 2), (1, 0)), none)),      # einsum("bqhd,hde->bqe")
           ((16, 8, 4, 32), (64, 4, 32), (((2, 3), (1, 2)), none)),      # its input gradient
           ((8, 64, 16), (32, 8, 64), (((0, 1), (1, 2)), none)),
           ((16, 8, 4, 32), (16, 8, 4, 32), (((3,), (3,)), ((0, 2), (0, 2)))),  # bqhd,bkhd->bhqk
           ((16, 4, 8, 8), (16, 8, 4, 32), (((3,), (1,)), ((0, 1), (0, 2)))),  # bhqk,bkhd->bhqd
           ((16, 8, 4, 32), (16, 4, 8, 8), (((1,), (3,)), ((0, 2), (0, 1))))]
  for dtype in (jnp.float32, jnp.bfloat16):
    for lhs, rhs, dims in forms:
      a = jax.random.normal(jax.random.key(0), lhs).astype(dtype)
      b = jax.random.normal(jax.random.key(1), rhs).astype(dtype)
      f = lambda u, v, dims=dims: jax.lax.dot_general(u, v, dims)
      rewritten = lambda u, v, f=f: jaxpr_eval.call_with_matched_dots(f, u, v,
                                                                      rules=backend_mosaic_tpu.EVAL_RULES)
      for eqn in _dots(jax.make_jaxpr(rewritten)(a, b).jaxpr):
        (lc, _), (lb, _) = eqn.params["dimension_numbers"]
        assert len(lc) == 1 and len(lb) <= 1, (lhs, rhs, dims, eqn)
        assert eqn.outvars[0].aval.dtype == jnp.float32, (lhs, rhs, dims, eqn)
      want = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims)
      got = rewritten(a, b)
      assert got.dtype == dtype and got.shape == want.shape
      tol = 1e-5 if dtype == jnp.float32 else 1e-2
      np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=tol, atol=tol * 10)


# --- multi-head attention as libraries write it ------------------------------------


def _library(block):
  """Skips where the library a style is written with is not installed."""
  style = compile_check.ATTENTION[block]
  if style != "einsum":
    pytest.importorskip(style)


@pytest.mark.parametrize("block", sorted(compile_check.ATTENTION))
def test_attention_as_libraries_write_it_runs_the_tpu_kernels(block):
  _library(block)
  """Rows and heads both batch axes, heads projected by `DenseGeneral` (Flax)
  or per token (Equinox): the TPU's forward and backward kernels take them
  (rewritten dots), with a VMEM limit from what the backward keeps alive."""
  plans, text, caught = _plans(block, 128, "bfloat16", grad=True, batch=256, platform="tpu")
  assert not plans["forward"].problems and not plans["backward"].problems, plans
  assert text.count(lowering.kernel_marker("tpu")) >= 2
  assert not [m for m in caught if "pallas_loop" in m]
  backward = plans["backward"]
  live = backward.footprint.peak_live_bytes(backend_mosaic_tpu.padded_bytes)
  assert live > 8 * backward.footprint.largest_row_value_bytes  # attention keeps more alive
  assert backward.config.estimate["vmem_bytes"] >= live


def test_attention_declined_by_the_gpu_falls_back_or_raises():
  _library("attention_flax")
  notices._warned.clear()
  plans, text, caught = _plans("attention_flax", 128, "bfloat16", grad=True, batch=256)
  assert any("a batched dot" in p for p in plans["forward"].problems)
  assert lowering.kernel_marker("cuda") not in text
  assert any("triton forward kernel cannot run this step" in m for m in caught)
  with pytest.raises(ValueError, match="triton forward kernel cannot run this step"):
    _plans("attention_flax", 128, "bfloat16", grad=True, batch=256, implementation="pallas")


@pytest.mark.parametrize("style", attention.STYLES)
def test_attention_in_interpret_mode_matches_the_reference(style):
  """Interpret mode evaluates the step as the TPU kernel does (the rewritten
  dots), forward and gradient, against the oracle."""
  if style != "einsum":
    pytest.importorskip(style)
  step, params, h0, x, options = attention.make(style, 11, 32, heads=4, tokens=5)
  n = cases.counts("ragged", 11, 3)
  loss = lambda it, p, h: cases.tree_sum(it(step, p, h, x, iters=n, max_iters=3, **options))
  run = functools.partial(pallas_loop.iterate,
                          options=pallas_loop.Options(implementation="pallas", block_rows=8))
  got = jax.value_and_grad(functools.partial(loss, run), argnums=(0, 1))(params, h0)
  want = jax.value_and_grad(functools.partial(loss, reference.iterate), argnums=(0, 1))(params, h0)
  oracle.assert_trees_close(got, want, what=f"{style} attention")


def test_mosaic_declines_a_16_bit_scalar_computed_in_the_kernel():
  """Mosaic makes scalars of 32-bit values only: a bfloat16 scalar parameter
  (and its gradient) is declined with the reason (XLA runs it), not a
  compiler error; a scalar of constants is folded while tracing."""
  notices._warned.clear()
  step = lambda p, h, x: jnp.tanh(h * p[0] + x) / jnp.sqrt(16.0).astype(h.dtype)
  params = (jnp.asarray(0.5, jnp.bfloat16),)
  h0 = jnp.ones((256, 128), jnp.bfloat16)
  loss = lambda p, h: cases.tree_sum(pallas_loop.iterate(step, p, h, h0, max_iters=3))
  with dispatch.observe_plans() as seen, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = lowering.export_text(jax.value_and_grad(loss), params, h0, platform="tpu")
  plans = {what: p for what, name, p in seen if name == "mosaic_tpu"}
  (problem,) = plans["forward"].problems
  assert "a shared operand is a bfloat16 scalar" in problem
  assert any("computes a bfloat16 scalar (reduce_sum" in p for p in plans["backward"].problems)
  assert any("mosaic_tpu backward kernel cannot run this step" in str(m.message) for m in caught)
  assert lowering.kernel_marker("tpu") not in text
  # The same step with a float32 scalar runs both kernels.
  params = (jnp.asarray(0.5, jnp.float32),)
  f32 = lambda a: a.astype(jnp.float32)
  step32 = lambda p, h, x: (jnp.tanh(f32(h) * p[0] + f32(x)) / jnp.sqrt(16.0)).astype(h.dtype)
  loss = lambda p, h: cases.tree_sum(pallas_loop.iterate(step32, p, h, h0, max_iters=3))
  text = lowering.export_text(jax.value_and_grad(loss), params, h0, platform="tpu")
  assert text.count(lowering.kernel_marker("tpu")) == 2


def test_bool_reshapes_and_broadcasts_go_through_int32():
  # ACT's per-token flags expanded onto the state: libtpu 0.0.42.1 casts no
  # bool vector [R, 8] to [R, 8, 1]; the rule moves words instead of flags.
  def f(flags, state):
    return jnp.where(flags[..., None], state, -state), jnp.broadcast_to(flags[:, :1], (5, 8))

  flags = jnp.arange(40).reshape(5, 8) % 3 == 0
  state = jnp.arange(5 * 8 * 4, dtype=jnp.float32).reshape(5, 8, 4)
  closed = jax.make_jaxpr(f)(flags, state)
  rules = jaxpr_eval.Rules(int32_bool_shapes=True)
  assert backend_mosaic_tpu.EVAL_RULES.int32_bool_shapes
  got = jaxpr_eval.eval_jaxpr(closed.jaxpr, closed.consts, [flags, state], rules=rules)
  want = f(flags, state)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(g, w)


def _tpu_plans(step, params, h0):
  """The TPU plans of `jax.value_and_grad` of a sum of `iterate`'s output
  (exported for a TPU, not compiled), the warnings, and the kernels lowered."""
  notices._warned.clear()
  loss = lambda p, h: cases.tree_sum(jax.tree.map(
      lambda a: a.astype(jnp.float32), pallas_loop.iterate(step, p, h, None, max_iters=3)))
  with dispatch.observe_plans() as seen, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = lowering.export_text(jax.value_and_grad(loss), params, h0, platform="tpu")
  plans = {what: p for what, name, p in seen if name == "mosaic_tpu"}
  return plans, [str(m.message) for m in caught], text.count(lowering.kernel_marker("tpu"))


@pytest.mark.parametrize("lhs,rhs,dims", [
    ((16, 8), (8,), (((1,), (0,)), ((), ()))),            # matrix-vector (ACT's head)
    ((8,), (8, 5), (((0,), (0,)), ((), ()))),             # vector-matrix
    ((16, 4, 8), (8,), (((2,), (0,)), ((), ()))),         # per-token head
    ((16,), (8,), (((), ()), ((), ()))),                  # outer product (its gradient)
    ((16, 8), (16,), (((0,), (0,)), ((), ()))),           # the head's weight gradient
    ((16, 4, 8), (16, 4, 1), (((0, 1), (0, 1)), ((), ()))),  # Dense(1)'s, [R, T, W]
    ((3, 4, 5), (5, 4), (((2, 1), (0, 1)), ((), ()))),    # contracted out of order
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vector_dots_are_a_multiply_and_a_sum(lhs, rhs, dims, dtype):
  """Mosaic's `vector_dots` rule (`jaxpr_eval._vector_dot`) computes the dots
  Mosaic TPU does not compile (found compiling `examples/act.py` deviceless)
  as a broadcast multiply and a sum: the dot's value, its shape and dtype."""
  k = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(k[0], lhs).astype(dtype)
  b = jax.random.normal(k[1], rhs).astype(dtype)
  f = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
  closed = jax.make_jaxpr(f)(a, b)
  assert jaxpr_eval.is_vector_dot(closed.jaxpr.eqns[-1])
  (got,) = jaxpr_eval.eval_jaxpr(closed.jaxpr, closed.consts, [a, b],
                                 rules=backend_mosaic_tpu.EVAL_RULES)
  want = f(a, b)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_mosaic_runs_act_heads_written_as_matrix_vector_products():
  """ACT's halting head `s @ w_h` (w_h of shape [W]) failed to compile for a
  v5e (libtpu 0.0.42.1 and 0.0.48.1): a matrix-vector product forward, an
  outer product in its gradient, and a Dense(1) head on a [R, T, W] state in
  the gradient's merged contraction. Computed as a multiply and a sum
  (`vector_dots`), both kernels take them; batched products are not touched."""
  w = {"w": jnp.full((32, 32), 0.05), "v": jnp.full((32,), 0.1)}
  h0 = (jnp.ones((256, 32)), jnp.zeros((256,)))
  matvec = lambda p, h, x: (jnp.tanh(h[0] @ p["w"]), jax.nn.sigmoid(h[0] @ p["v"]))
  plans, _, kernels = _tpu_plans(matvec, w, h0)
  assert not plans["forward"].problems and not plans["backward"].problems and kernels == 2
  h3 = (jnp.ones((256, 8, 32)), jnp.zeros((256, 8)))
  dense1 = lambda p, h, x: (jnp.tanh(h[0] @ p["w"]), (h[0] @ p["v"][:, None])[..., 0])
  plans, _, kernels = _tpu_plans(dense1, w, h3)
  assert not plans["forward"].problems and not plans["backward"].problems and kernels == 2
  # In interpret mode (the TPU's rules) the kernels match the reference.
  got = pallas_loop.iterate(matvec, w, h0, None, max_iters=3,
                            options=pallas_loop.Options(implementation="pallas", interpret=True))
  want = reference.iterate(matvec, w, h0, None, max_iters=3)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
  jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(jnp.einsum("rmd,rd->rm", a, b))))(
      jnp.ones((8, 4, 16)), jnp.ones((8, 16))).jaxpr
  assert not any(jaxpr_eval.is_vector_dot(e) for e in jaxpr.eqns)
