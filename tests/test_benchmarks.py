"""The benchmark scripts run and agree with the reference (not timed tests)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from benchmarks import attention_check
from benchmarks import cases
from benchmarks import feature_check
from benchmarks import gpu_check
from benchmarks import harness
from benchmarks import run
from pallas_loop import _reference as reference


def test_every_implementation_agrees_on_a_tiny_case():
  # 80 rows: above xla_forward.ONE_STAGE_ROWS, so the XLA loop runs in stages.
  results = harness.run_case(cases.Case("tanh_rnn", 80, 16, 5, "bimodal"), None, repeats=1)
  assert [r["impl"] for r in results] == list(harness.IMPLEMENTATIONS)
  assert all(r["ok"] for r in results), results
  assert results[0]["ideal_speedup"] > 1
  for r in results:
    assert 0 < r["work_efficiency"] <= 1
    assert r["compile_seconds"] > 0  # lowering + compilation, measured per implementation
  by_impl = {r["impl"]: r for r in results}
  # Skipping finished rows computes less than the masked scan.
  assert by_impl["xla"]["work_efficiency"] > by_impl["masked_scan"]["work_efficiency"]


def test_forward_backward_case_leaves_out_vmap_while():
  results = harness.run_case(cases.Case("gru", 20, 16, 4, "uniform", grad="full"), None,
                             repeats=1)
  assert [r["impl"] for r in results] == ["masked_scan", "hoisted_scan", "xla", "pallas"]
  assert all(r["ok"] for r in results), results
  assert all(r["speedup_vs_vmap_while"] is None for r in results)


@pytest.mark.parametrize("name", cases.DISTRIBUTIONS)
def test_count_distributions(name):
  t = cases.DEFAULT_MAX_ITERS[name]
  n = cases.count_distribution(name, 4096, t, seed=1)
  assert n.dtype == np.int32 and n.shape == (4096,)
  assert n.min() >= 1 and n.max() <= t
  np.testing.assert_array_equal(n, cases.count_distribution(name, 4096, t, seed=1))
  if name == "recurrent_depth":
    assert 28 <= n.mean() <= 36 and t == 128
  if name == "geometric":
    assert 4 <= n.mean() <= 6 and t == 20
  if name == "adversarial":  # exactly one slow row per tile
    tiles = n.reshape(-1, cases.ADVERSARIAL_TILE)
    np.testing.assert_array_equal((tiles == t).sum(axis=1), 1)


def test_pallas_work_efficiency_counts_sorted_tiles():
  counts = np.array([1, 8, 1, 1, 8, 1, 1, 1], np.int32)
  # Sorted: tiles of 4 rows hold [8, 8, 1, 1] and [1, 1, 1, 1].
  assert harness.rows_computed("pallas", counts, counts, 8, 4) == 4 * 8 + 4 * 1
  assert harness.rows_computed("masked_scan", counts, counts, 10, 4) == 80
  assert harness.rows_computed("vmap_while", counts, counts, 10, 4) == 64


def test_suites_are_well_formed():
  for name, suite in cases.SUITES.items():
    cs = suite()
    assert cs and len({c.label for c in cs}) == len(cs), name
  full = cases.full_suite()
  assert {c.counts for c in full} == set(cases.DISTRIBUTIONS)
  assert {"tanh_rnn", "gru", "residual_mlp", "transformer"} <= {c.block for c in full}
  assert any(c.d & (c.d - 1) for c in full)  # a non-power-of-2 width
  assert any(c.grad for c in full)
  gpu = cases.gpu_suite()
  assert {c.batch for c in gpu if c.block != "transformer"} == {4096}
  assert {c.d for c in gpu} == {128, 256} and {c.dtype for c in gpu} == {"bfloat16"}


@pytest.mark.slow  # ~35 s; CI runs the main job itself, right after the quick set
def test_main_job_prints_both_tables_and_writes_json(capsys, tmp_path):
  """The README's main job (CI runs the default suite itself, every
  implementation): both tables, and the JSON of every case and mode. One
  implementation here: each is checked against the masked scan on a tiny
  case by `test_every_implementation_agrees_on_a_tiny_case`."""
  out = tmp_path / "r.json"
  assert run.main(["--suite", "smoke", "--repeats", "1", "--impls", "xla",
                   "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "vs scan" in printed and "per gradient mode" in printed and "Phantom" in printed
  payload = json.loads(out.read_text())
  assert {r["case"] for r in payload["results"]} == {c.label for c in cases.smoke_suite()}
  modes = {r["case"].split(" T=")[1].split(" ", 1)[1] for r in payload["grad_modes"]}
  assert any("Truncated" in m for m in modes) and any("Implicit" in m for m in modes)


def test_plot_when_matplotlib_is_installed(tmp_path):
  pytest.importorskip("matplotlib")
  from benchmarks import plot  # pylint: disable=g-import-not-at-top
  results = harness.run_case(cases.Case("tanh_rnn", 16, 16, 4, "uniform"), None, repeats=1)
  plot.speedup_plot(results, str(tmp_path / "p.png"), "test")
  assert (tmp_path / "p.png").stat().st_size > 1000


def test_gpu_check_runs_every_kind_of_item(tmp_path):
  """One item of each kind the accelerator run has (a block check, features,
  a timing, the gradient modes, the tile sweep, a design comparison), in
  smoke mode; every item is the slow test below's."""
  path = tmp_path / "r.jsonl"
  only = ["check tanh_rnn", "feature full gradient", "feature per-step outputs",
          "time tanh_rnn", "gradient modes", "block_rows sweep",
          "design tanh_rnn B=64 forward"]
  argv = ["--smoke", "--budget", "inf", "--out", str(path)]
  assert gpu_check.main(argv + [a for o in only for a in ("--only", o)]) == 0
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  by_item = lambda item: [l for l in lines if l["item"] == item]
  checks = by_item("correctness")
  assert {(c["block"], c["implementation"]) for c in checks} == {
      ("tanh_rnn", None), ("tanh_rnn", "pallas")}
  assert all(c["ok"] for c in checks)
  features = by_item("feature")
  assert [f["feature"] for f in features] == ["full gradient", "per-step outputs"]
  assert all(f["ok"] and f["grads_compared"] for f in features)
  assert by_item("timing") and {r["case"] for r in by_item("timing")} == {
      c.label for c in cases.smoke_suite() if c.block == "tanh_rnn"}
  assert by_item("grad_modes") and all(r["ok"] for r in by_item("grad_modes"))
  assert [r["block"] for r in by_item("block_rows")] == ["tanh_rnn", "residual_mlp"]
  assert lines[-1]["item"] == "done" and lines[-1]["mismatches"] == []


