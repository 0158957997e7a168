"""Bad input fails at trace time with an error naming the argument and the fix."""

from __future__ import annotations

import inspect
import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import blocks
import pallas_loop
from pallas_loop._src.step import row_checks
from tests import cases

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


# The how-to-run options' own checks: tests/test_options.py.
@pytest.mark.parametrize("kw,error,match", [
    (dict(grad="implicit"), ValueError, "grad must be 'full', pallas_loop.Full"),
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


# ------------------------------------------------- errors that say what to do
#
# Each case is a mistake seen on first contact or in a port of a real model;
# the first line of the error must name the problem and the fix.

_B = 64                                  # > the XLA loop's smallest stage
_N = jnp.arange(_B, dtype=jnp.int32) % 10  # stages smaller than B run
_W = jnp.full((8, 8), 0.1)


def _first_line(excinfo) -> str:
  return str(excinfo.value).splitlines()[0]


def _per_row_closure():
  bias = jnp.ones((_B, 8))
  return dict(step=lambda p, h, x: 0.5 * h + bias, h0=jnp.ones((_B, 8)), iters=_N, max_iters=10)


def _per_row_closure_under_jit():
  def run(bias):
    return pallas_loop.iterate(lambda p, h, x: 0.5 * h + bias, None, jnp.ones((_B, 8)),
                               iters=_N, max_iters=10)
  return lambda: jax.jit(run)(jnp.ones((_B, 8)))


FIRST_CONTACT = {
    # today: add got incompatible shapes for broadcasting: (48, 8), (64, 8)
    "per-row array closed over": (
        _per_row_closure(), ValueError,
        r"^step combines per-row data from an array step closes over, whose axis 0 has the "
        r"batch's 64 rows, with the state \(add at .*\): per-row data must travel through x"),
    "per-row array in params": (
        dict(step=lambda p, h, x: h * p["scale"], params={"scale": jnp.ones((_B, 8))},
             h0=jnp.ones((_B, 8)), iters=_N, max_iters=10), ValueError,
        r"^step combines per-row data from params\['scale'\] .*: per-row data must travel "
        r"through x"),
    # today: dot_general requires contracting dimensions to have the same shape,
    # got (96,) and (100,)
    "1-D h0": (
        dict(step=lambda p, h, x: jnp.tanh(h @ p), params=jnp.eye(100),
             h0=jnp.ones((100,)), max_iters=3), ValueError,
        r"^h0 is 1-D \(float32\[100\]\) and its leading axis is the row axis, .* for one "
        r"example of 100 features pass h0\[None\] \(shape \(1, 100\)\)"),
    "1-D h0, failing to trace": (
        dict(step=lambda p, h, x: h[:, :50].sum(-1, keepdims=True) + h,
             h0=jnp.ones((100,)), max_iters=3), ValueError,
        r"^h0 is 1-D .* pass h0\[None\] .*; tracing step on it failed"),
    # today: normal accepts a single key, but was given a key array of shape
    # (64, 2) != (). Use jax.vmap for batching.
    "jax.random in a keyed step": (
        dict(step=lambda p, h, x, key: h + jax.random.normal(key, h.shape), h0=jnp.ones((_B, 8)),
             max_iters=3, key=jax.random.key(0)), ValueError,
        r"^step called jax.random on its per-row keys .*: draw with pallas_loop.random "
        r"instead, e.g. pallas_loop.random.normal\(key, h.shape\)"),
    "jax.random.split in a keyed step": (
        dict(step=lambda p, h, x, key: h + jax.random.uniform(jax.random.split(key)[0], h.shape),
             h0=jnp.ones((_B, 8)), max_iters=3, key=jax.random.key(0)), ValueError,
        r"^step called jax.random on its per-row keys"),
    # today: h0[0] has shape (): ... (use a[None] for one row)
    "Python list as h0": (
        dict(h0=[1.0, 2.0, 3.0], max_iters=3), TypeError,
        r"^h0 is a Python list of numbers \(h0\[0\] = 1.0\): pass an array, "
        r"h0=jnp.asarray\(h0\)"),
    "nested Python list as h0": (
        dict(h0=[[1.0, 2.0], [3.0, 4.0]], max_iters=3), TypeError,
        r"^h0 is a Python list of numbers \(h0\[0\]\[0\] = 1.0\): pass an array"),
    "Python list as x": (
        dict(h0=jnp.ones((2, 3)), x=[0.5, 0.5], max_iters=3), TypeError,
        r"^x is a Python list of numbers .*x=jnp.asarray\(x\)"),
    "Python float as h0": (
        dict(h0=1.0, max_iters=3), TypeError,
        r"^h0 is the Python float 1.0: pass an array with a leading row axis"),
    # today: silently wrong (the XLA loop's stages see prefixes of sorted rows)
    "row mean": (
        dict(step=lambda p, h, x: h - h.mean(0), h0=jnp.ones((_B, 8)), iters=_N, max_iters=10),
        ValueError, r"^step reduces over the row axis \(axis 0 of float32\[64, 8\]\) "
        r"\(reduce_sum at .*test_errors.py:\d+.*\): reduce over feature axes only"),
}


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", list(FIRST_CONTACT))
def test_first_contact_errors_say_what_to_do(case, implementation):
  kw, error, first_line = FIRST_CONTACT[case]
  kw = dict(dict(step=STEP, params=None, x=None), **kw)
  with pytest.raises(error) as excinfo:
    pallas_loop.iterate(kw.pop("step"), kw.pop("params"), kw.pop("h0"), kw.pop("x"), **kw,
                        options=pallas_loop.Options(implementation=implementation))
  assert re.search(first_line, _first_line(excinfo)), _first_line(excinfo)


def test_per_row_closure_under_jit_is_caught():
  with pytest.raises(ValueError) as excinfo:
    _per_row_closure_under_jit()()
  assert re.match(r"step combines per-row data from an array step closes over.*through x",
                  _first_line(excinfo))


def test_trace_error_keeps_jax_message_as_cause():
  with pytest.raises(ValueError) as excinfo:
    pallas_loop.iterate(lambda p, h, x, key: h + jax.random.normal(key, h.shape), None,
                        jnp.ones((4, 8)), max_iters=2, key=jax.random.key(0))
  assert "accepts a single key" in str(excinfo.value.__cause__)
  assert "JAX said: normal accepts a single key" in str(excinfo.value)


def test_jax_random_works_on_one_rows_key_with_per_example():
  # The hint's alternative: with per_example=True the step sees one row's
  # key, on which jax.random works (on the XLA path).
  step = lambda p, h, x, key: h + jax.random.normal(key, h.shape)
  out = pallas_loop.iterate(step, None, jnp.zeros((4, 3)), max_iters=1, key=jax.random.key(0),
                            per_example=True, options=pallas_loop.Options(implementation="xla"))
  keys = pallas_loop.random.step_keys(pallas_loop.random.key_data(jax.random.key(0)).reshape(1, 2),
                                      jnp.arange(4)[:, None], jnp.zeros((4, 1), jnp.int32))
  want = jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys)
  # Equal up to float32 rounding: XLA may fuse the sampler differently in the
  # loop than in this vmap (JAX 0.12 differs in the last bit).
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------- row mixing, by op


def _scan_mean(h):
  return lax.scan(lambda c, _: (c - c.mean(0), None), h, None, length=2)[0]


@jax.custom_jvp
def _custom_center(h):
  return h - h.mean(0)


_custom_center.defjvp(lambda primals, tangents: (_custom_center(*primals), tangents[0]))

ROW_MIXING = {
    "h.mean(0)": (lambda p, h, x: h - h.mean(0), r"reduces over the row axis"),
    "h.sum(axis=0)": (lambda p, h, x: h + h.sum(axis=0), r"reduces over the row axis"),
    "jnp.max(h)": (lambda p, h, x: h / jnp.max(h), r"reduces over the row axis"),
    "jnp.linalg.norm(h)": (lambda p, h, x: h / jnp.linalg.norm(h), r"reduces over the row axis"),
    "h.T @ h": (lambda p, h, x: h @ (h.T @ h) * 0.01, r"contracts the row axis"),
    "einsum over rows": (lambda p, h, x: h + jnp.einsum("bi,bj->ij", h, h)[0],
                         r"contracts the row axis"),
    "h @ h.T": (lambda p, h, x: jax.nn.softmax(h @ h.T, -1) @ h, r"pairs every row with every other"),
    "jnp.roll(h, 1, 0)": (lambda p, h, x: jnp.roll(h, 1, 0), r"slices the row axis by position"),
    "h[::-1]": (lambda p, h, x: h[::-1], r"reverses the row axis"),
    "h[0]": (lambda p, h, x: h + h[0], r"slices the row axis by position"),
    "h.at[0].set": (lambda p, h, x: h.at[0].set(0.0), r"scatters into the row axis by position"),
    "reshape pairing rows": (lambda p, h, x: h.reshape(-1, 16).reshape(h.shape),
                             r"reshapes the row axis of float32\[64, 8\] to \[32, 16\]"),
    "reshape(-1).sum()": (lambda p, h, x: h + h.reshape(-1).sum(), r"reduces over the row axis"),
    "jnp.cumsum(h, 0)": (lambda p, h, x: jnp.cumsum(h, 0), r"scans cumulatively along the row axis"),
    "jnp.sort(h, 0)": (lambda p, h, x: jnp.sort(h, 0), r"sorts along the row axis"),
    "jnp.concatenate rows": (lambda p, h, x: jnp.concatenate([h, h])[::2],
                             r"concatenates along the row axis"),
    "jnp.pad rows": (lambda p, h, x: jnp.pad(h, ((1, 0), (0, 0)))[1:],
                     r"pads the row axis by position"),
    "h.T as the state": (lambda p, h, x: (h @ jnp.ones((8, 64))).T,
                         r"returns a state leaf whose rows lie on axis 1"),
    "h + h.T": (lambda p, h, x: (h @ jnp.ones((8, 64)) + (h @ jnp.ones((8, 64))).T) @ jnp.ones((64, 8)),
                r"combines rows laid out on axes \[0, 1\]"),
    "inside jax.jit": (lambda p, h, x: jax.jit(lambda a: a - a.mean(0))(h), r"reduces over the row axis"),
    "inside lax.scan": (lambda p, h, x: _scan_mean(h), r"reduces over the row axis"),
    "inside lax.cond": (lambda p, h, x: lax.cond(True, lambda a: a - a.mean(0), lambda a: a, h),
                        r"reduces over the row axis"),
    "inside custom_jvp": (lambda p, h, x: _custom_center(h), r"reduces over the row axis"),
    "inside jax.checkpoint": (lambda p, h, x: jax.checkpoint(lambda a: a - a.mean(0))(h),
                              r"reduces over the row axis"),
    "jnp.arange(rows)": (lambda p, h, x: h * jnp.arange(h.shape[0], dtype=h.dtype)[:, None],
                         r"combines per-row data from an iota over the rows"),
    "in the halt criterion": (None, r"reduces over the row axis"),
}


@pytest.mark.parametrize("case", list(ROW_MIXING))
def test_row_mixing_is_caught_at_trace_time(case):
  step, problem = ROW_MIXING[case]
  kw = {}
  if step is None:  # a criterion that looks at all rows
    step = lambda p, h, x: 0.5 * h
    kw["halt"] = lambda p, h_new, h, x: jnp.abs(h_new - h).max(-1) < jnp.abs(h_new).mean()
  with pytest.raises(ValueError) as excinfo:
    pallas_loop.iterate(step, None, jnp.ones((_B, 8)), iters=_N, max_iters=10, **kw)
  line = _first_line(excinfo)
  assert re.match(r"step " + problem, line), line
  # The first line ends with the fix (after the colon that follows the op).
  assert re.search(r"\): \S", line) or "return it with the rows on axis 0" in line, line
  assert "test_errors.py" in line or "return" in line, line  # names the source line


def test_row_mixing_in_a_per_example_step_is_impossible():
  # A vmapped step (per_example=True) is row independent by construction:
  # the checker sees its batched ops (a vmapped while loop reduces its
  # predicate over the rows) and passes them.
  def step(p, h, x):
    return lax.while_loop(lambda c: c[0] < 3 + c[1][0], lambda c: (c[0] + 1, jnp.tanh(c[1])),
                          (0.0, h))[1] - h.mean()
  out = pallas_loop.iterate(step, None, jnp.ones((_B, 8)), iters=_N, max_iters=10,
                            per_example=True)
  assert out.shape == (_B, 8)


# ------------------------------------------------------ no false positives

ROW_WISE = {
    "layer norm": lambda p, h, x: (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5),
    "softmax and gelu": lambda p, h, x: jax.nn.softmax(h, -1) + jax.nn.gelu(h),
    "take_along_axis": lambda p, h, x: jnp.take_along_axis(h, jnp.argsort(h, axis=1), axis=1),
    "h.at[:, 0].set": lambda p, h, x: h.at[:, 0].set(1.0),
    "h[:, idx]": lambda p, h, x: h[:, jnp.array([7, 6, 5, 4, 3, 2, 1, 0])],
    "reshape within rows": lambda p, h, x: jnp.tanh(h.reshape(h.shape[0], 2, 4)).reshape(h.shape),
    "flatten rows and back": lambda p, h, x: jnp.tanh(h.reshape(-1, 4) @ jnp.eye(4)).reshape(h.shape),
    "vmap inside": lambda p, h, x: jax.vmap(lambda r: jnp.tanh(r @ _W))(h),
    "scan inside": lambda p, h, x: lax.scan(lambda c, _: (jnp.tanh(c @ _W), None), h, None, length=3)[0],
    "fori_loop inside": lambda p, h, x: lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ _W), h),
    "cond inside": lambda p, h, x: lax.cond(True, lambda a: a * 2, lambda a: a, h),
    "checkpoint inside": lambda p, h, x: jax.checkpoint(lambda a: jnp.sin(a) @ _W)(h),
    "norm over features": lambda p, h, x: h / jnp.linalg.norm(h, axis=-1, keepdims=True),
    "zeros_like and iota": lambda p, h, x: h + jnp.zeros_like(h) + jnp.arange(8.0),
    "concatenate features": lambda p, h, x: jnp.concatenate([h, x], axis=1)[:, :8],
    "x per row": lambda p, h, x: h + x,
    "one-hot of x": lambda p, h, x: h + jax.nn.one_hot(x[:, 0].astype(jnp.int32), 8),
    "params of batch width": lambda p, h, x: h @ p,  # d == B: W [64, 64]
}


