"""`pallas_loop.testing`: the checks pass on good blocks and catch planted bugs."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import pallas_loop
from pallas_loop import testing
from benchmarks import blocks

B, D, MAX_ITERS = 11, 8, 4
COUNTS = jnp.array([0, 1, 4, 2, 3, 4, 1, 0, 2, 4, 3], jnp.int32)


def _problem(name, batch=B, dtype=jnp.float32):
  return blocks.make(name, batch, D, dtype)


# ---------------------------------------------------------------- good blocks


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("block", ["tanh_rnn", "lstm"])
def test_good_block_passes(block, implementation):
  step, params, h0, x = _problem(block)
  testing.check_row_independence(step, params, h0, x)
  options = pallas_loop.Options(implementation=implementation, block_rows=8)
  report = testing.check_against_reference(step, params, h0, x, iters=COUNTS,
                                           max_iters=MAX_ITERS, options=options)
  assert report.gradients_compared
  names = [c.name for c in report.comparisons]
  n_state = len(jax.tree.leaves(h0))
  # Every output leaf and every gradient leaf (params, h0, x) was compared.
  assert len(names) == n_state + len(jax.tree.leaves(params)) + n_state + 1, names
  assert all(c.ok and c.max_abs <= 1e-5 for c in report.comparisons), str(report)
  assert any(n.startswith("gradient w.r.t. params") for n in names)


def test_good_block_without_x_bf16_and_halting():
  """x=None; bfloat16 state with its own tolerances; tol goes to both sides."""
  w = (jax.random.normal(jax.random.key(1), (D, D)) * 0.3).astype(jnp.bfloat16)
  step = lambda p, h, x: jnp.tanh(jnp.dot(h, p, preferred_element_type=jnp.float32)).astype(h.dtype)
  h0 = jax.random.normal(jax.random.key(2), (B, D)).astype(jnp.bfloat16)
  testing.check_row_independence(step, w, h0)
  report = testing.check_against_reference(step, w, h0, iters=COUNTS, max_iters=MAX_ITERS,
                                           tol=1e-2)
  by_name = {c.name: c for c in report.comparisons}
  assert set(by_name) == {"output h", "info.steps", "info.halted",
                          "gradient w.r.t. params", "gradient w.r.t. h0"}
  assert by_name["output h"].rtol == testing.default_tolerance(jnp.bfloat16)[0]
  assert by_name["info.steps"].rtol == 0  # counts compared exactly


def test_default_tolerance_by_dtype():
  f32, bf16 = testing.default_tolerance(jnp.float32), testing.default_tolerance(jnp.bfloat16)
  assert f32[0] < bf16[0] and f32[1] < bf16[1]
  assert testing.default_tolerance(jnp.int32) == (0.0, 0.0)


# ---------------------------------------------------------------- planted bugs


def _corrupt_row(leaf_index, row, amount):
  """A wrapper of `iterate` that shifts one row of one output leaf (forward bug)."""
  real = pallas_loop.iterate

  @functools.wraps(real)  # keeps iterate's signature, which the check inspects
  def buggy(*args, **kw):
    h, info = real(*args, **kw)
    leaves, tree = jax.tree.flatten(h)
    leaves[leaf_index] = leaves[leaf_index].at[row].add(amount)
    return jax.tree.unflatten(tree, leaves), info

  return buggy


@jax.custom_vjp
def _double_grad_of_row_3(a):
  return a


_double_grad_of_row_3.defvjp(lambda a: (a, None),
                             lambda _, g: (g.at[3].multiply(2.0),))


def _corrupt_h0_gradient():
  """A wrapper of `iterate` whose forward is right but whose h0 gradient is
  doubled at row 3 (a backward bug the forward cannot show)."""
  real = pallas_loop.iterate

  @functools.wraps(real)
  def buggy(step, params, h0, x=None, **kw):
    return real(step, params, jax.tree.map(_double_grad_of_row_3, h0), x, **kw)

  return buggy


def test_detects_forward_difference_names_leaf_and_row(monkeypatch):
  step, params, h0, x = _problem("lstm")
  monkeypatch.setattr(testing.iterate_lib, "iterate", _corrupt_row(1, 6, 0.5))
  with pytest.raises(AssertionError) as e:
    testing.check_against_reference(step, params, h0, x, iters=COUNTS, max_iters=MAX_ITERS,
                                    grads=False, options=pallas_loop.Options(implementation="xla"))
  msg = str(e.value)
  assert "output h[1] (float32[11, 8]): 1 of 11 rows differ (rows 6)" in msg, msg
  assert "max abs err 0.5" in msg and "output h[0]" not in msg, msg
  assert "options=Options(implementation='xla')" in msg


def test_detects_gradient_difference(monkeypatch):
  step, params, h0, x = _problem("lstm")
  monkeypatch.setattr(testing.iterate_lib, "iterate", _corrupt_h0_gradient())
  with pytest.raises(AssertionError) as e:
    testing.check_against_reference(step, params, h0, x, iters=COUNTS, max_iters=MAX_ITERS,
                                    options=pallas_loop.Options(implementation="xla"))
  msg = str(e.value)
  # Both state leaves (h, c) get the doubled cotangent at row 3; nothing else differs.
  assert re.search(r"gradient w\.r\.t\. h0\[0\] .*: 1 of 11 rows differ \(rows 3\)", msg), msg
  assert re.search(r"gradient w\.r\.t\. h0\[1\] .*: 1 of 11 rows differ \(rows 3\)", msg), msg
  assert "output h" not in msg and "params" not in msg, msg
  rel = float(re.search(r"h0\[0\].*max rel err ([0-9.e+-]+)", msg).group(1))
  assert 0.9 < rel < 1.1, msg  # doubled: off by 100%


def test_detects_a_block_that_mixes_rows_in_the_kernel(request):
  """A batch-mean block is rejected when iterate traces it (row_checks.py);
  a mixing that check cannot see (rows scattered to reversed positions) is
  right in the reference (whole batch), wrong on tiles, and caught here."""
  step, params, h0, x = _problem("tanh_rnn")
  kernel = pallas_loop.Options(implementation="pallas", block_rows=8)
  mixing = lambda p, h, x_: step(p, h - jnp.mean(h, axis=0), x_)
  with pytest.raises(ValueError, match=r"^step reduces over the row axis"):
    testing.check_against_reference(mixing, params, h0, x, iters=COUNTS,
                                    max_iters=MAX_ITERS, options=kernel)
  hidden = lambda p, h, x_: step(p, jnp.zeros_like(h).at[jnp.arange(h.shape[0])[::-1]].set(h), x_)
  # The TPU's kernel does not lower its `rev` and `scatter` (nor, so, does
  # interpret mode); the comparison must catch it where a kernel does.
  with pytest.raises(ValueError, match=r"mosaic_tpu forward kernel cannot run this step: "
                     r"step uses the primitive `rev`"):
    testing.check_against_reference(hidden, params, h0, x, iters=COUNTS,
                                    max_iters=MAX_ITERS, options=kernel)
  request.getfixturevalue("tpu_step_rules_lifted")
  with pytest.raises(AssertionError, match=r"output h \(float32\[11, 8\]\): \d+ of 11 rows differ"):
    testing.check_against_reference(hidden, params, h0, x, iters=COUNTS,
                                    max_iters=MAX_ITERS, options=kernel)


def test_parameter_gradient_reports_element_indices(monkeypatch):
  step, params, h0, x = _problem("tanh_rnn")
  real = pallas_loop.iterate

  @jax.custom_vjp
  def bump(w):
    return w

  bump.defvjp(lambda w: (w, None), lambda _, g: (g.at[2, 5].add(1.0),))
  monkeypatch.setattr(testing.iterate_lib, "iterate", functools.wraps(real)(
      lambda s, p, *a, **kw: real(s, (bump(p[0]),) + p[1:], *a, **kw)))
  with pytest.raises(AssertionError) as e:
    testing.check_against_reference(step, params, h0, x, iters=COUNTS, max_iters=MAX_ITERS,
                                    options=pallas_loop.Options(implementation="xla"))
  assert "gradient w.r.t. params[0] (float32[8, 8]): 1 of 64 elements differ (elements (2, 5))" \
      in str(e.value), str(e.value)


def test_options_are_routed_and_checked():
  step, params, h0, x = _problem("tanh_rnn")
  run = functools.partial(testing.check_against_reference, step, params, h0, x,
                          iters=COUNTS, max_iters=MAX_ITERS,
                          options=pallas_loop.Options(implementation="xla"))
  with pytest.raises(TypeError, match="unknown keywords \\['blockrows'\\]"):
    run(blockrows=8)
  with pytest.raises(TypeError, match="return_info"):
    run(return_info=True)
  report = run(grads=False, min_iters=2, halt=lambda p, hn, h, x_: jnp.max(jnp.abs(hn - h), axis=-1) < 0.05)
  assert not report.gradients_compared and "not compared" in str(report)
  assert "info.steps" in [c.name for c in report.comparisons]


# ---------------------------------------------------------------- row independence


def test_row_independence_catches_batch_mean():
  step, params, h0, x = _problem("tanh_rnn")
  kernel = pallas_loop.Options(implementation="pallas", block_rows=8)
  mixing = lambda p, h, x_: step(p, h - jnp.mean(h, axis=0), x_)
  with pytest.raises(AssertionError) as e:
    testing.check_row_independence(mixing, params, h0, x)
  msg = str(e.value)
  assert msg.startswith("changing row 0 of h/x changed rows 1, 2, 3, 4, 5, ... "
                        "(10 of the 10 other rows) of output h"), msg
  assert "no reduction" in msg


def test_row_independence_catches_cross_row_matmul():
  """A fixed [B, B] mixing matrix (e.g. attention over the batch)."""
  step, params, h0, x = _problem("tanh_rnn")
  mix = jnp.eye(B) + 0.1 * jnp.eye(B, k=1)   # row i reads row i + 1
  mixing = lambda p, h, x_: step(p, mix @ h, x_)
  with pytest.raises(AssertionError) as e:
    testing.check_row_independence(mixing, params, h0, x, rows=[5])
  # Only row 4 reads row 5: the message names exactly that row.
  assert str(e.value).startswith("changing row 5 of h/x changed rows 4 (1 of the 10 other "
                                 "rows) of output h"), str(e.value)


def test_row_independence_catches_permutation_dependence():
  step, params, h0, x = _problem("tanh_rnn")
  position = lambda p, h, x_: step(p, h, x_) + jnp.arange(h.shape[0], dtype=h.dtype)[:, None]
  with pytest.raises(AssertionError, match=r"(?s)permuting the rows of h/x did not permute .*"
                                           r"output h: rows \d+ \(moved to \d+\)"):
    testing.check_row_independence(position, params, h0, x)


def test_row_independence_catches_tile_size_dependence_and_shape_errors():
  step, params, lstm_h0, x = _problem("lstm")
  by_batch = lambda p, h, x_: jax.tree.map(lambda a: a * (8.0 / a.shape[0]), step(p, h, x_))
  with pytest.raises(AssertionError, match=r"(?s)step on a subset of 5 rows .*\n  output h\[0\]: rows"):
    testing.check_row_independence(by_batch, params, lstm_h0, x)
  fixed = lambda p, h, x_: (h[0] + jnp.zeros((B, D)), h[1])   # only works at B rows
  with pytest.raises(AssertionError, match="step failed on 5 of the 11 rows"):
    testing.check_row_independence(fixed, params, lstm_h0, x)


def test_row_independence_argument_errors():
  step, params, h0, x = _problem("tanh_rnn")
  with pytest.raises(ValueError, match="at least 2 rows"):
    testing.check_row_independence(step, params, h0[:1], x[:1])
  with pytest.raises(ValueError, match="outside"):
    testing.check_row_independence(step, params, h0, x, rows=[B])
  with pytest.raises(TypeError, match="shape and dtype"):
    testing.check_row_independence(lambda p, h, x_: h[:, :2], params, h0, x)


def test_row_independence_integer_and_bool_leaves():
  """Non-float state leaves are perturbed too (+1, negation) and compared exactly."""
  h = (jnp.arange(12, dtype=jnp.int32).reshape(6, 2), jnp.arange(6) % 2 == 0)
  testing.check_row_independence(lambda p, s, x_: (s[0] * 2, ~s[1]), None, h)
  with pytest.raises(AssertionError, match=r"of output h\[0\]"):
    testing.check_row_independence(lambda p, s, x_: (s[0] + jnp.sum(s[0], axis=0), s[1]), None, h)


def test_gradient_modes_are_compared_where_exact():
  """Truncated(k) gradients are compared against the reference's truncation;
  Phantom is an approximation: forward only."""
  step, params, h0, x = blocks.make("tanh_rnn", 12, 16)
  n = jnp.arange(12) % 6
  report = pallas_loop.testing.check_against_reference(
      step, params, h0, x, iters=n, max_iters=5,
      grad=pallas_loop.Truncated(2), options=pallas_loop.Options(implementation="xla"))
  assert report.gradients_compared
  report = pallas_loop.testing.check_against_reference(
      step, params, h0, x, iters=n, max_iters=5,
      grad=pallas_loop.Phantom(2), options=pallas_loop.Options(implementation="xla"))
  assert not report.gradients_compared


def test_key_is_passed_to_both():
  from pallas_loop import random as plr
  step = lambda w, h, x, key: jnp.tanh(plr.dropout(key, h @ w, 0.5) + x)
  _, params, h0, x = blocks.make("tanh_rnn", 12, 16)
  pallas_loop.testing.check_against_reference(
      step, params[0], h0, x, iters=jnp.arange(12) % 6, max_iters=5, key=jax.random.key(0))



# ---------------------------------------------------------------- the accelerators' rules


def _untied(params, h, x, *, index):
  w, b = params
  return jnp.tanh(h @ w[index] + x + b[index])


def _untied_inputs(batch=16, d=16, layers=4):
  k = jax.random.split(jax.random.key(3), 4)
  params = (0.5 * jax.random.normal(k[0], (layers, d, d)) / d ** 0.5,
            0.1 * jax.random.normal(k[1], (layers, d)))
  return params, jax.random.normal(k[2], (batch, d)), jax.random.normal(k[3], (batch, d))


def test_check_against_reference_declines_what_the_tpu_declines():
  """Untied weights: the TPU's backward kernel declines the VJP's dynamic
  slices, so the CPU check raises the same, where it used to pass."""
  params, h0, x = _untied_inputs()
  kw = dict(iters=jnp.arange(16) % 4, max_iters=4, step_index=True)
  with pytest.raises(ValueError, match=r"the Pallas mosaic_tpu backward kernel cannot run this "
                     r"step: step uses the primitive `dynamic_slice`.*interpret='gpu'"):
    testing.check_against_reference(_untied, params, h0, x, **kw)
  testing.check_against_reference(_untied, params, h0, x, grads=False, **kw)
  testing.check_against_reference(_untied, params, h0, x,
                                  options=pallas_loop.Options(implementation="xla"), **kw)


def test_interpret_names_its_target():
  with pytest.raises(ValueError, match="interpret='cuda' must be None, True, False, 'tpu' or 'gpu'"):
    pallas_loop.Options(implementation="pallas", interpret="cuda")


def test_check_compiles_reports_what_runs_where():
  params, h0, x = _untied_inputs(batch=256, d=128, layers=4)
  report = testing.check_compiles(_untied, params, h0, x, max_iters=4, step_index=True,
                                  grads=["full", pallas_loop.Truncated(2)])
  for target, backend in (("tpu", "mosaic_tpu"), ("gpu", "triton")):
    assert report.runs(target) == "kernel"
    assert report.runs(target, "full", "forward") == "kernel"
    assert report.runs(target, "full", "backward") == "XLA"
    assert report.runs(target, "Truncated(k=2)", "backward") == "XLA"
  lines = {(l.target, l.grad, l.kernel): l for l in report.lines}
  backward = lines["tpu", "full", "backward"]
  assert "`dynamic_slice`, which the Pallas mosaic_tpu lowering does not support" in backward.why
  for line in report.lines:
    # Which proof a line rests on depends on the compilers installed here.
    assert line.proof in ("compiled", "exported"), str(report)
    if line.proof == "exported":
      assert "not compiled: " in line.detail and "pip install" in line.detail
  assert "tpu full           backward XLA (step uses the primitive" in str(report)


def test_check_compiles_under_pallas_reports_the_raise():
  params, h0, x = _untied_inputs(batch=256, d=128, layers=4)
  report = testing.check_compiles(_untied, params, h0, x, max_iters=4, step_index=True,
                                  targets=["tpu"],
                                  options=pallas_loop.Options(implementation="pallas"))
  assert report.runs("tpu") == "kernel"
  (raised,) = [l for l in report.lines if l.grad == "full"]
  assert raised.runs == "raises" and "mosaic_tpu backward kernel cannot run" in raised.why


def test_check_compiles_checks_its_arguments():
  params, h0, x = _untied_inputs()
  with pytest.raises(ValueError, match="targets"):
    testing.check_compiles(_untied, params, h0, x, max_iters=2, targets=["cpu"])
  with pytest.raises(TypeError, match="grads="):
    testing.check_compiles(_untied, params, h0, x, max_iters=2, grad="full")
