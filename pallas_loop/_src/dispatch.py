"""Choosing the implementation per lowering platform.

Which Pallas backend runs, with which block rules and compiler parameters,
depends on the platform being lowered for, not on `jax.default_backend()`:
a CPU machine must be able to export every accelerator's kernels. So the
choice is a `lax.platform_dependent` with a branch per lowering platform of
each compiled backend (`backends.compiled()`: this module names none), all
traced, of which only the target platform's branch is lowered. A branch
whose backend rules fail must not raise while tracing (it would break
lowering for the other platforms), so it returns a placeholder primitive
that raises (`Options(implementation="pallas")`) or warns once and falls back
to XLA (`implementation=None`, the default) when, and only when, it is
lowered.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NoReturn, Sequence

import jax
from jax import lax
from jax import tree_util
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backend_interpret
from pallas_loop._src.kernels import backends
from pallas_loop._src.kernels import kernel_backward
from pallas_loop._src.kernels import kernel_forward
from pallas_loop._src import notices
from pallas_loop._src.step import step_fn as step_fn_lib
from pallas_loop._src.xla import xla_backward
from pallas_loop._src.xla import xla_forward
from pallas_loop._src.operands import Gradients, LoopOperands, LoopOutputs
from pallas_loop._src.options import Options
from pallas_loop._src.operands import WindowOperands

# --- A placeholder that raises when lowered --------------------------------

_unsupported_p = jex_core.Primitive("pallas_loop_unsupported")
_unsupported_p.multiple_results = True
_unsupported_p.def_abstract_eval(lambda *args, out_avals, message: out_avals)


def _unsupported_lowering(ctx: Any, *args: Any, out_avals: Any, message: str) -> NoReturn:
  raise ValueError(message)


def _unsupported_batching(args: Sequence[Any], dims: Sequence[int | None], *,
                          out_avals: Sequence[Any], message: str) -> tuple[Any, tuple[int, ...]]:
  # An unbatched operand has dim None (`batching.not_mapped` is gone in JAX 0.11).
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  batched = tuple(jax.core.ShapedArray((size,) + a.shape, a.dtype) for a in out_avals)
  return _unsupported_p.bind(*args, out_avals=batched, message=message), (0,) * len(batched)


mlir.register_lowering(_unsupported_p, _unsupported_lowering)


def _unsupported_impl(*args: Any, out_avals: Any, message: str) -> NoReturn:
  # Outside `jit` (a platform's branch run op by op) the value is needed now.
  del args, out_avals
  raise ValueError(message)


_unsupported_p.def_impl(_unsupported_impl)
batching.primitive_batchers[_unsupported_p] = _unsupported_batching


def raise_when_lowered(message: str, fn: Callable[..., Any], *operands: Any) -> Any:
  """Values shaped like `fn(*operands)` whose lowering raises ValueError(message)."""
  leaves, tree = tree_util.tree_flatten(jax.eval_shape(fn, *operands))
  avals = tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in leaves)
  outs = _unsupported_p.bind(*tree_util.tree_leaves(operands), out_avals=avals,
                             message=message)
  return tree_util.tree_unflatten(tree, outs)


# --- An identity that warns (once per message) when lowered ----------------

_notice_p = jex_core.Primitive("pallas_loop_fallback_notice")
_notice_p.multiple_results = True
_notice_p.def_abstract_eval(lambda *args, message: args)


def _notice_impl(*args: Any, message: str) -> list[Any]:
  # Lowered (the user's jitted function first called) or run op by op
  # (`jax.grad` of an unjitted function runs a platform's branch eagerly):
  # either way the path is taken now, and the warning points at the user's
  # line, not at JAX's code.
  notices.warn_once_at(message, message, UserWarning, notices.user_site())
  return list(args)


def _notice_lowering(ctx: Any, *args: Any, message: str) -> list[Any]:
  del ctx
  return _notice_impl(*args, message=message)


mlir.register_lowering(_notice_p, _notice_lowering)


def _notice_jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
                message: str) -> tuple[list[Any], list[Any]]:
  return _notice_p.bind(*primals, message=message), list(tangents)


_notice_p.def_impl(_notice_impl)
ad.primitive_jvps[_notice_p] = _notice_jvp
batching.primitive_batchers[_notice_p] = (
    lambda args, dims, *, message: (_notice_p.bind(*args, message=message), dims))


def warn_when_lowered(message: str, tree: Any) -> Any:
  """`tree` unchanged; lowering it warns `message` once per process."""
  leaves, treedef = tree_util.tree_flatten(tree)
  return tree_util.tree_unflatten(treedef, _notice_p.bind(*leaves, message=message))


# --- Observing the plans ---------------------------------------------------

_observers: list = []


@contextlib.contextmanager
def observe_plans() -> Iterator[list[tuple[str, str, Any]]]:
  """Collects (what, backend name, plan) for every kernel planned inside.

  For tools that report which configuration each kernel got (the compile
  report, `benchmarks/compile_check.py`). Every platform's branch is traced,
  so the plans of every backend appear, each once per trace.

  Example:
    >>> import jax.numpy as jnp, pallas_loop
    >>> f = lambda h: pallas_loop.iterate(lambda p, h, x: h * 0.5, None, h, max_iters=2,
    ...                                   options=pallas_loop.Options(
    ...                                       implementation="pallas", interpret=True))
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


