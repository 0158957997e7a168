"""The `pallas_loop.deq` solvers on hard maps: rows converged, steps, residuals, time.

    python -m benchmarks.deq_solvers [--tol 1e-6] [--max-iters 100] [--repeats 3]
                                     [--maps collinear,linear,...] [--solvers ...]

Each map is a batch of 16 rows, each row its own fixed-point problem, solved by
`deq.fixed_point` (XLA loop, each row halting on rms(f(h) - h) <= tol) with
each solver, forward and implicit adjoint (the adjoint solved by the same
solver, relative tolerance tol). The maps:

  collinear    deq-jax's test map f(z) = -2 z + 1 from h0 = ones, rows of
               (2, 3): every residual is a multiple of the same vector
               (Anderson's Gram matrix is singular to float precision).
  linear       h A + x, D = 8, A with eigenvalues -1.5, 1.5, 2.0, a complex
               pair 1.3 e^(+-i) and 0.3, -0.5, 0.6 (not a contraction; not
               normal).
  tanh1.2      tanh(h W + x U), D = 32, W of spectral radius 1.2, x of scale
               0.3 (examples/deq_training.py's layer).
  tanh2.0      the same with W of spectral radius 2.0 and x of scale 1.
  transformer  a DEQ transformer block on 16 tokens of width 64 per row, as
               in deq-jax's language model: pre-LayerNorm causal attention
               (4 heads) and a GELU MLP (x4), each added to the residual
               stream, a final LayerNorm; weights VarianceScaling(2) (deq-jax's
               init for one layer), the input injected as z + x with x of
               scale 0.4 per element (token + position embeddings). Plain
               iteration does not converge on it.

Printed per (map, solver): rows converged (forward, and adjoint for a
cotangent of ones), map evaluations per row (min/median/max), the largest
final residual among the rows, the rows whose final residual is worse than
plain iteration's on the same row ("worse"), and the median forward and
forward+backward times of the jitted call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_loop import deq

ROWS = 16

SOLVERS: dict[str, Callable[[], deq.Solver]] = {
    "Damped(1.0)": lambda: deq.Damped(1.0),
    "Damped(0.5)": lambda: deq.Damped(0.5),
    "Anderson(5) no guards": lambda: deq.Anderson(m=5, safeguard=None, restart=0),
    "Anderson(5)": lambda: deq.Anderson(m=5),
    "Anderson(10)": lambda: deq.Anderson(m=10),
    "Broyden(10)": lambda: deq.Broyden(m=10),
    "Broyden(20)": lambda: deq.Broyden(m=20),
}


# ---------------------------------------------------------------------------
# The maps: (f, params, h0, x).


def collinear() -> tuple:
  f = lambda p, h, x: -2.0 * h + 1.0
  return f, None, jnp.ones((ROWS, 2, 3)), None


def linear(seed: int = 0) -> tuple:
  rng = np.random.RandomState(seed)
  blocks = np.zeros((8, 8))
  for i, lam in enumerate([-1.5, 1.5, 2.0, 0.3, -0.5, 0.6]):
    blocks[i, i] = lam
  c, s = 1.3 * np.cos(1.0), 1.3 * np.sin(1.0)
  blocks[6:, 6:] = [[c, -s], [s, c]]
  v = rng.randn(8, 8)
  a = v @ blocks @ np.linalg.inv(v)
  f = lambda a, h, x: h @ a + x
  return (f, jnp.asarray(a, jnp.float32), jnp.zeros((ROWS, 8)),
          jnp.asarray(rng.randn(ROWS, 8), jnp.float32))


def tanh_layer(radius: float, x_scale: float, dim: int = 32, seed: int = 0) -> tuple:
  k = jax.random.split(jax.random.key(seed), 3)
  w = np.asarray(jax.random.normal(k[0], (dim, dim))) / np.sqrt(dim)
  w = w * (radius / np.max(np.abs(np.linalg.eigvals(w))))
  params = (jnp.asarray(w, jnp.float32), jax.random.normal(k[1], (16, dim)) / 4.0)
  x = x_scale * jax.random.normal(k[2], (ROWS, 16))
  f = lambda p, h, x: jnp.tanh(h @ p[0] + x @ p[1])
  return f, params, jnp.zeros((ROWS, dim)), x


def _layer_norm(h: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
  mean = h.mean(-1, keepdims=True)
  var = jnp.square(h - mean).mean(-1, keepdims=True)
  return (h - mean) * jax.lax.rsqrt(var + 1e-5) * scale + offset


def transformer(tokens: int = 16, width: int = 64, heads: int = 4, x_scale: float = 0.4,
                seed: int = 0) -> tuple:
  ks = jax.random.split(jax.random.key(seed), 8)

  def dense(k, fan_in, fan_out):  # haiku's VarianceScaling(2.0): truncated normal, fan_in
    std = np.sqrt(2.0 / fan_in) / 0.87962566103423978
    return std * jax.random.truncated_normal(k, -2.0, 2.0, (fan_in, fan_out))

  params = {"wq": dense(ks[0], width, width), "wk": dense(ks[1], width, width),
            "wv": dense(ks[2], width, width), "wo": dense(ks[3], width, width),
            "w1": dense(ks[4], width, 4 * width), "w2": dense(ks[5], 4 * width, width),
            "ln": jnp.stack([jnp.ones((3, width)), jnp.zeros((3, width))], axis=1)}
  embed = 0.02 * jax.random.truncated_normal(ks[6], -2, 2, (ROWS, tokens, width))
  pos = 0.02 * jax.random.truncated_normal(ks[7], -2, 2, (tokens, width))
  x = (x_scale / 0.02) * (embed + pos)
  head = width // heads
  causal = np.tril(np.ones((tokens, tokens), bool))

  def f(p, z, x):
    rows = z.shape[0]
    h = z + x
    a = _layer_norm(h, p["ln"][0, 0], p["ln"][0, 1])
    q, k, v = ((a @ p[w]).reshape(rows, tokens, heads, head) for w in ("wq", "wk", "wv"))
    scores = jnp.where(causal, jnp.einsum("rthd,rshd->rhts", q, k) / np.sqrt(head), -1e10)
    attended = jnp.einsum("rhts,rshd->rthd", jax.nn.softmax(scores, axis=-1), v)
    h = h + attended.reshape(rows, tokens, width) @ p["wo"]
    h = h + jax.nn.gelu(_layer_norm(h, p["ln"][1, 0], p["ln"][1, 1]) @ p["w1"]) @ p["w2"]
    return _layer_norm(h, p["ln"][2, 0], p["ln"][2, 1])

  return f, params, jnp.zeros((ROWS, tokens, width)), x


MAPS: dict[str, Callable[[], tuple]] = {
    "collinear": collinear,
    "linear": linear,
    "tanh1.2": lambda: tanh_layer(1.2, 0.3),
    "tanh2.0": lambda: tanh_layer(2.0, 1.0),
    "transformer": transformer,
}


# ---------------------------------------------------------------------------
# Measuring.


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())  # compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure(map_name: str, solver: deq.Solver, *, tol: float, max_iters: int,
            repeats: int) -> dict[str, Any]:
  """Forward and adjoint statistics and times of one solver on one map."""
  f, params, h0, x = MAPS[map_name]()

  # h0 is an argument, so that XLA cannot fold a map of constants away.
  def forward(params, h0, x):
    return deq.fixed_point(f, params, h0, x, solver=solver, tol=tol, max_iters=max_iters,
                           on_failure="ignore", return_info=True)

  def loss(params, h0, x, probe):
    h = deq.fixed_point(f, params, h0, x, solver=solver, tol=tol, max_iters=max_iters,
                        on_failure="ignore", adjoint_probe=probe)
    return jnp.sum(h)

  fwd = jax.jit(forward)
  grad = jax.jit(jax.grad(loss, argnums=(0, 3)))
  probe = deq.adjoint_probe(h0)
  _, info = fwd(params, h0, x)
  _, g_probe = grad(params, h0, x, probe)
  adjoint = deq.SolveInfo.from_probe(g_probe)
  return {
      "converged": int(info.converged.sum()),
      "steps": np.asarray(info.steps),
      "residual": np.asarray(info.residual),
      "adjoint_converged": int(adjoint.converged.sum()),
      "fwd_s": _median_seconds(lambda: fwd(params, h0, x), repeats),
      "fwd_bwd_s": _median_seconds(lambda: grad(params, h0, x, probe), repeats),
  }


def _commit() -> str:
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return out.stdout.strip() + ("+" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tol", type=float, default=1e-6)
  parser.add_argument("--max-iters", type=int, default=100)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--maps", default=",".join(MAPS))
  parser.add_argument("--solvers", default=",".join(SOLVERS),
                      help="comma-separated names from: " + ", ".join(SOLVERS))
  args = parser.parse_args(argv)
  maps = args.maps.split(",")
  solvers = [s.strip() for s in args.solvers.split(",")]
  for name in maps + solvers:
    if name not in MAPS and name not in SOLVERS:
      parser.error(f"unknown map or solver {name!r}")
  print(f"{datetime.date.today()} · {platform.machine()} {os.cpu_count()} cores · "
        f"{jax.default_backend()} · JAX {jax.__version__} · Python "
        f"{platform.python_version()} · commit {_commit()}")
  print(f"python -m benchmarks.deq_solvers --tol {args.tol:g} --max-iters {args.max_iters} "
        f"--repeats {args.repeats}; {ROWS} rows per map")
  header = (f"{'map':12s} {'solver':26s} {'fwd conv':>8s} {'steps min/med/max':>17s} "
            f"{'worst res':>9s} {'worse':>5s} {'adj conv':>8s} {'fwd ms':>8s} {'f+b ms':>8s}")
  print(header)
  for map_name in maps:
    plain = None
    for solver_name in solvers:
      r = measure(map_name, SOLVERS[solver_name](), tol=args.tol, max_iters=args.max_iters,
                  repeats=args.repeats)
      if plain is None:
        plain = measure(map_name, deq.Damped(1.0), tol=args.tol, max_iters=args.max_iters,
                        repeats=1)["residual"] if solver_name != "Damped(1.0)" else r["residual"]
      worse = int(np.sum(r["residual"] > np.maximum(plain, args.tol)))
      s = r["steps"]
      print(f"{map_name:12s} {solver_name:26s} {r['converged']:>5d}/{ROWS:<2d} "
            f"{f'{s.min()}/{int(np.median(s))}/{s.max()}':>17s} {r['residual'].max():9.1e} "
            f"{worse:>5d} {r['adjoint_converged']:>5d}/{ROWS:<2d} {1e3 * r['fwd_s']:8.1f} "
            f"{1e3 * r['fwd_bwd_s']:8.1f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
