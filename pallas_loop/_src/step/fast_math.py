"""tanh and logistic in the GPU kernels: the hardware's approximations.

Pallas' Triton lowering computes a float32 `tanh` with libdevice's
`__nv_tanhf` and `logistic` as `1 / (1 + exp(-x))` with `__nv_expf` and an
IEEE division: about 15 and 20 instructions an element, which on an H200
were most of a tanh RNN's or GRU's loop trip (`benchmarks/compile_report.md`).
XLA's own GPU code for the same operations is cheaper (a rational tanh; a
logistic from the `ex2.approx` and `rcp.approx` instructions). Here:

* `logistic` of a float32 is `1 / (1 + 2^(-x log2(e)))` with `ex2.approx.ftz`
  and `rcp.approx.ftz`: XLA's GPU formula, a few units in the last place of
  float32 (PTX ISA: `ex2.approx` relative error 2^-22, `rcp.approx` 1 ulp;
  the product `x log2(e)` rounds too, as in XLA). Always, on Triton.
* `tanh` of a float32 is the hardware's `tanh.approx.f32` (one MUFU.TANH,
  sm_75+) where every floating leaf of the carried state is 16-bit
  (`for_state`): its documented maximum relative error, 2^-11, is a quarter
  of bfloat16's rounding (2^-9) and at most float16's, so a tanh that is
  rounded to the state's dtype stays within one unit in the last place of
  the correctly rounded value; errors reaching the state through other
  arithmetic are absolute, at most 2^-11 times the tanh's weight. A float32
  (or wider) state keeps libdevice's tanh.
* A 16-bit `tanh` or `logistic` (which Triton's lowering rejects: no bf16
  division, no bf16 `math.tanh`) is computed in float32 and rounded back, as
  XLA does.

Interpret mode has no PTX: `jaxpr_eval.Rules.emulate_fast_math` computes
the same formulas in jnp, with the approximate tanh at its documented worst
case (`tanh(x) (1 + 2^-11)`, clipped to [-1, 1]), so CPU tests check the
tolerances against the largest error the hardware may make, not against an
exact tanh.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import tree_util
import jax.numpy as jnp

# PTX ISA, `tanh.approx.f32`: "maximum relative error ... 2^-11".
TANH_APPROX_RELATIVE_ERROR = 2.0 ** -11

_LOGISTIC_F32 = ("{ .reg .f32 t;\n"
                 "mul.f32 t, $1, 0fBFB8AA3B;\n"    # -x log2(e)
                 "ex2.approx.ftz.f32 t, t;\n"
                 "add.f32 t, t, 0f3F800000;\n"     # 1 + e^-x
                 "rcp.approx.ftz.f32 $0, t; }")
_TANH_F32 = "tanh.approx.f32 $0, $1;"

PRIMITIVES = ("tanh", "logistic")


def sixteen_bit(h: Any) -> bool:
  """Whether every floating leaf of the state `h` (arrays or avals) is a
  16-bit float, and there is at least one.

  Example:
    >>> sixteen_bit({"h": jnp.zeros(2, jnp.bfloat16), "n": jnp.zeros(2, jnp.int32)})
    True
  """
  floats = [jnp.dtype(a.dtype) for a in tree_util.tree_leaves(h)
            if jnp.issubdtype(a.dtype, jnp.floating)]
  return bool(floats) and all(d.itemsize == 2 for d in floats)


def applies(primitive: str, x: Any, approx_tanh: bool) -> bool:
  """Whether `apply` replaces `primitive` (one of `PRIMITIVES`) on `x`."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return False
  if jnp.dtype(x.dtype).itemsize == 2:
    return True  # Triton has no 16-bit lowering: computed in float32
  return jnp.dtype(x.dtype) == jnp.float32 and (primitive == "logistic" or approx_tanh)


def apply(primitive: str, x: jax.Array, *, approx_tanh: bool, emulate: bool) -> jax.Array:
  """`primitive` ("tanh" or "logistic") of `x` as the GPU kernel computes it.

  Args:
    primitive: the primitive's name; `applies(primitive, x, approx_tanh)`.
    x: its operand.
    approx_tanh: float32 tanh by `tanh.approx.f32` (else libdevice's).
    emulate: jnp in place of PTX (interpret mode), the approximate tanh at
      its documented worst case.

  Returns:
    The result, in `x`'s dtype.
  """
  if jnp.dtype(x.dtype).itemsize == 2:
    return apply(primitive, x.astype(jnp.float32), approx_tanh=approx_tanh,
                 emulate=emulate).astype(x.dtype)
  if primitive == "tanh":
    if not approx_tanh:
      return jnp.tanh(x)
    if emulate:
      return jnp.clip(jnp.tanh(x) * (1 + TANH_APPROX_RELATIVE_ERROR), -1.0, 1.0)
    return _inline_asm(_TANH_F32, x)
  if emulate:
    return 1.0 / (1.0 + jnp.exp2(x * -1.4426950408889634))
  return _inline_asm(_LOGISTIC_F32, x)


def _inline_asm(asm: str, x: jax.Array) -> jax.Array:
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  [y] = plgpu.elementwise_inline_asm(asm, args=[x], constraints="=f,f", pack=1,
                                     result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape,
                                                                               x.dtype)])
  return y