def _analysis(step, params, h0, x):
  closed = jax.make_jaxpr(step)(params, h0, x)
  return row_checks.check_step_jaxpr(closed, params, h0, x)


@pytest.mark.parametrize("case", list(ROW_WISE))
def test_row_wise_ops_pass_and_are_understood(case):
  h0 = jnp.ones((_B, 64 if case == "params of batch width" else 8))
  params = jnp.eye(64) if case == "params of batch width" else None
  analysis = _analysis(ROW_WISE[case], params, h0, jnp.ones_like(h0))
  assert analysis.outputs == [row_checks.Row(0)]
  assert not analysis.unknown_primitives


@pytest.mark.parametrize("batch,d", [(24, 16), (32, 32)])
@pytest.mark.parametrize("name", sorted(blocks.BLOCKS))
def test_benchmark_blocks_pass_and_are_understood(name, batch, d):
  step, params, h0, x = blocks.make(name, batch, d)
  if "index" in inspect.signature(step).parameters:  # a block with untied per-step weights
    closed = jax.make_jaxpr(lambda p, h, x_, t: step(p, h, x_, index=t))(
        params, h0, x, jnp.int32(0))
    analysis = row_checks.check_step_jaxpr(closed, params, h0, x)
  else:
    analysis = _analysis(step, params, h0, x)
  assert all(row == row_checks.Row(0) for row in analysis.outputs)
  assert not analysis.unknown_primitives