@pytest.mark.slow
def test_gpu_check_smoke_mode_runs_anywhere(tmp_path):
  path = tmp_path / "r.jsonl"
  # No budget: it stands for an accelerator's allowance, and a loaded CPU can
  # take longer than that over the smoke run (which then skips items).
  assert gpu_check.main(["--smoke", "--budget", "inf", "--out", str(path)]) == 0
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  by_item = lambda item: [l for l in lines if l["item"] == item]
  assert by_item("machine")[0]["jax"] == jax.__version__
  checks = by_item("correctness")
  assert {(c["block"], c["implementation"]) for c in checks} == {
      (b, i) for b in ("tanh_rnn", "gru") for i in (None, "pallas")}
  assert all(c["ok"] and c["forward_compile_s"] > 0 for c in checks)
  features = by_item("feature")
  assert [f["feature"] for f in features] == [f.name for f in feature_check.FEATURES]
  assert all(f["ok"] for f in features), [f for f in features if not f["ok"]]
  assert all(f["grads_compared"] for f in features
             if not any(w in f["feature"] for w in ("implicit", "phantom")))
  rows = sum(len(harness._applicable(c)) for c in cases.smoke_suite())  # pylint: disable=protected-access
  assert len(by_item("timing")) == rows
  assert {r["impl"] for r in by_item("grad_modes")} == {"xla", "pallas"}
  assert all(r["ok"] for r in by_item("grad_modes"))
  sweep = by_item("block_rows")
  assert [r["block"] for r in sweep] == ["tanh_rnn", "residual_mlp"]
  assert all(set(r["seconds"]) == {"8", "16"} and r["best"] in (8, 16) for r in sweep)
  assert lines[-1]["item"] == "done" and lines[-1]["mismatches"] == []


