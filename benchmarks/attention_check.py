"""A Universal Transformer with ACT on the accelerator: the kernels against the oracle.

    python -m benchmarks.attention_check --out attention.jsonl        # on the TPU
    python -m benchmarks.attention_check --smoke --out smoke.jsonl    # tiny, any machine

The step of a Flax Universal Transformer with Adaptive Computation Time, as
such models write it: a pre-norm encoder layer of Flax linen modules
(`nn.MultiHeadDotProductAttention` over each example's tokens, `nn.Dense`
MLP: d_model 128, MLP 512, 4 heads, 8 tokens per example; `benchmarks/
attention.py`) with a per-token halting unit (`nn.Dense(1)` and a sigmoid),
driven by `pallas_loop.halting.act` (at most 8 steps, eps 0.01), B=4096
examples. For float32 and bfloat16, with the default `Options(implementation=None)`
(the kernel, or XLA with the one-time warning that says why) and with
`Options(implementation="pallas")` (the kernel, or the library's own error):

float32 runs under `jax.default_matmul_precision("highest")`, kernel and
oracle alike: at the TPU's default precision XLA's float32 products keep
about three digits, and at that precision the kernel's forward moved the
halting steps of 3% of the rows (output error 5e-3; a v5e, JAX 0.10.2).

* forward: ACT's output, ponder cost and steps against `reference.iterate`;
* grad: `jax.grad` of a loss of the output and the ponder cost w.r.t. the
  parameters, against the oracle's.

One JSON line per item the moment it finishes: what ran (the compiled
module's Pallas kernels: `pallas_loop_iterate_fwd` / `_bwd`), the fallback
warnings, the error of a run that failed (a compiler failure on the default
path is the bug this checks for), compile and run seconds, and the
comparison. A unit whose halting step differs from the oracle's (a rounding
at the threshold) is counted, and the output is compared on the rows whose
steps all agree. Exits non-zero on a failure or a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_loop
from pallas_loop import _reference as reference
from pallas_loop import halting
from benchmarks import attention

D, MLP, HEADS, TOKENS, BATCH, MAX_STEPS = 128, 512, 4, 8, 4096, 8
KERNELS = ("pallas_loop_iterate_fwd", "pallas_loop_iterate_bwd")
# Relative error of the gradient (norm of the difference over the norm) and
# the share of rows whose halting steps may differ from the oracle's.
GRAD_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
OUT_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
FLIPPED_ROWS = 0.01


def ut_act(batch: int, d: int, dtype, *, heads: int = HEADS, tokens: int = TOKENS,
           mlp: int = MLP):
  """(act, params, h0, x): the UT-ACT step for `iterate` (`halting.act`)."""
  from flax import linen as nn  # pylint: disable=g-import-not-at-top

  class Ponder(nn.Module):
    """One ponder step: the shared layer on state + input, and h_n per token."""

    layer: nn.Module

    @nn.compact
    def __call__(self, state, x):
      s = self.layer(state + x)
      p = nn.sigmoid(nn.Dense(1, dtype=dtype, param_dtype=dtype)(s)[..., 0])
      return s, s, p

  module = Ponder(attention._flax_layer(d, mlp, heads, dtype))  # pylint: disable=protected-access
  k = jax.random.split(jax.random.key(0), 3)
  state0 = (0.5 * jax.random.normal(k[0], (batch, tokens, d), jnp.float32)).astype(dtype)
  x = (0.5 * jax.random.normal(k[1], (batch, tokens, d), jnp.float32)).astype(dtype)
  params = module.init(k[2], state0[:1], x[:1])
  act = halting.act(lambda p, s, x_: module.apply(p, s, x_), max_iters=MAX_STEPS, eps=0.01)
  return act, params, act.init(params, state0, x), x


def _timed(fn, *args, repeats: int = 3) -> tuple[object, float, float, list[str]]:
  """(result, compile + first run seconds, median seconds of the next runs,
  the Pallas kernels in the compiled module) of `jit(fn)(*args)`."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  kernels = [k for k in KERNELS if k in compiled.as_text()]
  out = jax.block_until_ready(compiled(*args))
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):  # the compiled call: `fn` itself would trace again
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return out, first, statistics.median(times), kernels


def _max_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
  return float(np.max(np.abs(got - want))) / scale if got.size else 0.0


