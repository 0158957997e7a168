"""Named benchmark cases: count distributions, workloads and suites.

One module of shapes shared by the benchmark scripts and the tests, so a test
exercises exactly what a benchmark times.

Count distributions (`count_distribution`), n_i per row, T = max_iters:
  constant         every row T (pure overhead: no row can be skipped)
  uniform          uniform in [1, T]
  recurrent_depth  1 + Poisson(lambda), lambda ~ LogNormal with mean ~31 and
                   sigma 0.5, capped at T (the recurrent-depth training
                   recipe; mean ~32 with T = 128)
  geometric        Geometric(p = 1/5) (mean ~5), capped at T (use T = 20)
  bimodal          80% uniform in [1, T/8], 20% at T
  adversarial      one row at T in every tile of `block_rows` rows (at a
                   random position), the others 1: defeats tile early exit
                   unless rows are sorted
"""

from __future__ import annotations

import dataclasses

import numpy as np

DISTRIBUTIONS = ("constant", "uniform", "recurrent_depth", "geometric", "bimodal",
                 "adversarial")
ADVERSARIAL_TILE = 32  # rows per tile the adversarial pattern targets


def count_distribution(name: str, batch: int, max_iters: int, seed: int = 0) -> np.ndarray:
  """int32 [batch] step counts in [1, max_iters] drawn from distribution `name`.

  Args:
    name: one of `DISTRIBUTIONS`.
    batch: rows B.
    max_iters: the cap T.
    seed: numpy seed (the counts are a pure function of the arguments).

  Returns:
    np.ndarray int32 [batch].

  Example:
    >>> count_distribution("bimodal", 5, 64, seed=0)
    array([ 7, 64, 64,  3,  3], dtype=int32)
  """
  rng = np.random.default_rng(seed)
  t = max_iters
  if name == "constant":
    n = np.full(batch, t)
  elif name == "uniform":
    n = rng.integers(1, t + 1, batch)
  elif name == "recurrent_depth":
    sigma = 0.5
    lam = rng.lognormal(np.log(31.0) - sigma ** 2 / 2, sigma, batch)
    n = 1 + rng.poisson(lam)
  elif name == "geometric":
    n = rng.geometric(1 / 5, batch)
  elif name == "bimodal":
    short = rng.integers(1, max(2, t // 8) + 1, batch)
    n = np.where(rng.random(batch) < 0.8, short, t)
  elif name == "adversarial":
    n = np.ones(batch, np.int64)
    for start in range(0, batch, ADVERSARIAL_TILE):
      stop = min(batch, start + ADVERSARIAL_TILE)
      n[rng.integers(start, stop)] = t
  else:
    raise ValueError(f"unknown count distribution {name!r}; known: {DISTRIBUTIONS}")
  return np.clip(n, 1, t).astype(np.int32)


# The cap T per distribution, as the issue specifies them.
DEFAULT_MAX_ITERS = {"constant": 64, "uniform": 64, "recurrent_depth": 128,
                     "geometric": 20, "bimodal": 64, "adversarial": 64}


@dataclasses.dataclass(frozen=True)
class Case:
  """A workload.

  Attributes:
    block: a name in `blocks.BLOCKS`.
    batch, d: rows B and state width D.
    max_iters: the cap T.
    counts: a name in `DISTRIBUTIONS` (the step budgets).
    dtype: "float32" or "bfloat16".
    tol: rows also halt once rms(update) <= tol (None: no halting).
    grad: None: forward only; "full": forward+backward, jax.grad of the sum
      of the output with `iterate(..., grad=...)` (other modes later).
    impls: implementations to run (None: every one that applies; the masked
      scan always runs, first, as the baseline and the oracle).
  """

  block: str
  batch: int
  d: int
  max_iters: int
  counts: str
  dtype: str = "float32"
  tol: float | None = None
  grad: str | None = None
  impls: tuple[str, ...] | None = None

  @property
  def label(self) -> str:
    halting = f" tol={self.tol:g}" if self.tol is not None else ""
    mode = " fwd+bwd" if self.grad else ""
    return (f"{self.block} B={self.batch} D={self.d} T={self.max_iters} "
            f"{self.counts}{halting} {self.dtype}{mode}")


def _case(block, batch, d, counts, **kw):
  return Case(block, batch, d, kw.pop("max_iters", DEFAULT_MAX_ITERS[counts]), counts, **kw)


XLA_ONLY = ("masked_scan", "vmap_while", "xla")

# The CPU target of the performance issue: B=1024, D=64, uniform[1,64] and
# recurrent-depth-like counts, tanh RNN and residual MLP blocks.
TARGET = tuple(_case(block, 1024, 64, counts)
               for block in ("tanh_rnn", "residual_mlp")
               for counts in ("uniform", "recurrent_depth"))

# `python -m benchmarks.run`: the target cases plus a halting workload and a
# forward+backward case; < 2 min on a 2-core CPU.
QUICK = TARGET + (
    _case("deq", 256, 64, "constant", tol=1e-5),
    _case("tanh_rnn", 256, 64, "bimodal", grad="full"),
)


def full_suite() -> tuple[Case, ...]:
  """`--suite full`: every block x width x distribution, forward and fwd+bwd."""
  out = []
  for block in ("tanh_rnn", "gru", "residual_mlp"):
    for d in (64, 96, 256, 1024):  # 96: not a power of 2
      batch = 1024 if d <= 256 else 256
      for counts in DISTRIBUTIONS:
        out.append(_case(block, batch, d, counts))
      out.append(_case(block, batch, d, "uniform", grad="full"))
  for counts in DISTRIBUTIONS:
    out.append(_case("transformer", 256, 64, counts, max_iters=min(
        32, DEFAULT_MAX_ITERS[counts]), impls=XLA_ONLY))
  out.append(_case("deq", 1024, 64, "constant", tol=1e-5))
  return tuple(out)


# (block, D) of the GPU suite whose backward runs the fused Triton kernel (its
# weight gradients fit in registers, `backend_triton.accumulator_problem`);
# the others' backward is the XLA implementation, and "pallas" refuses it.
GPU_BACKWARD_KERNEL = frozenset({("tanh_rnn", 128), ("gru", 128)})


def gpu_suite(batch: int = 4096) -> tuple[Case, ...]:
  """`gpu_check`: B=4096, D in {128, 256}, bf16, every distribution; forward
  and backward where the backward kernel runs (`GPU_BACKWARD_KERNEL`)."""
  out = []
  for d in (128, 256):
    for block in ("tanh_rnn", "gru", "residual_mlp"):
      for counts in DISTRIBUTIONS:
        out.append(_case(block, batch, d, counts, dtype="bfloat16"))
      if (block, d) in GPU_BACKWARD_KERNEL:
        out.append(_case(block, batch, d, "recurrent_depth", dtype="bfloat16", grad="full"))
    out.append(_case("transformer", batch // 4, d, "recurrent_depth", dtype="bfloat16",
                     impls=XLA_ONLY))
  return tuple(out)


def tpu_suite() -> tuple[Case, ...]:
  """`gpu_check` on a TPU: the cases the TPU's speed is judged on. The tanh RNN (D=128,
  bf16) at B=32768 and 4096 with constant, uniform and recurrent-depth
  counts; the GRU, LSTM and residual MLP at B=32768 (constant and uniform
  counts: how near the loop is to the matrix unit's bound); a batch whose
  state does not fit VMEM (B=262144); and jax.grad of the tanh RNN at
  B=32768. In priority order: a run cut short by its budget keeps the
  first."""
  out = [_case("tanh_rnn", batch, 128, counts, dtype="bfloat16")
         for batch in (32768, 4096) for counts in ("constant", "uniform", "recurrent_depth")]
  out += [_case(block, 32768, 128, "constant", dtype="bfloat16")
          for block in ("gru", "lstm", "residual_mlp")]
  out.append(_case("tanh_rnn", 262144, 128, "uniform", dtype="bfloat16"))
  out.append(_case("tanh_rnn", 32768, 128, "recurrent_depth", dtype="bfloat16", grad="full"))
  out += [_case(block, 32768, 128, "uniform", dtype="bfloat16")
          for block in ("gru", "lstm", "residual_mlp")]
  out.append(_case("tanh_rnn", 32768, 128, "constant", dtype="bfloat16", grad="full"))
  return tuple(out)


def smoke_suite() -> tuple[Case, ...]:
  """Tiny cases that run anywhere in seconds (tests, `gpu_check --smoke`)."""
  return (
      Case("tanh_rnn", 64, 16, 8, "uniform"),
      Case("residual_mlp", 64, 16, 8, "bimodal", dtype="bfloat16"),
      Case("gru", 40, 16, 8, "adversarial", grad="full"),
      Case("transformer", 12, 16, 4, "geometric", impls=XLA_ONLY),
  )


SUITES = {"quick": lambda: QUICK, "full": full_suite, "gpu": gpu_suite, "tpu": tpu_suite,
          "smoke": smoke_suite}
