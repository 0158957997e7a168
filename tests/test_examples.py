"""The examples run (quick mode) and check themselves against the reference."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_deq_fixed_point(implementation, capsys):
  assert _load("deq_fixed_point").main(["--quick", "--implementation", implementation]) == 0
  out = capsys.readouterr().out
  assert "64 converged" in out and "OK" in out


def _impl_args(implementation):
  return [] if implementation is None else ["--implementation", implementation]


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_vmap_counts(implementation, capsys):
  assert _load("vmap_counts").main(["--quick"] + _impl_args(implementation)) == 0
  out = capsys.readouterr().out
  # The plain-JAX failures are caught and printed, then iterate's rows 2, 4, 8.
  assert "ConcretizationTypeError" in out and "`length` argument to `scan`" in out
  assert "Reverse-mode differentiation does not work" in out
  assert "[[2. 2. 2. 2. 2.]\n     [4. 4. 4. 4. 4.]\n     [8. 8. 8. 8. 8.]]" in out
  assert out.rstrip().endswith("OK")


def test_stochastic_depth(capsys):
  """Default implementation (XLA on CPU): checked against the reference, then timed."""
  assert _load("stochastic_depth").main(["--quick"]) == 0
  out = capsys.readouterr().out
  assert "max |h - ref| = " in out and "times on CPU" in out and "CPU timings" in out
  assert "user's vmap(scan + lax.cond)" in out and out.rstrip().endswith("OK")


def test_stochastic_depth_kernel_interpret(capsys):
  """The kernel (interpret mode) with dropout: same values and gradients as the reference."""
  assert _load("stochastic_depth").main(["--quick", "--implementation", "pallas", "--no-timing"]) == 0
  out = capsys.readouterr().out
  assert "max |h - ref| = " in out and out.rstrip().endswith("OK")


def _losses(out):
  return [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
          if line.strip().startswith("step ")]


def test_recurrent_depth_quick(tmp_path, capsys):
  pytest.importorskip("optax", reason='needs the examples extra: pip install -e ".[examples]"')
  plot = tmp_path / "accuracy.png"
  assert _load("recurrent_depth").main(["--quick", "--plot", str(plot)]) == 0
  out = capsys.readouterr().out
  losses = _losses(out)
  # The loss goes down: the example also asserts it (mean of the first vs last 40 steps).
  assert len(losses) >= 5 and losses[-1] < 0.5 * losses[0], losses
  assert "of the last 40" in out and "longer than trained" in out
  if importlib.util.find_spec("matplotlib") is None:  # optional: the plot is skipped
    assert "matplotlib is not installed" in out
  else:
    assert plot.stat().st_size > 0


def test_recurrent_depth_kernel_interpret(capsys):
  """Two training steps with the kernel in interpret mode; its Truncated gradient vs the reference."""
  pytest.importorskip("optax", reason='needs the examples extra: pip install -e ".[examples]"')
  assert _load("recurrent_depth").main(
      ["--quick", "--implementation", "pallas", "--steps", "2", "--no-eval"]) == 0
  out = capsys.readouterr().out
  assert "gradient vs reference.iterate: max relative difference" in out
  assert "the loss is not checked" in out


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_flax_dropout(implementation, capsys):
  """Linen and NNX dropout per example (make_rng / nnx.Rngs from the row's key;
  XLA) and linen on the tile with pallas_loop.random (the kernel in interpret
  mode with "pallas"): gradients match the reference with the same keys."""
  pytest.importorskip("flax", reason="flax is not installed: pip install -e '.[flax]'")
  assert _load("flax_dropout").main(["--quick", "--implementation", implementation]) == 0
  out = capsys.readouterr().out
  for name in ("linen, per example (make_rng)", "nnx, per example (nnx.Rngs)",
               "linen, tile (pallas_loop.random)"):
    line = next(line for line in out.splitlines() if line.startswith(name))
    assert line.endswith("ok"), line
  assert out.rstrip().endswith("OK")


def test_haiku_block(capsys):
  """Haiku's transform/apply; skipped unless dm-haiku is installed (not in CI)."""
  pytest.importorskip("haiku", reason="Haiku is not installed: pip install dm-haiku")
  assert _load("haiku_block").main(["--quick"]) == 0
  out = capsys.readouterr().out
  assert "haiku, dropout per example" in out and out.rstrip().endswith("OK")


def test_act(capsys):
  """ACT per example and per token: forward vs the oracle, then a few training steps."""
  pytest.importorskip("optax", reason='needs the examples extra: pip install -e ".[examples]"')
  assert _load("act").main(["--quick", "--steps", "6"]) == 0
  out = capsys.readouterr().out
  assert out.count("N identical") == 2    # the example also bounds the output difference
  assert "1. per example" in out and "2. per token" in out
  assert out.rstrip().endswith("OK")