def _rel_norm(got, want) -> float:
  num = sum(float(np.sum((np.asarray(g, np.float64) - np.asarray(w, np.float64)) ** 2))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  den = sum(float(np.sum(np.asarray(w, np.float64) ** 2)) for w in jax.tree.leaves(want))
  return float(np.sqrt(num / max(den, 1e-30)))


def check(dtype_name: str, implementation: str | None, what: str, batch: int, d: int,
          heads: int, tokens: int, mlp: int) -> dict:
  """One item: forward or grad, one dtype, one implementation."""
  record = {"dtype": dtype_name, "implementation": implementation, "what": what,
            "batch": batch, "d": d, "heads": heads, "tokens": tokens, "mlp": mlp,
            "backend": jax.default_backend(), "jax": jax.__version__}
  dtype = jnp.dtype(dtype_name)
  act, params, h0, x = ut_act(batch, d, dtype, heads=heads, tokens=tokens, mlp=mlp)
  kw = dict(max_iters=act.max_iters, halt=act.halt)
  run = lambda it, **extra: (lambda p: it(act.step, p, h0, x, **kw, **extra))
  impl = {"options": pallas_loop.Options(implementation=implementation)}
  if what == "forward":
    ours, oracle = run(pallas_loop.iterate, **impl), run(reference.iterate)
  else:
    def loss_of(it, **extra):
      def loss(p):
        h = it(act.step, p, h0, x, **kw, **extra)
        return (jnp.mean(jnp.square(h.output.astype(jnp.float32)))
                + 0.01 * jnp.mean(h.ponder_cost))
      return jax.grad(loss)
    ours, oracle = loss_of(pallas_loop.iterate, **impl), loss_of(reference.iterate)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      got, record["compile_and_first_s"], record["run_s"], record["kernels"] = _timed(
          ours, params)
    except Exception as e:  # pylint: disable=broad-except  # recorded: the item failed
      record["error"] = f"{type(e).__name__}: {e}"[:3000]
      record["traceback"] = traceback.format_exc()[-3000:]
      record["ok"] = implementation == "pallas" and isinstance(e, ValueError) and (
          "pallas_loop.iterate(options=Options(implementation='pallas'))" in str(e))
      record["warnings"] = sorted({str(w.message)[:500] for w in caught
                                   if "pallas_loop" in str(w.message)})
      return record
  record["warnings"] = sorted({str(w.message)[:500] for w in caught
                               if "pallas_loop" in str(w.message)})
  want, _, record["oracle_run_s"], _ = _timed(oracle, params, repeats=1)
  if what == "forward":
    agree = np.all(np.asarray(got.steps) == np.asarray(want.steps), axis=1)
    record["rows_whose_steps_differ"] = int(np.sum(~agree))
    record["output_max_err"] = _max_err(np.asarray(got.output)[agree],
                                        np.asarray(want.output)[agree])
    record["ponder_max_err"] = _max_err(np.asarray(got.ponder_cost)[agree],
                                        np.asarray(want.ponder_cost)[agree])
    record["ok"] = bool(record["rows_whose_steps_differ"] <= FLIPPED_ROWS * batch
                        and record["output_max_err"] <= OUT_TOL[dtype_name]
                        and record["ponder_max_err"] <= OUT_TOL[dtype_name])
  else:
    record["grad_rel_err"] = _rel_norm(got, want)
    record["ok"] = bool(record["grad_rel_err"] <= GRAD_TOL[dtype_name])
  return record


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="JSON lines, one per item")
  parser.add_argument("--smoke", action="store_true",
                      help="B=64, D=32, MLP 64, 4 tokens: any machine, in seconds")
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--implementations", default="default,pallas",
                      help="default (Options(implementation=None)) and/or pallas")
  parser.add_argument("--what", default="forward,grad")
  args = parser.parse_args(argv)
  implementations = [None if i == "default" else i for i in args.implementations.split(",")]
  sizes = dict(batch=64, d=32, heads=HEADS, tokens=4, mlp=64) if args.smoke else dict(
      batch=BATCH, d=D, heads=HEADS, tokens=TOKENS, mlp=MLP)
  failed = 0
  with open(args.out, "w") as out:
    for dtype_name in args.dtypes.split(","):
      for implementation in implementations:
        for what in args.what.split(","):
          # float32 products at full precision on both sides (the docstring
          # says why).
          with (jax.default_matmul_precision("highest") if dtype_name == "float32"
                else contextlib.nullcontext()):
            record = check(dtype_name, implementation, what, **sizes)
          record["matmul_precision"] = "highest" if dtype_name == "float32" else "default"
          out.write(json.dumps(record) + "\n")
          out.flush()
          failed += not record["ok"]
          shown = {k: v for k, v in record.items() if k not in ("traceback", "warnings")}
          print(json.dumps(shown), flush=True)
  print(f"attention_check: {failed} item(s) failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