def _problem_message(what: str, backend: backend_lib.Backend, problems: Sequence[str],
                     fallback: bool) -> str:
  listed = "; ".join(problems)
  # Interpret mode declines in the name of the backend whose rules it applies.
  name = (backend.checks or backend).name
  if fallback:
    return (f"pallas_loop.iterate: the Pallas {name} {what} kernel cannot "
            f"run this step ({listed}); using the XLA implementation. Pass "
            "options=pallas_loop.Options(implementation='xla') to silence this warning.")
  message = (f"pallas_loop.iterate(options=Options(implementation='pallas')): the Pallas "
             f"{name} {what} kernel cannot run this step: {listed}. Fix the "
             "shapes as described, or use options=pallas_loop.Options(implementation='xla').")
  if backend.checks is not None:
    others = "; ".join(f"interpret='{key}' applies the {target.name} kernel's"
                       for key, target in backend_interpret.targets().items()
                       if target is not backend.checks)
    message += (f" (Interpret mode applies the {name} kernel's rules, so that the CPU "
                f"declines what the accelerator would"
                + (f"; {others}.)" if others else ".)"))
  return message


def _per_platform(what: str, plan: Callable[..., Any], run_kernel: Callable[..., Any],
                  run_xla: Callable[[Any], Any], options: Options) -> Callable[[Any], Any]:
  """`f(ops)`: the kernel on the lowering platform's backend, or XLA.

  Args:
    what: "forward" or "backward", for messages.
    plan: plan(backend, ops) -> an object with `.problems` and `.config` (a
      `backend.KernelConfig` or None).
    run_kernel: run_kernel(plan, ops) -> outputs.
    run_xla: run_xla(ops) -> outputs (the same avals).
    options: the caller's `Options`.
  """
  implementation, interpret = options.implementation, options.interpret
  # Every branch that falls back to XLA (and the default branch) calls this
  # one jitted function at the same avals, so JAX traces the XLA loop once
  # and reuses its jaxpr instead of tracing it again per platform.
  run_xla = jax.jit(run_xla, inline=True)

  def on(backend: backend_lib.Backend, *, fallback: bool) -> Callable[[Any], Any]:
    def branch(ops: Any) -> Any:
      p = plan(backend, ops)
      for observe in _observers:
        observe((what, backend.name, p))
      slower = None if p.config is None else p.config.prefer_xla
      if not p.problems and not (fallback and slower):
        return run_kernel(p, ops)
      if p.problems:
        message = _problem_message(what, backend, p.problems, fallback)
      else:
        message = (f"pallas_loop.iterate: the Pallas {backend.name} {what} kernel is "
                   f"expected to be slower than the XLA implementation here ({slower}); "
                   "using the XLA implementation. Pass options=pallas_loop.Options("
                   "implementation='pallas') to run the kernel anyway, or "
                   "Options(implementation='xla') to silence this warning.")
      if not backend.platforms:  # interpret mode runs everywhere: fail now
        raise ValueError(message)
      if fallback:
        return warn_when_lowered(message, run_xla(ops))
      return raise_when_lowered(message, run_xla, ops)
    return branch

  compiled = backends.compiled()

  def no_compiled_backend(ops: Any) -> Any:
    platforms = " or ".join(b.label or b.name for b in compiled)
    return raise_when_lowered(
        "pallas_loop.Options(implementation='pallas', interpret=False) needs a "
        f"{platforms} platform; on this platform pass "
        "interpret=True (or leave interpret=None).", run_xla, ops)

  if implementation == "xla":
    return run_xla
  if interpret is not None and interpret is not False:
    return on(backend_interpret.for_option(interpret), fallback=False)
  strict = implementation == "pallas"
  if strict:
    default = (on(backend_interpret.for_option(None), fallback=False) if interpret is None
               else no_compiled_backend)
  else:
    default = run_xla
  # Each compiled backend's branch (one function, so traced once), under
  # each lowering platform it serves.
  branches = {}
  for backend in compiled:
    branch = on(backend, fallback=not strict)
    branches.update({platform: branch for platform in backend.platforms})

  def select(ops: Any) -> Any:
    return lax.platform_dependent(ops, default=default, **branches)

  return select


