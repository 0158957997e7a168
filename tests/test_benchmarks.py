"""The benchmark scripts run and agree with the reference (not timed tests)."""

from __future__ import annotations

import pytest

import pallas_loop
from benchmarks import gpu_check
from benchmarks import harness
from benchmarks import run


def test_every_implementation_agrees_on_a_tiny_case():
  results = harness.run_case(harness.Case("tanh_rnn", 24, 16, 5, "bimodal"),
                             list(harness.IMPLEMENTATIONS), repeats=1)
  assert [r["impl"] for r in results] == list(harness.IMPLEMENTATIONS)
  assert all(r["ok"] for r in results), results
  assert results[0]["ideal_speedup"] > 1


@pytest.mark.slow
def test_main_job_exits_zero(capsys):
  assert run.main(["--repeats", "1"]) == 0
  assert "vs scan" in capsys.readouterr().out


def test_gpu_check_smoke_mode_runs_anywhere(tmp_path):
  assert gpu_check.main(["--smoke", "--out", str(tmp_path / "r.json")]) == 0
  assert (tmp_path / "r.json").read_text().count('"impl"') == 8


def test_gradient_mode_benchmark_agrees_on_a_tiny_case():
  from benchmarks import grad_modes
  case = grad_modes.GradCase("tanh_rnn", 16, 16, 4, pallas_loop.Truncated(2))
  rows = grad_modes.run_case(case, ["xla", "pallas"], repeats=1)
  assert [r["impl"] for r in rows] == ["xla", "pallas"]
  assert all(r["ok"] and r["checked"] for r in rows), rows
  assert all(r["temp_bytes"] > 0 for r in rows)