def test_mixed_rank_case_passes():
  params = (jnp.float32(0.5), jnp.ones((8, 8)) * 0.1)
  h0 = (jnp.ones((_B,)), jnp.ones((_B, 8)), jnp.ones((_B, 2, 3)))
  analysis = _analysis(cases.mixed_rank_step, params, h0, None)
  assert analysis.outputs == [row_checks.Row(0)] * 3
  assert not analysis.unknown_primitives


def test_keyed_samplers_and_halting_criteria_pass():
  from pallas_loop import halting  # pylint: disable=g-import-not-at-top

  def step(p, h, x, key):
    h = pallas_loop.random.dropout(key, jnp.tanh(h @ _W), 0.1)
    noise = pallas_loop.random.normal(pallas_loop.random.fold_in(key, 1), h.shape)
    keep = pallas_loop.random.bernoulli(pallas_loop.random.fold_in(key, 2), 0.5, h.shape[:1])
    return h + 0.01 * noise * keep[:, None].astype(h.dtype) + 0.01 * pallas_loop.random.uniform(key, h.shape)
  out = pallas_loop.iterate(step, None, jnp.ones((_B, 8)), iters=_N, max_iters=10,
                            key=jax.random.key(1), halt=halting.relative_change(1e-3),
                            tol=1e-4)
  assert out.shape == (_B, 8)