def forward_fn(step_fn: step_fn_lib.StepFn, options: Options, *, max_iters: int,
               residual: bool = True, outputs: Any = None, in_order: bool = False
               ) -> Callable[[LoopOperands], LoopOutputs]:
  """The forward, LoopOperands -> LoopOutputs, on the lowering platform's
  kernel or in XLA (`xla_forward.forward`).

  Args:
    step_fn: the body (step, then the halt criterion).
    options: the caller's `Options` (implementation, tiling, tanh).
    max_iters: the counts' static bound.
    residual: track each row's last residual (False when the caller does not
      ask for it: saves a reduction per step; the residual output is then 0).
    outputs: the per-step outputs' buffer avals ([B, T, ...] leaves), or None.
    in_order: the rows are in count order, known at trace time (one count
      for every row): the kernels sort no rows.
  """

  def run_xla(ops: LoopOperands) -> LoopOutputs:
    body = lambda p, h, x, t, rows, index: step_fn(p, ops.consts, h, x, t, rows, index)
    return xla_forward.forward(body, ops, residual, outputs)

  def plan(backend: backend_lib.Backend, ops: LoopOperands) -> Any:
    if backend.plan_forward is None:
      return kernel_forward.plan(backend, step_fn, ops.params, ops.consts, ops.h0, ops.x,
                                 options.block_rows, outputs=outputs,
                                 approx_tanh=options.approx_tanh)
    # the backend's own kernel
    return backend.plan_forward(backend, step_fn, ops.params, ops.consts, ops.h0, ops.x,
                                options.block_rows, outputs=outputs, sort_rows=options.sort_rows,
                                max_iters=max_iters, approx_tanh=options.approx_tanh)

  def run_kernel(p: Any, ops: LoopOperands) -> LoopOutputs:
    return p.run(ops, sort_rows=options.sort_rows, in_order=in_order, residual=residual,
                 schedule=options.schedule)

  return _per_platform("forward", plan, run_kernel, run_xla, options)


def window_fn(step_fn: step_fn_lib.StepFn, options: Options, *,
              in_order: bool = False) -> Callable[[WindowOperands, int, int | None], Any]:
  """The window VJP `w(ops, bound, every) -> (g_params, g_consts, g_h_start,
  g_x)`: a fused backward kernel where the forward kernel would run (the
  backend's own, `Backend.plan_backward`, else the tile kernel every backend
  shares, `kernel_backward.py`), else XLA (`xla_backward.py`). `bound` (the
  static bound on n) and `every` (checkpoint interval or None: the kernel's
  choice) are static. `in_order`: the windows are in length order, known at
  trace time (one length for every row): the kernels sort no rows.
  """

  def window(ops: WindowOperands, bound: int, every: int | None) -> Gradients:
    def run_xla(ops: WindowOperands) -> Gradients:
      return xla_backward.backward(step_fn, ops, window=bound, every=every)

    def plan(backend: backend_lib.Backend, ops: WindowOperands) -> Any:
      outputs = None if ops.g_ys is None else step_fn_lib.avals(ops.g_ys)
      if backend.plan_backward is None:
        return kernel_backward.plan(
            backend, step_fn, ops.params, ops.consts, ops.h_start, ops.x,
            block_rows=options.block_rows, bound=bound, every=every, outputs=outputs,
            approx_tanh=options.approx_tanh)
      # the backend's own kernel
      return backend.plan_backward(
          backend, step_fn, ops.params, ops.consts, ops.h_start, ops.x,
          block_rows=options.block_rows, bound=bound, every=every, outputs=outputs,
          sort_rows=options.sort_rows, approx_tanh=options.approx_tanh)

    def run_kernel(p: Any, ops: WindowOperands) -> Gradients:
      return p.run(ops, sort_rows=options.sort_rows, in_order=in_order,
                   schedule=options.schedule)

    return _per_platform("backward", plan, run_kernel, run_xla, options)(ops)

  return window
