"""Choosing the implementation per lowering platform.

Which Pallas backend runs, with which block rules and compiler parameters,
depends on the platform being lowered for, not on `jax.default_backend()`:
a CPU machine must be able to export the GPU and TPU kernels. So the choice is
a `lax.platform_dependent` whose branches are all traced but of which only the
target platform's branch is lowered. A branch whose backend rules fail must
not raise while tracing (it would break lowering for the other platforms), so
it returns a placeholder primitive that raises (`implementation="pallas"`) or
warns once and falls back to XLA (`implementation=None`) when, and only when,
it is lowered.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
from jax import lax
from jax import tree_util
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir

from pallas_loop._src import backend as backend_lib
from pallas_loop._src import xla_forward as buckets
from pallas_loop._src import kernel_backward as bwd_kernel
from pallas_loop._src import kernel_forward as kernel
from pallas_loop._src import backend_mosaic_tpu as pallas_mosaic_tpu
from pallas_loop._src import backend_triton as pallas_triton
from pallas_loop._src import loop_reverse as vjp_window

KERNEL_NAME = "pallas_loop_iterate_fwd"

# --- A placeholder that raises when lowered --------------------------------

_unsupported_p = jex_core.Primitive("pallas_loop_unsupported")
_unsupported_p.multiple_results = True
_unsupported_p.def_abstract_eval(lambda *args, out_avals, message: out_avals)


def _unsupported_lowering(ctx, *args, out_avals, message):
  raise ValueError(message)


def _unsupported_batching(args, dims, *, out_avals, message):
  # An unbatched operand has dim None (`batching.not_mapped` is gone in JAX 0.11).
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  batched = tuple(jax.core.ShapedArray((size,) + a.shape, a.dtype) for a in out_avals)
  return _unsupported_p.bind(*args, out_avals=batched, message=message), (0,) * len(batched)


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
batching.primitive_batchers[_unsupported_p] = _unsupported_batching


def raise_when_lowered(message: str, fn, *operands):
  """Values shaped like `fn(*operands)` whose lowering raises ValueError(message)."""
  leaves, tree = tree_util.tree_flatten(jax.eval_shape(fn, *operands))
  avals = tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in leaves)
  outs = _unsupported_p.bind(*tree_util.tree_leaves(operands), out_avals=avals,
                             message=message)
  return tree_util.tree_unflatten(tree, outs)


# --- An identity that warns (once per message) when lowered ----------------

_warned: set[str] = set()
_notice_p = jex_core.Primitive("pallas_loop_fallback_notice")
_notice_p.multiple_results = True
_notice_p.def_abstract_eval(lambda *args, message: args)


def _notice_lowering(ctx, *args, message):
  if message not in _warned:
    _warned.add(message)
    warnings.warn(message, UserWarning, stacklevel=2)
  return list(args)


mlir.register_lowering(_notice_p, _notice_lowering)
batching.primitive_batchers[_notice_p] = (
    lambda args, dims, *, message: (_notice_p.bind(*args, message=message), dims))


def warn_when_lowered(message: str, tree):
  """`tree` unchanged; lowering it warns `message` once per process."""
  leaves, treedef = tree_util.tree_flatten(tree)
  return tree_util.tree_unflatten(treedef, _notice_p.bind(*leaves, message=message))


# --- Observing the plans ---------------------------------------------------

_observers: list = []


@contextlib.contextmanager
def observe_plans():
  """Collects (what, backend name, plan) for every kernel planned inside.

  For tools that report which configuration each kernel got (the compile
  report, `benchmarks/compile_check.py`). Every platform's branch is traced,
  so the plans of every backend appear, each once per trace.

  Example:
    >>> import jax.numpy as jnp, pallas_loop
    >>> f = lambda h: pallas_loop.iterate(lambda p, h, x: h * 0.5, None, h, max_iters=2,
    ...                                   implementation="pallas", interpret=True)
    >>> with observe_plans() as seen:
    ...   _ = jax.jit(f).lower(jnp.ones((16, 8)))
    >>> [(what, name) for what, name, _ in seen]
    [('forward', 'interpret')]
  """
  seen: list = []
  _observers.append(seen.append)
  try:
    yield seen
  finally:
    _observers.remove(seen.append)


# --- Choosing per platform -------------------------------------------------


def _problem_message(what, backend, problems, fallback: bool) -> str:
  listed = "; ".join(problems)
  if fallback:
    return (f"pallas_loop.iterate: the Pallas {backend.name} {what} kernel cannot "
            f"run this step ({listed}); using the XLA implementation. Pass "
            "implementation='xla' to silence this warning.")
  return (f"pallas_loop.iterate(implementation='pallas'): the Pallas "
          f"{backend.name} {what} kernel cannot run this step: {listed}. Fix the "
          "shapes as described, or use implementation='xla'.")


def _per_platform(what, plan, run_kernel, run_xla, *, implementation, interpret):
  """`f(*operands)`: the kernel on the lowering platform's backend, or XLA.

  Args:
    what: "forward" or "backward", for messages.
    plan: plan(backend, *operands) -> an object with `.problems` and
      `.config` (a `backend.KernelConfig` or None).
    run_kernel: run_kernel(plan, *operands) -> outputs.
    run_xla: run_xla(*operands) -> outputs (the same avals).
    implementation, interpret: the caller's options (see `iterate`).
  """

  def on(backend, *, fallback):
    def branch(*operands):
      p = plan(backend, *operands)
      for observe in _observers:
        observe((what, backend.name, p))
      slower = None if p.config is None else p.config.prefer_xla
      if not p.problems and not (fallback and slower):
        return run_kernel(p, *operands)
      if p.problems:
        message = _problem_message(what, backend, p.problems, fallback)
      else:
        message = (f"pallas_loop.iterate: the Pallas {backend.name} {what} kernel is "
                   f"expected to be slower than the XLA implementation here ({slower}); "
                   "using the XLA implementation. Pass implementation='pallas' to run "
                   "the kernel anyway, or implementation='xla' to silence this warning.")
      if not backend.platforms:  # interpret mode runs everywhere: fail now
        raise ValueError(message)
      if fallback:
        return warn_when_lowered(message, run_xla(*operands))
      return raise_when_lowered(message, run_xla, *operands)
    return branch

  def no_compiled_backend(*operands):
    return raise_when_lowered(
        "pallas_loop.iterate(implementation='pallas', interpret=False) needs a "
        "GPU (Triton) or TPU (Mosaic) platform; on this platform pass "
        "interpret=True (or leave interpret=None).", run_xla, *operands)

  if implementation == "xla":
    return run_xla
  if interpret is not None and interpret is not False:
    return on(backend_lib.interpret_backend(interpret), fallback=False)
  strict = implementation == "pallas"
  if strict:
    default = on(backend_lib.INTERPRET, fallback=False) if interpret is None else no_compiled_backend
  else:
    default = run_xla
  triton = on(pallas_triton.TRITON, fallback=not strict)
  mosaic = on(pallas_mosaic_tpu.MOSAIC_TPU, fallback=not strict)

  def select(*operands):
    return lax.platform_dependent(
        *operands, cuda=triton, rocm=triton, tpu=mosaic, default=default)

  return select


def forward_fn(step_fn, *, implementation, interpret, block_rows, sort_rows, residual=True):
  """The forward `f(params, consts, h0, x, counts, row_ids, halting) -> outputs`.

  Outputs are (h, residual, steps, halted), see `buckets.forward`; `row_ids`
  (int32 [B]) are the rows' indices in the caller's batch (random keys).

  Args:
    step_fn: the body (step, then the halt criterion) as a `step_fn.StepFn`.
    implementation: None (auto), "pallas" or "xla".
    interpret: None, True, False or a `pltpu.InterpretParams`.
    block_rows, sort_rows: kernel tiling options.
    residual: track each row's last residual (False when the caller does not
      ask for it: saves a reduction per step; the residual output is then 0).
  """

  def run_xla(params, consts, h0, x, counts, row_ids, halting):
    body = lambda p, h, x_, t, rows: step_fn(p, consts, h, x_, t, rows)
    return buckets.forward(body, params, h0, x, counts, row_ids, halting, residual)

  def plan(backend, params, consts, h0, x, counts, row_ids, halting):
    return kernel.plan(backend, step_fn, params, consts, h0, x, block_rows)

  def run_kernel(p, params, consts, h0, x, counts, row_ids, halting):
    return kernel.run(p, params, h0, x, counts, row_ids, halting, sort_rows=sort_rows,
                      name=KERNEL_NAME, residual=residual)

  return _per_platform("forward", plan, run_kernel, run_xla,
                       implementation=implementation, interpret=interpret)


def window_fn(step_fn, *, implementation, interpret, block_rows, sort_rows):
  """The window VJP `w(params, consts, h_start, x, t0, n, row_ids, g, bound, every)`.

  Returns (g_params, g_consts, g_h_start, g_x); see `vjp_window.py`. `bound`
  (the static bound on n) and `every` (checkpoint interval or None) are
  static; the fused backward kernel (`bwd_kernel.py`) runs where the forward
  kernel would.
  """

  def window(params, consts, h_start, x, t0, n, row_ids, g, bound, every):
    def run_xla(params, consts, h_start, x, t0, n, row_ids, g):
      step = lambda shared, h, x_, t, rows: step_fn(shared[0], shared[1], h, x_, t, rows)[0]
      (g_params, g_consts), g_h, g_x = vjp_window.backward_xla(
          step, (params, consts), h_start, x, t0, n, row_ids, g, window=bound, every=every)
      return g_params, g_consts, g_h, g_x

    def plan(backend, params, consts, h_start, x, t0, n, row_ids, g):
      return bwd_kernel.plan(backend, step_fn, params, consts, h_start, x,
                             block_rows=block_rows, bound=bound, every=every)

    def run_kernel(p, params, consts, h_start, x, t0, n, row_ids, g):
      return bwd_kernel.run(p, params, consts, h_start, x, t0, n, row_ids, g,
                            sort_rows=sort_rows)

    return _per_platform("backward", plan, run_kernel, run_xla,
                         implementation=implementation, interpret=interpret)(
                             params, consts, h_start, x, t0, n, row_ids, g)

  return window