def test_what_cannot_be_caught_is_not_flagged():
  # A callback hides its body: the checker cannot see it mixing rows (the
  # docs say so); it reports the primitive it did not model.
  step = lambda p, h, x: jax.pure_callback(lambda a: a - a.mean(0), jax.ShapeDtypeStruct(
      h.shape, h.dtype), h)
  analysis = _analysis(step, None, jnp.ones((_B, 8)), None)
  assert analysis.unknown_primitives == {"pure_callback"}
  # Rows scattered into a fresh buffer at computed positions: not modelled.
  perm = jnp.arange(_B)[::-1]
  analysis = _analysis(lambda p, h, x: jnp.zeros_like(h).at[perm].set(h), None,
                       jnp.ones((_B, 8)), None)
  assert analysis.unknown_primitives == {"scatter"}


# --- Randomness the kernels cannot take: declined, so auto falls back ------

_KEY = jax.random.key(0)


def _closes_over_typed_key(p, h, x):
  return h * p + 0.01 * jax.random.normal(_KEY, h.shape[1:])


def test_closed_over_typed_key_runs_on_xla_by_default():
  # Every platform's kernel plan is traced under jit: planning must decline
  # a typed key operand, not crash on its dtype.
  f = lambda p, h: pallas_loop.iterate(_closes_over_typed_key, p, h, max_iters=3).sum()
  want = lambda p, h: pallas_loop.iterate(_closes_over_typed_key, p, h, max_iters=3,
                                          options=pallas_loop.Options(implementation="xla")).sum()
  h0 = jnp.ones((8, 16))
  np.testing.assert_allclose(jax.jit(jax.grad(f))(0.5, h0), jax.jit(jax.grad(want))(0.5, h0),
                             rtol=1e-6)