def test_attention_check_smoke_mode_runs_anywhere(tmp_path):
  """The UT-ACT script the TPU runs: on a CPU the default path is XLA and
  "pallas" the interpret mode under the TPU's rules (its rewritten dots)."""
  path = tmp_path / "a.jsonl"
  assert attention_check.main(["--smoke", "--dtypes", "float32", "--out", str(path)]) == 0
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  assert [(l["implementation"], l["what"]) for l in lines] == [
      (None, "forward"), (None, "grad"), ("pallas", "forward"), ("pallas", "grad")]
  assert all(l["ok"] and "error" not in l for l in lines), lines
  assert lines[3]["kernels"] == ["pallas_loop_iterate_fwd", "pallas_loop_iterate_bwd"]


def test_gpu_check_stops_starting_items_when_the_budget_is_spent(tmp_path):
  path = tmp_path / "r.jsonl"
  assert gpu_check.main(["--smoke", "--budget", "0", "--out", str(path)]) == 0
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  assert {l["item"] for l in lines} == {"machine", "skipped", "done"}


def test_gpu_check_skips_items_by_prefix(tmp_path):
  path = tmp_path / "r.jsonl"
  assert gpu_check.main(["--smoke", "--budget", "0", "--skip", "feature", "--skip", "check",
                         "--out", str(path)]) == 0
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  by_reason = {l["name"]: l["reason"] for l in lines if l["item"] == "skipped"}
  assert all(r == "--skip" for n, r in by_reason.items() if n.startswith(("feature", "check")))
  assert any(n.startswith("feature") for n in by_reason)
  assert all("budget" in r for n, r in by_reason.items() if n.startswith("design"))


def test_gpu_check_runs_only_the_items_asked_for(tmp_path):
  path = tmp_path / "r.jsonl"
  assert gpu_check.main(["--smoke", "--only", "check tanh_rnn", "--out", str(path)]) == 0
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  ran = [l for l in lines if l["item"] not in ("machine", "skipped", "done")]
  assert ran and all(l["block"] == "tanh_rnn" for l in ran)
  assert all(l["reason"] == "--only" for l in lines if l["item"] == "skipped")


def test_timing_is_per_application_with_the_floor_left_out():
  # One row per implementation, each with the floor it left out and the
  # chain it was timed over; the hoisted scan runs where the block has one.
  rows = harness.run_case(cases.Case("gru", 32, 16, 4, "uniform"), None, repeats=1)
  assert [r["impl"] for r in rows] == list(harness.IMPLEMENTATIONS)
  for r in rows:
    assert r["floor_seconds"] > 0 and r["chain"] >= harness.default_chain() and r["seconds"] > 0
    assert r["ns_per_row_step"] > 0 and r["speedup_vs_hoisted_scan"] > 0
  rows = harness.run_case(cases.Case("residual_mlp", 16, 16, 4, "uniform"), None, repeats=1)
  assert "hoisted_scan" not in [r["impl"] for r in rows]



def test_gradient_mode_benchmark_agrees_on_a_tiny_case():
  from benchmarks import grad_modes
  case = grad_modes.GradCase("tanh_rnn", 16, 16, 4, pallas_loop.Truncated(2))
  rows = grad_modes.run_case(case, ["xla", "pallas"], repeats=1)
  assert [r["impl"] for r in rows] == ["xla", "pallas"]
  assert all(r["ok"] and r["checked"] for r in rows), rows
  assert all(r["temp_bytes"] > 0 for r in rows)


def test_gradient_mode_benchmark_checks_halting_at_the_implementations_own_steps():
  from benchmarks import grad_modes
  case = grad_modes.GradCase("deq", 16, 16, 32, "full", tol=1e-5, counts="constant")
  rows = grad_modes.run_case(case, ["xla", "pallas"], repeats=1)
  for r in rows:
    assert r["ok"] and r["checked"], r
    assert r["rows_halting_elsewhere"] == 0 and r["max_step_gap"] == 0
    assert r["rel_diff_vs_ref_at_own_steps"] < 1e-5


