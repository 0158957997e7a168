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


def eval_jaxpr(jaxpr, consts, args):
  """Like `jax.core.eval_jaxpr(jaxpr, consts, *args)`, with matched dots."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, a in zip(jaxpr.constvars, consts):
    env[v] = a
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    sub = eqn.params.get("jaxpr")
    if eqn.primitive.name in _INLINED and isinstance(sub, jex_core.ClosedJaxpr):
      outs = eval_jaxpr(sub.jaxpr, sub.consts, invals)
    else:
      if eqn.primitive.name == "dot_general":
        dtypes = [np.dtype(a.dtype) for a in invals]
        if dtypes[0] != dtypes[1]:
          wide = max(dtypes, key=lambda d: d.itemsize)
          invals = [a.astype(wide) for a in invals]
      bind = eqn.primitive.get_bind_params(eqn.params)
      # (subfuns, params) before JAX 0.11, params from 0.11 on.
      subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
      with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def call_with_matched_dots(fn, *args):
  """`fn(*args)`, traced and re-evaluated with single-dtype dot operands."""
  avals = tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*avals)
  outs = eval_jaxpr(closed.jaxpr, closed.consts, tree_util.tree_leaves(args))
  return tree_util.tree_unflatten(tree_util.tree_structure(out_shape), outs)