def test_closed_over_typed_key_in_the_kernel_is_refused():
  with pytest.raises(ValueError, match=r"typed PRNG key array \(key<fry>\).*pallas_loop.random"):
    pallas_loop.iterate(_closes_over_typed_key, 0.5, jnp.ones((8, 16)), max_iters=3,
                        options=pallas_loop.Options(implementation="pallas"))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("case", ["closed-over key", "jax.random on per-row keys"])
def test_auto_falls_back_on_randomness_the_kernels_cannot_lower(platform, case):
  from pallas_loop._src import notices
  from tests import lowering
  if case == "closed-over key":
    f = lambda p, h: pallas_loop.iterate(_closes_over_typed_key, p, h, max_iters=3).sum()
    reason = "typed PRNG key"
  else:
    step = lambda p, h, x, key: h * p + jax.random.normal(key, h.shape)
    f = lambda p, h: pallas_loop.iterate(step, p, h, max_iters=3, key=jax.random.key(1),
                                         per_example=True).sum()
    # Triton has no rule for random_bits; Mosaic has one that fails on
    # an array of keys, so its plan says so.
    reason = "random_bits" if platform == "cuda" else "array of keys"
  notices._warned.clear()
  with pytest.warns(UserWarning, match=f"cannot run this step.*{reason}.*using the XLA"):
    text = lowering.export_text(jax.grad(f), 0.5, jnp.ones((16, 128)), platform=platform)
  assert lowering.kernel_marker(platform) not in text


def test_step_index_error_speaks_of_the_index():
  with pytest.raises(TypeError) as excinfo:
    pallas_loop.iterate(lambda p, h, x: h, None, H0, max_iters=2, step_index=True)
  message = str(excinfo.value)
  assert message.startswith("step must accept `index` as a keyword argument: with "
                            "step_index=True, iterate calls step(params, h, x, index=t)"), message
  assert not re.search(r"\bkey\b", message), message


def test_fallback_notice_and_refusal_outside_jit():
  """A platform's branch run op by op (`jax.grad` of an unjitted function, as
  examples/deq_training.py does) binds the notice and the refusal eagerly: the
  notice warns and passes its values (and their tangents) through, the
  refusal raises its message. Before, both had no evaluation rule (the DEQ
  example failed on the TPU with "Evaluation rule for
  'pallas_loop_fallback_notice' not implemented")."""
  from pallas_loop._src import dispatch

  message = "pallas_loop test: the notice outside jit"
  with pytest.warns(UserWarning, match="the notice outside jit"):
    out = dispatch.warn_when_lowered(message, {"a": jnp.arange(3.0)})
  np.testing.assert_array_equal(out["a"], np.arange(3.0))
  grad = jax.grad(lambda x: jnp.sum(dispatch.warn_when_lowered(message, x) ** 2))(jnp.ones(2))
  np.testing.assert_array_equal(grad, 2.0 * np.ones(2))
  with pytest.raises(ValueError, match="the refusal outside jit"):
    dispatch.raise_when_lowered("pallas_loop test: the refusal outside jit", jnp.sin,
                                jnp.ones(2))
