"""The compiled kernels against the oracle, one feature at a time.

`gpu_check` runs this right after its per-block checks: every feature of
`iterate` that changes what the kernels do (gradient modes, halting, keys,
the step index, per-step outputs, hoisting, integer leaves, pytree state,
tile heights, padding) through `pallas_loop.testing.check_against_reference`
with `Options(implementation="pallas")` and the default `interpret=None`:
the compiled kernel on a GPU or TPU, the interpreter on a CPU (`--smoke`).

float32 cases run under `jax.default_matmul_precision("highest")`, in the
kernel and in the oracle alike: at DEFAULT, a TPU multiplies float32
operands in one bfloat16 pass (relative error ~2e-3, measured on a v5e) and
a GPU in TF32, so a comparison at float32's tolerances would test the
rounding of the matrix unit, not the kernel. bfloat16 cases run under it
too, which is how a mixed-precision model with that setting runs.

    python -m benchmarks.feature_check            # on this machine's backend
    python -m benchmarks.feature_check --smoke    # small shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp

import pallas_loop
from benchmarks import blocks
from benchmarks import cases


def _with_counter(step):
  """The block with an int32 step counter beside its state (issue-20 style)."""
  def counted(params, h, x):
    n, state = h
    return n + 1, step(params, state, x)
  return counted


def _dropout(step):
  """The block with dropout on its output, from the row's key."""
  def dropped(params, h, x, *, key):
    return pallas_loop.random.dropout(key, step(params, h, x), 0.1)
  return dropped


def _with_output(step):
  """The block, also returning a per-step output (a row's mean, [rows])."""
  def stepped(params, h, x):
    new = step(params, h, x)
    return new, jnp.mean(new.astype(jnp.float32), axis=-1)
  return stepped


@dataclasses.dataclass(frozen=True)
class Feature:
  """One check: `block` built by `benchmarks.blocks.make`, its step wrapped
  by `wrap`, the state by `state`, run with `keywords` (of `iterate`) and
  `options` (how to run; None: `check_against_reference`'s default, the
  kernel)."""

  name: str
  block: str = "tanh_rnn"
  dtype: str = "float32"
  keywords: dict = dataclasses.field(default_factory=dict)
  options: pallas_loop.Options | None = None
  wrap: Callable[[Any], Any] | None = None
  state: Callable[[Any], Any] | None = None
  counts: str = "recurrent_depth"


# The kernel, compiled on a GPU or TPU, interpreted on a CPU.
KERNEL = pallas_loop.Options(implementation="pallas")

FEATURES: tuple[Feature, ...] = (
    Feature("full gradient"),
    Feature("full, checkpoint every step", keywords={"grad": pallas_loop.Full(checkpoint_every=1)}),
    Feature("truncated(4)", keywords={"grad": pallas_loop.Truncated(4)}),
    Feature("hoist=False", options=KERNEL.replace(hoist=False)),
    Feature("sort_rows=False", options=KERNEL.replace(sort_rows=False)),
    Feature("gru bf16", block="gru", dtype="bfloat16"),
    Feature("lstm (pytree state)", block="lstm"),
    Feature("residual mlp + layer norm", block="residual_mlp_ln"),
    Feature("int32 counter in the state", wrap=_with_counter,
            state=lambda h: (jnp.zeros((h.shape[0],), jnp.int32), h)),
    Feature("tol halting, min_iters=2", block="deq", counts="constant",
            keywords={"tol": 1e-3, "min_iters": 2}),
    Feature("implicit gradient (forward and halting)", block="deq", counts="constant",
            keywords={"tol": 1e-4, "grad": pallas_loop.Implicit()}),
    Feature("phantom(3) (forward)", block="deq", counts="constant",
            keywords={"tol": 1e-4, "grad": pallas_loop.Phantom(3)}),
    Feature("key= dropout", wrap=_dropout, keywords={"key": jax.random.key(5)}),
    # The backward kernel declines stacked per-step weights (their gradient
    # is a dynamic_update_slice, which neither backend lowers): the default
    # implementation runs the forward kernel and the XLA backward.
    Feature("step index, untied layers (XLA backward)", block="untied_rnn",
            keywords={"step_index": True}, options=pallas_loop.Options()),
    Feature("per-step outputs", wrap=_with_output, keywords={"step_outputs": True}),
)


def sizes(smoke: bool) -> tuple[int, int, int]:
  """(rows, width, max_iters): rows not a multiple of any tile, so the last
  tile is partial (its padding poisoned with NaN)."""
  return (45, 16, 6) if smoke else (1003, 128, 16)


def run(feature: Feature, batch: int, d: int, max_iters: int) -> dict:
  """One feature's check; a dict with `ok` and the largest errors."""
  step, params, h0, x = blocks.make(feature.block, batch, d, jnp.dtype(feature.dtype),
                                    jax.random.key(3))
  if feature.wrap is not None:
    step = feature.wrap(step)
  if feature.state is not None:
    h0 = feature.state(h0)
  t = min(max_iters, blocks.UNTIED_LAYERS)
  iters = jnp.asarray(cases.count_distribution(feature.counts, batch, t, 3))
  line: dict = {"item": "feature", "feature": feature.name, "block": feature.block,
                "dtype": feature.dtype, "batch": batch, "d": d, "max_iters": t,
                "backend": jax.default_backend()}
  start = time.perf_counter()
  try:
    with pallas_loop.testing.poisoned_padding(), jax.default_matmul_precision("highest"):
      report = pallas_loop.testing.check_against_reference(
          step, params, h0, x, iters=iters, max_iters=t, options=feature.options,
          **feature.keywords)
    line.update(ok=True, grads_compared=report.gradients_compared,
                max_abs_error=max(c.max_abs for c in report.comparisons),
                max_rel_error=max(c.max_rel for c in report.comparisons))
  except Exception as e:  # pylint: disable=broad-except  # recorded; fails the run
    line.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000],
                where=traceback.format_exc(limit=3)[-1500:])
  line["seconds"] = time.perf_counter() - start
  return line


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="small shapes")
  args = parser.parse_args(argv)
  print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()})")
  bad = 0
  for feature in FEATURES:
    line = run(feature, *sizes(args.smoke))
    bad += not line["ok"]
    detail = (f"max abs {line['max_abs_error']:.2e}, max rel {line['max_rel_error']:.2e}"
              if line["ok"] else line["error"].splitlines()[0][:300])
    print(f"{'ok ' if line['ok'] else 'BAD'} {feature.name:42s} {line['seconds']:6.1f} s  "
          f"{detail}", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
