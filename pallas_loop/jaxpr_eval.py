"""Evaluating a traced VJP so that every dot has operands of one dtype.

A step that computes `dot(h_bf16, w_bf16, preferred_element_type=f32)` has a
VJP whose transposed dots multiply a float32 cotangent by a bfloat16 operand.
XLA and Mosaic accept mixed operand dtypes; Triton's `tt.dot` does not ("a and
b must have the same element type"). So the backward kernel traces the VJP
to a jaxpr and evaluates it here, casting the narrower dot operand to the
wider dtype (no precision is lost), inlining nested `jit` calls so that dots
inside them are seen too. The forward kernel evaluates the step this way too
(a step may itself contain a VJP: `Implicit`'s adjoint step does).
"""

from __future__ import annotations

import jax
from jax import tree_util
from jax.extend import core as jex_core
import numpy as np

_INLINED = ("jit", "pjit", "closed_call", "core_call")


class LoadOnUse:
  """A kernel ref read where (and each time) the jaxpr uses it."""

  def __init__(self, ref, shape):
    self.ref, self.shape, self.dtype = ref, tuple(shape), ref.dtype

  def load(self):
    return self.ref[...].reshape(self.shape)


def eval_jaxpr(jaxpr, consts, args, sinks=None):
  """Like `jax.core.eval_jaxpr(jaxpr, consts, *args)`, with matched dots.

  Args:
    jaxpr, consts, args: as for `jax.core.eval_jaxpr`; `consts`/`args` may
      hold `LoadOnUse` values.
    sinks: {output index: fn}: `fn(value)` is called as soon as that output
      is computed, and the output is returned as None (so it is not kept).
  """
  env = {}
  pending = {}
  for k, fn in (sinks or {}).items():
    pending.setdefault(jaxpr.outvars[k], []).append(fn)

  def flush(v):
    for fn in pending.pop(v, ()):
      fn(read(v))

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val
    val = env[v]
    return val.load() if isinstance(val, LoadOnUse) else val

  for v, a in zip(jaxpr.constvars, consts):
    env[v] = a
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  swapped = _transposed_dots(jaxpr)
  for i, eqn in enumerate(jaxpr.eqns):
    if id(eqn) in swapped.values():  # the transpose of a dot computed swapped
      env[eqn.outvars[0]] = env[eqn.invars[0]]
      flush(eqn.outvars[0])
      continue
    invals = [read(v) for v in eqn.invars]
    sub = eqn.params.get("jaxpr")
    if eqn.primitive.name in _INLINED and isinstance(sub, jex_core.ClosedJaxpr):
      outs = eval_jaxpr(sub.jaxpr, sub.consts, invals)
    elif i in swapped:
      outs = [_swapped_dot(eqn, *_matched(invals))]
    else:
      if eqn.primitive.name == "dot_general":
        invals = _matched(invals)
      bind = eqn.primitive.get_bind_params(eqn.params)
      # (subfuns, params) before JAX 0.11, params from 0.11 on.
      subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
      flush(v)
  for v in list(pending):  # outputs that are inputs or literals
    flush(v)
  sunk = set(sinks or ())
  return [None if k in sunk else read(v) for k, v in enumerate(jaxpr.outvars)]


def _matched(invals):
  """Dot operands in one dtype: the narrower cast to the wider."""
  dtypes = [np.dtype(a.dtype) for a in invals]
  if dtypes[0] == dtypes[1]:
    return invals
  wide = max(dtypes, key=lambda d: d.itemsize)
  return [a.astype(wide) for a in invals]


def _transposed_dots(jaxpr) -> dict:
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
    if (eqn.primitive.name == "dot_general" and len(eqn.outvars[0].aval.shape) == 2
        and eqn.params["dimension_numbers"][1] == ((), ())):
      producer[eqn.outvars[0]] = i
  found = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "transpose" and tuple(eqn.params["permutation"]) == (1, 0):
      v = eqn.invars[0]
      if v in producer and uses.get(v) == 1:
        found[producer[v]] = id(eqn)
  return found


def _swapped_dot(eqn, lhs, rhs):
  """transpose(dot_general(lhs, rhs)) for a 2-D dot without batch axes."""
  (lc, rc), _ = eqn.params["dimension_numbers"]
  precision = eqn.params.get("precision")
  if isinstance(precision, tuple):
    precision = precision[::-1]
  with eqn.ctx.manager:
    return jax.lax.dot_general(
        rhs, lhs, ((tuple(rc), tuple(lc)), ((), ())), precision=precision,
        preferred_element_type=eqn.params.get("preferred_element_type"))


def call_with_matched_dots(fn, *args, sinks=None):
  """`fn(*args)`, traced and re-evaluated with single-dtype dot operands.

  `sinks` ({flat output index: fn}, see `eval_jaxpr`) consume outputs as
  they are computed; those outputs come back as None.
  """
  avals = tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*avals)
  outs = eval_jaxpr(closed.jaxpr, closed.consts, tree_util.tree_leaves(args), sinks)
  return tree_util.tree_unflatten(tree_util.tree_structure(out_shape), outs)