def test_halting_keeps_the_step_that_met_tol_so_fixed_counts_reproduce_its_gradient():
  # What grad_modes' halting check rests on: the oracle with `tol` and the
  # oracle run for exactly its halting steps (no `tol`) give one gradient.
  from benchmarks import blocks
  step, params, h0, x = blocks.make("deq", 16, 16, jnp.float32, jax.random.key(0))
  kw = dict(max_iters=32)
  _, info = reference.iterate(step, params, h0, x, tol=1e-4, return_info=True, **kw)
  assert int(jnp.min(info.steps)) < int(jnp.max(info.steps))  # rows halted apart
  g_tol = jax.grad(lambda p: jnp.sum(reference.iterate(step, p, h0, x, tol=1e-4, **kw)))(params)
  g_at = jax.grad(lambda p: jnp.sum(reference.iterate(step, p, h0, x, iters=info.steps,
                                                      **kw)))(params)
  for a, b in zip(jax.tree.leaves(g_tol), jax.tree.leaves(g_at)):
    np.testing.assert_array_equal(a, b)


def test_row_cost_probe_runs(capsys):
  from benchmarks import row_cost
  assert row_cost.main(["--block", "tanh_rnn", "--batch", "32", "--d", "16", "--steps", "2",
                        "--repeats", "1"]) == 0
  assert "S=   32" in capsys.readouterr().out
  assert row_cost.main(["--block", "tanh_rnn", "--batch", "32", "--d", "16", "--steps", "2",
                        "--repeats", "1", "--bound"]) == 0
  out = capsys.readouterr().out
  assert "uniform" in out and "recurrent_depth" in out and "of the ideal at most" in out


def test_prefix_schedule_bound():
  from benchmarks import row_cost
  # Trip 0 runs 2 rows, trip 1 one row: c(2) + min(c(1), c(2)).
  assert row_cost.prefix_schedule_bound(np.array([2, 1]), {1: 1.0, 2: 1.5}) == 2.5
  # A cheaper larger step is used for fewer rows (c is not monotone on a CPU).
  assert row_cost.prefix_schedule_bound(np.array([3, 1, 1]), {1: 5.0, 2: 4.0, 3: 6.0}) == 14.0


def test_fraction_of_peak_only_where_the_peak_is_known():
  assert harness.peak_tflops("NVIDIA H200", "bfloat16") == 989.0
  assert harness.peak_tflops("NVIDIA H200", "float32") is None
  assert harness.peak_tflops("cpu", "bfloat16") is None
  rows = harness.run_case(cases.Case("tanh_rnn", 16, 16, 4, "uniform"), ["xla"], repeats=1)
  assert all(r["fraction_of_peak"] is None for r in rows)  # CPU: no data-sheet peak


@pytest.mark.slow  # 51 s of the quick set's CPU time: a developer's sweep, not a user's command
def test_ladder_sweep_runs_on_the_smoke_suite(capsys):
  from benchmarks import ladder
  assert ladder.main(["--min-rows", "16,64", "--rounds", "1", "--repeats", "1",
                      "--suite", "smoke"]) == 0
  out = capsys.readouterr().out
  assert "MISMATCH" not in out and out.count("\n") >= 3


def test_deq_solvers_table(capsys):
  """benchmarks/deq_solvers.py runs and prints its table (one map, two solvers)."""
  from benchmarks import deq_solvers
  assert deq_solvers.main(["--maps", "collinear", "--solvers", "Damped(1.0),Broyden(20)",
                           "--repeats", "1", "--max-iters", "10"]) == 0
  out = capsys.readouterr().out
  assert "python -m benchmarks.deq_solvers --tol 1e-06 --max-iters 10 --repeats 1" in out
  rows = [line.split() for line in out.splitlines() if line.startswith("collinear")]
  assert [r[1] for r in rows] == ["Damped(1.0)", "Broyden(20)"]
  assert rows[1][2] == "16/16" and rows[1][3] == "3/3/3" and rows[0][2] == "0/16"


