"""Evaluating a traced VJP so that every dot has operands of one dtype.

A step that computes `dot(h_bf16, w_bf16, preferred_element_type=f32)` has a
VJP whose transposed dots multiply a float32 cotangent by a bfloat16 operand.
XLA and Mosaic accept mixed operand dtypes; Triton's `tt.dot` does not ("a and
b must have the same element type"). So the backward kernel traces the VJP
to a jaxpr and evaluates it here, casting the narrower dot operand to the
wider dtype (no precision is lost), inlining nested `jit` calls so that dots
inside them are seen too. The forward kernel evaluates the step this way too
(a step may itself contain a VJP: `Implicit`'s adjoint step does).

The same evaluation applies each backend's rewrites (`Rules`: what XLA's
Triton needs to compile the kernel at all, or within shared memory), feeds
outputs to sinks as soon as they are computed (the backward kernel adds each
gradient into its ref), and reads shared operands where used (`LoadOnUse`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
from jax import lax
from jax import tree_util
from jax.experimental import pallas as pl
from jax.extend import core as jex_core
import numpy as np

from pallas_loop._src.step import fast_math

_INLINED = ("jit", "pjit", "closed_call", "core_call")


@dataclasses.dataclass(frozen=True)
class Rules:
  """How a kernel evaluates a traced step: the rewrites its backend needs.

  Each rewrite but `fast_math` keeps the result (bit for bit, but for a
  dot's summation order); they only change what the backend compiler is
  given. `fast_math` computes tanh and logistic with the GPU's approximate
  instructions, within the error bounds `fast_math.py` states.

  Attributes:
    swap_transposed_dots: compute `transpose(dot(a, b))` as `dot(b, a)`
      (`_transposed_dots`); on by default for Triton, off for Mosaic, which
      compiles a dot contracted on the lhs's first axis into a kernel that
      needs far more VMEM (RESULTS.md, "Figures behind the code's choices").
    fence_transposed_operands: `_transpose_fence` (Triton).
    integer_mask_selects: `_bitwise_select` (Triton).
    split_dot_bytes: split a dot by a re-read weight into K chunks of at
      most this many bytes (`_split_dot`; Triton: 32 KB); None: never.
    merge_leading_contractions: a dot contracting the same leading axes of
      both operands (a weight gradient of a [TB, S, D] state) is computed
      on operands reshaped to 2-D (`_merged_dot`; Mosaic).
    canonical_dots: a dot with several batch axes (the rows and the heads
      of multi-head attention) or several contracted axes is computed with
      one of each, its operands' axes transposed into groups and merged
      (`_canonical_dot`; Mosaic).
    wide_accumulators: a dot of narrow floats whose result is narrow
      (`jnp.einsum` of two bfloat16 arrays) accumulates in float32 and is
      rounded once, as XLA computes it on a TPU (Mosaic).
    fast_math: tanh and logistic as `fast_math.apply` computes them
      (Triton): logistic by `ex2.approx`/`rcp.approx`, 16-bit operands in
      float32.
    approx_tanh: with `fast_math`, float32 tanh by `tanh.approx.f32`; set
      per call by `for_state` (from the state's dtypes, or from
      `Options.approx_tanh`), never by a backend.
    emulate_fast_math: `fast_math` in jnp, for interpret mode (no PTX).
    int32_bool_shapes: a reshape or broadcast of a bool array done on int32
      and compared back (`_bool_via_int32`; Mosaic: libtpu 0.0.42.1, the TPU
      machine's, fails "unsupported shape cast" on `vector<256x8xi1> ->
      vector<256x8x1xi1>`, ACT's per-token mask expanded onto the state).
    vector_dots: a dot without batch axes that has no contracted axis (an
      outer product) or an operand whose free part is one element (a
      matrix-vector product, a `Dense(1)` head's weight gradient) as a
      broadcast multiply and a sum (`_vector_dot`; Mosaic: libtpu 0.0.42.1
      rejects a matrix-vector product's reduction, no libtpu reshapes a
      [R, T] tile into its vector, and JAX's lowering of an outer product
      writes dimension numbers its own parser rejects; found compiling
      `examples/act.py`'s halting head `s @ w_h` deviceless).
    logistic_via_tanh: `logistic(x)` (`jax.nn.sigmoid`) as `0.5 * tanh(0.5
      x) + 0.5`, in float32 (Mosaic): one transcendental instead of an exp
      and a reciprocal with its refinement and special cases; the GRU's
      loop on a v5e fell from 3402 to 1749 bundles a 2048-row chunk
      (`benchmarks/tpu_bundles.py`; RESULTS.md, "TPU v5e"). An
      approximation: the v5e's float32 tanh is off by up to 4.4e-5 (XLA's
      and Mosaic's alike), this logistic by 2.2e-5 where `lax.logistic`
      is off by 1.0e-6 (measured on the chip, RESULTS.md), so a backend
      offers it and `for_state` keeps it for a call whose state is 16-bit
      (or `Options.approx_tanh=True`).
  """

  swap_transposed_dots: bool = False
  fence_transposed_operands: bool = False
  integer_mask_selects: bool = False
  split_dot_bytes: int | None = None
  merge_leading_contractions: bool = False
  canonical_dots: bool = False
  wide_accumulators: bool = False
  fast_math: bool = False
  approx_tanh: bool = False
  emulate_fast_math: bool = False
  int32_bool_shapes: bool = False
  vector_dots: bool = False
  logistic_via_tanh: bool = False


# No rewrites. Each backend holds its own rules (`Backend.eval_rules`).
PLAIN = Rules()


def for_state(rules: Rules, h: Any, approx_tanh: bool | None = None) -> Rules:
  """`rules` for a call whose carried state is `h` (arrays or avals).

  Args:
    rules: the backend's rules.
    h: the state.
    approx_tanh: `iterate`'s: None: the approximations where every
      floating leaf of the state is 16-bit (`fast_math.py` says why the GPU
      tanh's error bound then holds; the TPU's logistic through tanh is off
      by up to 2.2e-5, below a 16-bit float's rounding but 20x the float32
      logistic's 1.0e-6); True/False: always/never. Only where the backend
      offers one (`Rules.fast_math`, `Rules.logistic_via_tanh`).

  Example:
    >>> fast = Rules(fast_math=True)
    >>> for_state(fast, jax.numpy.zeros((4, 8), jax.numpy.bfloat16)).approx_tanh
    True
    >>> for_state(fast, jax.numpy.zeros((4, 8))).approx_tanh
    False
  """
  wanted = fast_math.sixteen_bit(h) if approx_tanh is None else approx_tanh
  return dataclasses.replace(rules, approx_tanh=rules.fast_math and wanted,
                             logistic_via_tanh=rules.logistic_via_tanh and wanted)


class LoadOnUse:
  """A kernel ref read where (and each time) the jaxpr uses it."""

  def __init__(self, ref: Any, shape: Sequence[int]) -> None:
    self.ref, self.shape, self.dtype = ref, tuple(shape), ref.dtype

  def load(self) -> jax.Array:
    return self.ref[...].reshape(self.shape)

  def load_leading_slice(self, start: Any, size: int) -> jax.Array | None:
    """`lax.dynamic_slice` of the leading axis (the others whole), read from
    the ref alone: `params[index]` of stacked per-step weights [T, ...]
    loads one step's weights, not all T. The ref holds the operand with its
    leading axis first (a 2-D one as [T, 1, N]: `kernel_toolkit.
    shared_operands`); None when it does not (1-D and 0-d operands)."""
    ref_shape = tuple(self.ref.shape)
    if len(self.shape) < 2 or ref_shape[0] != self.shape[0]:
      return None
    # dynamic_slice clamps the start into range; a ref read does not.
    start = jax.numpy.clip(start, 0, self.shape[0] - size)
    read = self.ref[(pl.ds(start, size),) + (slice(None),) * (len(ref_shape) - 1)]
    return read.reshape((size,) + self.shape[1:])


def _leading_slice_of_load(eqn: Any, operand: Any, read: Callable[[Any], Any]) -> Any:
  """`eqn` (a dynamic_slice) on a `LoadOnUse` operand, read as one slice of
  its ref, or None where that does not apply (a slice of trailing axes)."""
  sizes = tuple(eqn.params["slice_sizes"])
  if sizes[1:] != operand.shape[1:]:
    return None
  return operand.load_leading_slice(read(eqn.invars[1]), sizes[0])


def eval_jaxpr(jaxpr: jex_core.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
               sinks: dict[int, Callable[[Any], Any]] | None = None,
               rules: Rules = PLAIN) -> list[Any]:
  """Like `jax.core.eval_jaxpr(jaxpr, consts, *args)`, with matched dots.

  Args:
    jaxpr, consts, args: as for `jax.core.eval_jaxpr`; `consts`/`args` may
      hold `LoadOnUse` values.
    sinks: {output index: fn}: `fn(value)` is called as soon as that output
      is computed, and the output is returned as None (so it is not kept).
    rules: the backend's rewrites (`Rules`).
  """
  env: dict[Any, Any] = {}
  pending: dict[Any, Any] = {}
  for k, fn in (sinks or {}).items():
    pending.setdefault(jaxpr.outvars[k], []).append(fn)

  def flush(v: jex_core.Var | jex_core.Literal) -> None:
    for fn in pending.pop(v, ()):
      fn(read(v))

  def read(v: jex_core.Var | jex_core.Literal) -> Any:
    if isinstance(v, jex_core.Literal):
      return v.val
    val = env[v]
    return val.load() if isinstance(val, LoadOnUse) else val

  for v, a in zip(jaxpr.constvars, consts):
    env[v] = a
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  swapped = _transposed_dots(jaxpr) if rules.swap_transposed_dots else {}
  fence = rules.fence_transposed_operands
  computed = set()  # vars computed here (not inputs): may need a transpose fence
  for i, eqn in enumerate(jaxpr.eqns):
    computed.update(eqn.outvars)
    if id(eqn) in swapped.values():  # the transpose of a dot computed swapped
      env[eqn.outvars[0]] = env[eqn.invars[0]]
      flush(eqn.outvars[0])
      continue
    split = (_split_dot(eqn, env, rules)
             if eqn.primitive.name == "dot_general" and i not in swapped else None)
    if split is not None:
      env[eqn.outvars[0]] = split(read(eqn.invars[0]))
      flush(eqn.outvars[0])
      continue
    operand = (env.get(eqn.invars[0]) if eqn.invars
               and not isinstance(eqn.invars[0], jex_core.Literal) else None)
    if eqn.primitive.name == "dynamic_slice" and isinstance(operand, LoadOnUse):
      sliced = _leading_slice_of_load(eqn, operand, read)
      if sliced is not None:
        env[eqn.outvars[0]] = sliced
        flush(eqn.outvars[0])
        continue
    invals = [read(v) for v in eqn.invars]
    sub = eqn.params.get("jaxpr")
    if eqn.primitive.name in _INLINED and isinstance(sub, jex_core.ClosedJaxpr):
      outs = eval_jaxpr(sub.jaxpr, sub.consts, invals, rules=rules)
    elif (rules.fast_math and eqn.primitive.name in fast_math.PRIMITIVES
          and fast_math.applies(eqn.primitive.name, invals[0], rules.approx_tanh)):
      outs = [fast_math.apply(eqn.primitive.name, invals[0], approx_tanh=rules.approx_tanh,
                              emulate=rules.emulate_fast_math)]
    elif rules.logistic_via_tanh and eqn.primitive.name == "logistic":
      outs = [logistic_via_tanh(invals[0])]
    elif rules.int32_bool_shapes and _is_bool_shape_op(eqn):
      outs = [_bool_via_int32(eqn, invals[0])]
    elif rules.integer_mask_selects and _is_masked_select(eqn):
      outs = [_bitwise_select(*invals)]
    elif rules.vector_dots and is_vector_dot(eqn):
      lhs, rhs = _matched(invals)
      outs = [_vector_dot(eqn, lhs, rhs, rules=rules)]
    elif rules.merge_leading_contractions and merges_leading_contractions(eqn):
      lhs, rhs = _matched(invals)
      outs = [_merged_dot(eqn, lhs, rhs, rules=rules)]
    elif rules.canonical_dots and needs_canonical_form(eqn):
      lhs, rhs = _matched(invals)
      outs = [_canonical_dot(eqn, lhs, rhs, rules=rules)]
    elif i in swapped:
      if fence:
        invals = _fenced(eqn, invals, [v in computed for v in eqn.invars], swapped=True)
      outs = [_swapped_dot(eqn, *_matched(invals))]
    else:
      params = eqn.params
      narrow = None
      if eqn.primitive.name == "dot_general":
        if fence:
          invals = _fenced(eqn, invals, [v in computed for v in eqn.invars])
        invals = _matched(invals)
        params = dict(params, precision=narrow_dot_precision(params["precision"], invals))
        narrow = _narrow_result(eqn, rules)
        if narrow is not None:
          params["preferred_element_type"] = np.dtype(np.float32)
      subfuns, params = _bind_parts(eqn, params)
      folds = _folds(eqn, invals)
      if folds:
        outs = _computed_apart(functools.partial(eqn.primitive.bind, *subfuns, *invals,
                                                 **params))
      else:
        with eqn.ctx.manager:
          outs = eqn.primitive.bind(*subfuns, *invals, **params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
      if folds:  # literals in the kernel, not captured constants (weak types kept)
        outs = [np.asarray(o).item() if getattr(v.aval, "weak_type", False) else np.asarray(o)
                for o, v in zip(outs, eqn.outvars)]
      if eqn.primitive.name == "dot_general" and narrow is not None:
        outs = [outs[0].astype(narrow)]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
      flush(v)
  for v in list(pending):  # outputs that are inputs or literals
    flush(v)
  sunk = set(sinks or ())
  return [None if k in sunk else read(v) for k, v in enumerate(jaxpr.outvars)]


def _folds(eqn: jex_core.JaxprEqn, invals: Sequence[Any]) -> bool:
  """Whether `eqn` computes a scalar from constants alone, to be computed
  while tracing (`jax.ensure_compile_time_eval`) and enter the kernel as a
  constant.

  `x / jnp.sqrt(d).astype(x.dtype)` (Flax's attention scaling) traces to
  `sqrt` and `convert_element_type` of scalars: in the kernel Mosaic would
  make a bfloat16 scalar, which it cannot ("Only arrays with 32-bit element
  types can be converted to scalars", JAX 0.11.2); a bfloat16 constant it
  takes. (Only scalars, and as numpy scalars: a kernel captures no array,
  and JAX 0.10.2's Pallas not even a 0-d one, "captures constants".)
  """
  return (not list(jex_core.jaxprs_in_params(eqn.params)) and not eqn.effects
          and all(getattr(v.aval, "shape", None) == () for v in eqn.outvars)
          and not any(isinstance(a, jax.core.Tracer) for a in invals))


def _computed_apart(fn: Callable[[], Any]) -> Any:
  """`fn()` computed now, in a thread of its own.

  A folded scalar is computed while the kernel is traced, on the values
  themselves. In the caller's thread that would run under its trace and its
  mesh: a deviceless compile (`deviceless.compile_for`) sets a mesh of the
  target's topology, whose devices cannot run anything ("'Executable' object
  has no attribute 'local_devices'"). A mesh (`jax.set_mesh`) and the trace
  state are thread-local, so a fresh thread computes on the default device,
  as the caller would outside any trace.
  """
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(fn).result()


def _bind_parts(eqn, params: dict) -> tuple[tuple, dict]:
  """(subfuns, params) to bind `eqn`'s primitive with `params`:
  `get_bind_params` returns both before JAX 0.11, the params alone from 0.11 on."""
  bind = eqn.primitive.get_bind_params(params)
  return bind if isinstance(bind, tuple) else ((), bind)


# Shape operations whose bool operand Mosaic may not lay out (`_bool_via_int32`).
_SHAPE_PRIMITIVES = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})


def _is_bool_shape_op(eqn) -> bool:
  return (eqn.primitive.name in _SHAPE_PRIMITIVES and len(eqn.invars) == 1
          and eqn.invars[0].aval.dtype == np.bool_)


def _bool_via_int32(eqn, operand: jax.Array) -> jax.Array:
  """The shape operation `eqn` on a bool array, done on int32 (one 32-bit
  word a flag: a shape every Mosaic version casts) and compared back."""
  subfuns, params = _bind_parts(eqn, eqn.params)
  words = lax.select(operand, lax.full(operand.shape, 1, np.int32),
                     lax.full(operand.shape, 0, np.int32))
  with eqn.ctx.manager:
    return eqn.primitive.bind(*subfuns, words, **params) != 0


def logistic_via_tanh(x: jax.Array) -> jax.Array:
  """`jax.nn.sigmoid(x)` as `0.5 * tanh(0.5 x) + 0.5`, in float32, in `x`'s
  dtype (`Rules.logistic_via_tanh`).

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.linspace(-8.0, 8.0, 9)
    >>> bool(jnp.max(jnp.abs(logistic_via_tanh(x) - jax.nn.sigmoid(x))) < 1e-6)
    True
  """
  f = x.astype(jax.numpy.float32)
  return (0.5 * jax.numpy.tanh(0.5 * f) + 0.5).astype(x.dtype)


def split_parts(k: int, n: int, itemsize: int, budget: int | None) -> int:
  """Chunks of the contracted axis K for a [K, N] weight: the fewest (a power
  of 2) whose chunk fits `budget` bytes, keeping chunks >= 16 wide (Triton's
  smallest dot dimension); 1 means no split."""
  parts = 1
  while budget and k * n * itemsize // parts > budget and k // (2 * parts) >= 16:
    parts *= 2
  return parts


def _split_dot(eqn: jex_core.JaxprEqn, env: dict[Any, Any],
               rules: Rules) -> Callable[[jax.Array], jax.Array] | None:
  """`dot(x, w)` as a sum over chunks of K when `w` is re-read from a ref.

  Returns a function of the row operand, or None where this does not apply.
  Triton loads a weight through registers into shared memory whole, which
  overflows both for a large weight. Read in K chunks, each dot stages one chunk
  (`Rules.split_dot_bytes`), and the chunks' products are summed in the
  dot's accumulator dtype.
  """
  if not rules.split_dot_bytes:
    return None
  x_var: Any
  x_var, w_var = eqn.invars
  w = None if isinstance(w_var, jex_core.Literal) else env.get(w_var)
  if not isinstance(w, LoadOnUse) or len(w.shape) != 2 or tuple(w.ref.shape) != w.shape:
    return None
  (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
  if lb or tuple(lc) != (1,) or tuple(rc) not in ((0,), (1,)) or len(x_var.aval.shape) != 2:
    return None
  axis = rc[0]  # the weight's contracted axis (1: used transposed)
  k, n = w.shape[axis], w.shape[1 - axis]
  itemsize = max(np.dtype(w.dtype).itemsize, np.dtype(x_var.aval.dtype).itemsize)
  parts = split_parts(k, n, itemsize, rules.split_dot_bytes)
  if parts == 1:
    return None
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  chunk = k // parts
  dims = (((1,), (axis,)), ((), ()))
  preferred = eqn.params.get("preferred_element_type")
  precision = eqn.params.get("precision")

  def run(x: jax.Array) -> jax.Array:
    total = None
    for c, piece in enumerate(jax.numpy.split(x, parts, axis=1)):
      rows = pl.ds(c * chunk, chunk)
      w_chunk = w.ref[rows, :] if axis == 0 else w.ref[:, rows]
      a, b = _matched([piece, w_chunk])
      with eqn.ctx.manager:
        part = jax.lax.dot_general(a, b, dims, precision=narrow_dot_precision(precision, (a, b)),
                                   preferred_element_type=preferred)
      total = part if total is None else total + part
    assert total is not None  # parts >= 2
    return total

  return run


def _free_axes(shape: tuple, contracted: Sequence[int]) -> list[int]:
  return [i for i in range(len(shape)) if i not in contracted]


def is_vector_dot(eqn: jex_core.JaxprEqn) -> bool:
  """Whether `eqn` is a dot without batch axes that `_vector_dot` computes:
  no contracted axis, or an operand whose free axes hold one element."""
  if eqn.primitive.name != "dot_general":
    return False
  (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
  if lb:
    return False
  if not lc:
    return True
  shapes = [v.aval.shape for v in eqn.invars]  # type: ignore[attr-defined]
  return any(math.prod(shape[i] for i in _free_axes(shape, c)) == 1
             for shape, c in zip(shapes, (lc, rc)))


def _vector_dot(eqn: jex_core.JaxprEqn, lhs: jax.Array, rhs: jax.Array,
                rules: Rules = PLAIN) -> jax.Array:
  """`eqn` (an `is_vector_dot`) as a broadcast multiply and a sum, in the
  dot's accumulation dtype: the same sum of the same products as the dot,
  in another order. An outer product is the multiply alone; otherwise the
  operand with a one-element free part is laid along the other's contracted
  axes and the product summed over them."""
  (lc, rc), _ = eqn.params["dimension_numbers"]
  out_aval: Any = eqn.outvars[0].aval
  narrow = _narrow_result(eqn, rules)
  acc = (np.dtype(np.float32) if narrow is not None
         else np.dtype(eqn.params.get("preferred_element_type") or out_aval.dtype))
  a, b = lhs.astype(acc), rhs.astype(acc)
  with eqn.ctx.manager:
    if not lc:
      out = a.reshape(a.shape + (1,) * b.ndim) * b.reshape((1,) * a.ndim + b.shape)
    else:
      # `vec`: the operand whose free part is one element; `mat`: the other.
      if math.prod(b.shape[i] for i in _free_axes(b.shape, rc)) == 1:
        mat, vec, mc, vc = a, b, tuple(lc), tuple(rc)
      else:
        mat, vec, mc, vc = b, a, tuple(rc), tuple(lc)
      # vec's contracted axes in the order of the mat axes they pair with,
      # its one-element free part last, reshaped onto mat's axes (1 on the
      # free ones). The sum leaves mat's free axes in order, which the
      # dot's result holds (with vec's one-element part reshaped in).
      pairs = sorted(zip(mc, vc))
      shape = [1] * mat.ndim
      for m, v_axis in pairs:
        shape[m] = vec.shape[v_axis]
      v = jax.numpy.transpose(vec, [v_axis for _, v_axis in pairs] + _free_axes(vec.shape, vc))
      out = jax.numpy.sum(mat * v.reshape(shape), axis=mc)
    out = out.reshape(out_aval.shape)
  return out.astype(out_aval.dtype)


def merges_leading_contractions(eqn: jex_core.JaxprEqn) -> bool:
  """Whether `eqn` is a dot contracting axes 0..k-1 (k >= 2) of both operands."""
  if eqn.primitive.name != "dot_general":
    return False
  (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
  lead = tuple(range(len(lc)))
  return not lb and len(lc) >= 2 and tuple(lc) == lead and tuple(rc) == lead


def _merged_dot(eqn: jex_core.JaxprEqn, lhs: jax.Array, rhs: jax.Array,
                rules: Rules = PLAIN) -> jax.Array:
  """A dot contracting the leading axes of both operands, as a 2-D dot.

  libtpu's Mosaic (0.0.48.1) reshapes such operands to the wrong element
  count and aborts the process ("Check failed: new_num_elements ==
  num_elements()"): the weight gradient of `einsum("bld,de->ble")`. Merged
  into one contracted axis, the same sum compiles.
  """
  k = len(eqn.params["dimension_numbers"][0][0])
  lead = int(np.prod(lhs.shape[:k]))
  a, b = lhs.reshape((lead, -1)), rhs.reshape((lead, -1))
  out = _dot(eqn, a, b, (((0,), (0,)), ((), ())), rules)
  return out.reshape(eqn.outvars[0].aval.shape)  # type: ignore[attr-defined]


def _narrow_result(eqn: jex_core.JaxprEqn, rules: Rules) -> Any:
  """The dtype of `eqn`'s (a dot's) result where `rules` accumulate it in
  float32 and round it once (`Rules.wide_accumulators`), else None."""
  out = np.dtype(eqn.outvars[0].aval.dtype)  # type: ignore[attr-defined]
  if (rules.wide_accumulators and jax.numpy.issubdtype(out, jax.numpy.floating)
      and out.itemsize < 4):
    return out
  return None


def _dot(eqn: jex_core.JaxprEqn, a: jax.Array, b: jax.Array, dims: Any, rules: Rules) -> jax.Array:
  """`eqn`'s dot computed as `dot_general(a, b, dims)`: its precision
  (`narrow_dot_precision`) and accumulator (`Rules.wide_accumulators`)."""
  narrow = _narrow_result(eqn, rules)
  preferred = np.dtype(np.float32) if narrow is not None else eqn.params.get(
      "preferred_element_type")
  with eqn.ctx.manager:
    out = jax.lax.dot_general(a, b, dims,
                              precision=narrow_dot_precision(eqn.params.get("precision"), (a, b)),
                              preferred_element_type=preferred)
  return out if narrow is None else out.astype(narrow)


def needs_canonical_form(eqn: jex_core.JaxprEqn) -> bool:
  """Whether Mosaic needs `eqn` (a dot) rewritten by `_canonical_dot`: it has
  more than one batch axis or more than one contracted axis (those that
  contract the same leading axes of both operands are `_merged_dot`'s)."""
  if eqn.primitive.name != "dot_general" or merges_leading_contractions(eqn):
    return False
  (lc, _), (lb, _) = eqn.params["dimension_numbers"]
  return len(lb) >= 2 or len(lc) >= 2


def _grouped(x: jax.Array, batch: Sequence[int], contracted: Sequence[int],
             contracted_last: bool) -> tuple[jax.Array, int]:
  """`x` as [batch, free..., contracted] (`contracted_last`) or [batch,
  contracted, free...]: its batch axes first, merged into one (none where it
  has none), its contracted axes merged into one, in the order `contracted`
  lists them. An operand whose free and contracted axes are already in two
  groups keeps their order (no transpose), whichever group comes first.

  Returns:
    (the operand, the position of its contracted axis).
  """
  free = [i for i in range(x.ndim) if i not in batch and i not in contracted]
  lead, contracted = list(batch), list(contracted)
  if lead + free + contracted == list(range(x.ndim)):
    contracted_last = True
  elif lead + contracted + free == list(range(x.ndim)):
    contracted_last = False
  order = lead + (free + contracted if contracted_last else contracted + free)
  if order != list(range(x.ndim)):
    x = jax.numpy.transpose(x, order)
  batch_size = [int(np.prod(x.shape[:len(lead)]))] if lead else []
  free_sizes = [x.shape[i] for i in range(len(lead), x.ndim) if order[i] in free]
  k = int(np.prod([x.shape[order.index(i)] for i in contracted]))
  shape = batch_size + (free_sizes + [k] if contracted_last else [k] + free_sizes)
  return x.reshape(shape), len(batch_size) + (len(free_sizes) if contracted_last else 0)


def _canonical_dot(eqn: jex_core.JaxprEqn, lhs: jax.Array, rhs: jax.Array,
                   rules: Rules = PLAIN) -> jax.Array:
  """A dot with at most one batch axis and one contracted axis, the same sum.

  JAX 0.10.2's Mosaic rejects at lowering a dot with several batch axes
  ("'tpu.matmul' op Not implemented: Up to 1 batch dim supported": the
  scores `einsum("bqhd,bkhd->bhqk")` of multi-head attention as Flax and
  Equinox write it, whose batch axes are the rows and the heads) and one
  with several contracted axes ("lhs contracting dims must be of size 1":
  Flax's `DenseGeneral` projection from the heads, `einsum("bqhd,hde->
  bqe")`, and its gradients); libtpu 0.0.48.1 aborts on some of the latter
  ("Check failed", the lhs's contracted axes not trailing). Each operand is transposed, where
  its axes are not already in groups, to have its batch axes first and its
  contracted axes together, and each group is merged into one axis (all
  measured to compile, deviceless, with both); the result [batch, lhs
  free..., rhs free...] is the dot's, its batch axis split again.
  """
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  # Pairs in the lhs's order: `einsum("bqhd,hde->bqe")` lists (3, 2) x (1, 0),
  # the same sum as (2, 3) x (0, 1), which needs no transpose.
  pairs = sorted(zip(lc, rc))
  lc, rc = [p[0] for p in pairs], [p[1] for p in pairs]
  a, ka = _grouped(lhs, lb, lc, contracted_last=True)
  b, kb = _grouped(rhs, rb, rc, contracted_last=False)
  batch = ((0,), (0,)) if lb else ((), ())
  out = _dot(eqn, a, b, (((ka,), (kb,)), batch), rules)
  return out.reshape(eqn.outvars[0].aval.shape)  # type: ignore[attr-defined]


def narrow_dot_precision(precision: Any, operands: Sequence[Any]) -> Any:
  """A dot's precision, DEFAULT where both operands are narrow floats.

  Every dot the kernels emit (as traced, merged, swapped or split) takes its
  precision from here.

  Under `jax.default_matmul_precision("highest")` (or an explicit
  `precision=`), a traced dot carries HIGHEST whatever its operands' dtype.
  XLA ignores it for bfloat16 operands, but Mosaic lowers it to an fp32
  contraction and then rejects the bfloat16 operands ("Bad lhs type",
  measured on a TPU v5e, JAX 0.10.2). A product of two 16-bit floats
  accumulated in float32 is exact at any precision, so DEFAULT computes
  the same sum. (Passed explicitly: `lax.dot_general(precision=None)` would
  read the configured default again.)

  Example:
    >>> import jax, jax.numpy as jnp
    >>> a = jnp.ones((8, 8), jnp.bfloat16)
    >>> narrow_dot_precision(jax.lax.Precision.HIGHEST, (a, a))
    (Precision.DEFAULT, Precision.DEFAULT)
    >>> narrow_dot_precision(None, (a.astype(jnp.float32),) * 2) is None
    True
  """
  if precision is None or isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision
  dtypes = [np.dtype(a.dtype) for a in operands]
  if all(jax.numpy.issubdtype(d, jax.numpy.floating) and d.itemsize < 4 for d in dtypes):
    return (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)
  return precision


def _matched(invals: list[Any]) -> list[Any]:
  """Dot operands in one dtype: the narrower cast to the wider."""
  dtypes = [np.dtype(a.dtype) for a in invals]
  if dtypes[0] == dtypes[1]:
    return invals
  wide = max(dtypes, key=lambda d: d.itemsize)
  return [a.astype(wide) for a in invals]


def _transposed_dots(jaxpr: jex_core.Jaxpr) -> dict:
  """{index of a 2-D dot: id of the transpose that alone consumes its result}.

  JAX's VJP of `h @ w` w.r.t. `w` is `transpose(dot(ct, h))`. Triton
  transposes a value through shared memory, so for a [D, D] float32
  gradient that is D*D*4 bytes per weight; computing `dot(h, ct)` with the
  operands swapped gives the transposed result directly.
  """
  uses: dict = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal):
        uses[v] = uses.get(v, 0) + 1
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal):
      uses[v] = uses.get(v, 0) + 1
  producer = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if (eqn.primitive.name == "dot_general"
        and len(eqn.outvars[0].aval.shape) == 2  # type: ignore[attr-defined]
        and eqn.params["dimension_numbers"][1] == ((), ())):
      producer[eqn.outvars[0]] = i
  found = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
      v = eqn.invars[0]
      if v in producer and uses.get(v) == 1:
        found[producer[v]] = id(eqn)
  return found


_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32}


def _is_masked_select(eqn: jex_core.JaxprEqn) -> bool:
  """A two-way `select_n` on a boolean array (a `jnp.where` on a mask)."""
  if eqn.primitive.name != "select_n" or len(eqn.invars) != 3:
    return False
  pred: Any
  case: Any
  pred, case = eqn.invars[0].aval, eqn.invars[1].aval
  return (pred.dtype == np.bool_ and len(pred.shape) >= 2 and case.dtype != np.bool_
          and np.dtype(case.dtype).itemsize in _INT_OF_SIZE)


def _bitwise_select(pred: jax.Array, if_false: jax.Array, if_true: jax.Array) -> jax.Array:
  """`select_n(pred, if_false, if_true)` with an integer mask, bit for bit.

  Triton stages a boolean array in shared memory when two of its uses need
  different layouts (a dropout mask used on a dot's operand and on its
  result), and rejects it there ("'ttg.local_alloc' op element type bit
  width must be a multiple of 8"). As an all-ones/all-zeros integer mask the
  same selection is legal, and exact for every value (NaN and inf included).
  """
  dtype = np.dtype(if_false.dtype)
  as_int = _INT_OF_SIZE[dtype.itemsize]
  bits = lambda a: a if np.dtype(a.dtype) == as_int else jax.lax.bitcast_convert_type(a, as_int)
  mask = -(pred.astype(as_int))
  out = (bits(if_true) & mask) | (bits(if_false) & ~mask)
  return out if dtype == as_int else jax.lax.bitcast_convert_type(out, dtype)


def _transpose_fence(x: jax.Array) -> jax.Array:
  """`x`, through an identity XLA's Triton pipeline does not look through.

  Triton transposes a dot operand that is contracted on the wrong axis, and
  XLA's TritonXLAFoldTransposePass (JAX 0.11.2) pushes that transpose up
  through every elementwise op above it, copying shared subexpressions: above
  the hash RNG's rounds (`pallas_loop.random`) that takes exponential time and
  the compile never ends. A sum over a new size-1 axis is an identity it
  stops at (benchmarks/RESULTS.md, "Upstream causes").
  """
  return jax.numpy.sum(x.reshape(x.shape + (1,)), axis=-1)


def _fenced(eqn: jex_core.JaxprEqn, invals: list[Any], computed: list[bool],
            swapped: bool = False) -> list[Any]:
  """Fences the 2-D dot operands Triton will transpose, if computed in the jaxpr."""
  (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
  if lb or any(np.ndim(a) != 2 for a in invals):
    return invals
  # Triton wants [M, K] x [K, N]: an lhs contracted on axis 0, or an rhs on
  # axis 1, is transposed. Swapped, the dot is dot_general(rhs, lhs, (rc, lc)).
  if swapped:
    transposed = (tuple(lc) == (1,), tuple(rc) == (0,))
  else:
    transposed = (tuple(lc) == (0,), tuple(rc) == (1,))
  return [_transpose_fence(a) if t and c else a
          for a, t, c in zip(invals, transposed, computed)]


def _swapped_dot(eqn: jex_core.JaxprEqn, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
  """transpose(dot_general(lhs, rhs)) for a 2-D dot without batch axes."""
  (lc, rc), _ = eqn.params["dimension_numbers"]
  precision = narrow_dot_precision(eqn.params.get("precision"), (lhs, rhs))
  if isinstance(precision, tuple):
    precision = precision[::-1]
  with eqn.ctx.manager:
    return jax.lax.dot_general(
        rhs, lhs, ((tuple(rc), tuple(lc)), ((), ())), precision=precision,
        preferred_element_type=eqn.params.get("preferred_element_type"))


def call_with_matched_dots(fn: Callable[..., Any], *args: Any,
                           sinks: dict[int, Callable[[Any], Any]] | None = None,
                           rules: Rules = PLAIN) -> Any:
  """`fn(*args)`, traced and re-evaluated with single-dtype dot operands.

  `sinks` ({flat output index: fn}, see `eval_jaxpr`) consume outputs as
  they are computed; those outputs come back as None. `rules`: see `Rules`.
  """
  avals = tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*avals)
  outs = eval_jaxpr(closed.jaxpr, closed.consts, tree_util.tree_leaves(args), sinks, rules)
  return tree_util.tree_unflatten(tree_util.tree_structure(out_shape), outs)
