"""gpu_check's design comparison (hoisting, schedules, baselines) on a tiny case."""

from __future__ import annotations

from benchmarks import gpu_check


def test_design_variants_time_check_and_skip_what_options_lack(monkeypatch):
  monkeypatch.setattr(gpu_check, "DESIGN_VARIANTS", (
      ("masked_scan", {}),
      ("vmap_while", {}),
      ("pallas hoist=False", {"hoist": False}),
      ("pallas future option", {"no_such_option": 1}),
  ))
  lines = gpu_check.design_variants("tanh_rnn", 16, 16, 4, repeats=1)
  by = {l["variant"]: l for l in lines}
  assert list(by) == ["masked_scan", "vmap_while", "pallas hoist=False", "pallas future option"]
  skipped = by["pallas future option"]
  assert "no_such_option" in skipped["skipped"] and "seconds" not in skipped
  for name in ("masked_scan", "vmap_while", "pallas hoist=False"):
    line = by[name]
    assert line["ok"] and line["seconds"] > 0 and line["compile_s"] > 0, line
    assert line["speedup_vs_masked_scan"] > 0 and line["speedup_vs_vmap_while"] > 0
  assert by["masked_scan"]["speedup_vs_masked_scan"] == 1.0


def test_design_variants_backward_leaves_out_vmap_while_and_schedules(monkeypatch):
  lines = gpu_check.design_variants("gru", 16, 16, 4, repeats=1, grad=True)
  names = [l["variant"] for l in lines]
  assert names == ["masked_scan", "pallas hoist=True", "pallas hoist=False",
                   "pallas approx_tanh=False"]
  assert all(l["mode"] == "fwd+bwd" for l in lines)
  assert all(l.get("ok") or l.get("skipped") for l in lines), lines