@pytest.mark.slow  # a TPU diagnostic: run here at a tiny size, every variant, to keep it working
@pytest.mark.parametrize("flags", [["--parts", "--pieces", "--chunks", "64"],
                                   ["--grad", "--pieces", "--parts"]])
def test_tpu_split_runs_every_variant(tmp_path, flags):
  from benchmarks import tpu_split  # pylint: disable=g-import-not-at-top
  out = tmp_path / "split.jsonl"
  assert tpu_split.main(["--batches", "128", "--counts", "uniform", "--repeats", "1",
                         "--out", str(out)] + flags) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert lines and all("error" not in r and "ms" in r for r in lines), lines
  names = {r["variant"] for r in lines}
  if "--grad" in flags:
    assert {"grad masked_scan", "grad whole", "grad sorted", "grad whole no pieces",
            "grad whole, active rows searched"} <= names
  else:
    assert {"whole", "sorted", "permutation", "whole C=64", "sorted no pieces",
            "parts: sort + active_rows (compare all)", "parts: rank by counting",
            "whole, active rows searched", "sorted, active rows searched",
            "whole, row kernels without the order's view"} <= names


def test_counting_rank_is_the_sorts_inverse():
  # `tpu_split`'s sort-free rank: each row's place in the stable descending
  # order, as the inverse of the library's sort (counts with ties, and 0).
  from benchmarks import tpu_split  # pylint: disable=g-import-not-at-top
  from pallas_loop._src import tiling  # pylint: disable=g-import-not-at-top
  counts = jnp.asarray(np.random.default_rng(3).integers(0, 17, 512), jnp.int32)
  _, order = tiling.sorted_descending(counts)
  np.testing.assert_array_equal(tpu_split.counting_rank(counts, 16),
                                tiling.inverse_permutation(order))


@pytest.mark.slow  # a TPU diagnostic: run here at a tiny size, every variant, to keep it working
def test_deq_split_runs_every_variant(tmp_path):
  from benchmarks import deq_split  # pylint: disable=g-import-not-at-top
  out = tmp_path / "deq.jsonl"
  assert deq_split.main(["--batch", "64", "--d", "16", "--max-iters", "16", "--repeats", "1",
                         "--chunks", "32", "--order", "ordered,shuffled",
                         "--out", str(out)]) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  cases = [r for r in lines if "steps_min" in r]
  assert len(cases) == 2 and all(1 <= r["steps_min"] <= r["steps_max"] <= 16 for r in cases)
  adjoints = [r for r in lines if "adjoint_steps_min" in r]
  assert len(adjoints) == 2 and all(
      0 <= r["adjoint_steps_min"] <= r["adjoint_steps_max"] <= 16 for r in adjoints)
  timed = [r for r in lines if "variant" in r]
  assert timed and all("error" not in r and r["ms"] > 0 for r in timed), timed
  assert {"forward tol", "forward at its steps", "forward tol C=32", "grad Full",
          "grad Implicit", "grad Phantom(4)", "grad Implicit C=32",
          "grad Implicit, caller's order", "adjoint tol",
          "adjoint at its steps", "forward tol, whole chunks", "grad Implicit, whole chunks",
          "grad Phantom(4), whole chunks",
          "adjoint tol, whole chunks"} <= {r["variant"] for r in timed}


@pytest.mark.slow  # a TPU diagnostic's interpreted scalar loops (15 kernels, 40 s)
def test_tpu_compaction_moves_rows_as_numpy_does(tmp_path):
  # `tpu_compaction`'s kernels in interpret mode: every variant's state,
  # column and permutation equal numpy's, with no row running, some, and all.
  from benchmarks import tpu_compaction  # pylint: disable=g-import-not-at-top
  out = tmp_path / "compaction.jsonl"
  assert tpu_compaction.main(["--rows", "256", "--running", "0.0,0.3,1.0",
                              "--out", str(out)]) == 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(lines) == 3 * len(tpu_compaction.VARIANTS)
  assert all(r.get("checked") and not r.get("mismatch") for r in lines), lines
