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
