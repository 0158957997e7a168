"""Compile `deq.fixed_point`'s solves with the real backend compilers, deviceless.

    pip install -e ".[compile-check]"
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 \
        python -m benchmarks.deq_compile [--solvers broyden20,anderson5] [--targets h200,v5e]

`jit(value_and_grad)` of `deq.fixed_point` (implicit adjoint: a forward and an
adjoint solve) of h = tanh(h W + x), B = 4096 rows, D = 128, float32, tol 1e-4,
32 map evaluations, for an H200 (XLA's Triton pipeline and ptxas) and a TPU
v5e (libtpu's Mosaic), with `implementation=None` (what a user gets: kernels,
or the XLA loop with the warning that says why) and `implementation="pallas"`
(kernels or an error). Printed per case: whether it compiled, how many solve
kernels the lowered module holds (2: the forward and the adjoint solve ran as
kernels), the scoped VMEM Mosaic gave each kernel (TPU), the library's
warnings and the error if any. The topologies and the VMEM reading are
`benchmarks.compile_check`'s, and so is the environment above (its workers'
`_environment`).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks import compile_check
import pallas_loop
from pallas_loop import deq

SOLVERS = {"broyden20": lambda: deq.Broyden(m=20), "broyden8": lambda: deq.Broyden(m=8),
           "anderson5": lambda: deq.Anderson(m=5)}
B, D = 4096, 128


def _loss(solver: deq.Solver, implementation: str | None):
  def loss(w, h0, x):
    h = deq.fixed_point(lambda w, h, x: jnp.tanh(h @ w + x), w, h0, x, solver=solver,
                        tol=1e-4, max_iters=32, on_failure="ignore",
                        options=pallas_loop.Options(implementation=implementation))
    return jnp.sum(h)
  return jax.value_and_grad(loss)


def compile_case(solver_name: str, target: str, implementation: str | None) -> dict:
  """Lowers and compiles one case for `target` ("h200" or "v5e"); returns what happened."""
  case = compile_check.Case(target=target)
  mesh = compile_check._topology_mesh(case)  # pylint: disable=protected-access
  sharded = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32,
                                               sharding=NamedSharding(mesh, PartitionSpec()))
  out: dict = {"solver": solver_name, "target": target, "implementation": implementation}
  start = time.perf_counter()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      with jax.set_mesh(mesh):
        lowered = jax.jit(_loss(SOLVERS[solver_name](), implementation)).lower(
            sharded((D, D)), sharded((B, D)), sharded((B, D)))
        text = lowered.as_text()
        out["kernels"] = sum(text.count(k) for k in ("pallas_loop_iterate_fwd",))
        compiled = lowered.compile()
      out["compiled"] = True
      if target != "h200":
        out["vmem"] = compile_check.scoped_vmem(compiled.as_text())
    except Exception as e:  # pylint: disable=broad-except  # a compiler error is a result
      out["compiled"] = False
      out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  out["seconds"] = round(time.perf_counter() - start, 1)
  out["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught
                            if "pallas_loop" in str(w.message)})
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--solvers", default=",".join(SOLVERS))
  parser.add_argument("--targets", default="h200,v5e")
  args = parser.parse_args(argv)
  print(f"jit(value_and_grad(deq.fixed_point)), tanh(h W + x), B={B}, D={D}, float32, "
        f"32 map evaluations; JAX {jax.__version__}; commit {compile_check._commit()}")  # pylint: disable=protected-access
  for target in args.targets.split(","):
    for solver_name in args.solvers.split(","):
      for implementation in (None, "pallas"):
        print(compile_case(solver_name, target, implementation), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
