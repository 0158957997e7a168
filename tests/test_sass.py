"""benchmarks/sass.py (the loop's SASS counts) and the compile check's ptxas capture.

The samples in tests/data/ are `nvdisasm -c` of the H200 kernels the deviceless
compile check built for the tanh RNN at D=128 bfloat16 (JAX 0.11.2, ptxas and
nvdisasm 13.5.37, before loop-invariant hoisting), so the parser is tested
without the compilers.
"""

from __future__ import annotations

import gzip
import os
import subprocess

import pytest

from benchmarks import compile_check, sass

DATA = os.path.join(os.path.dirname(__file__), "data")


def _sample(name: str) -> str:
  path = os.path.join(DATA, name)
  opener = gzip.open if name.endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def test_forward_kernel_loop_counts_match_the_disassembly():
  functions = sass.parse(_sample("sass_tanh_rnn_fwd_h200.sass"))
  assert list(functions) == ["pallas_loop_iterate_fwd"]
  report = sass.loop_report(functions["pallas_loop_iterate_fwd"])
  # One loop: the step's while loop, from .L_x_1 (0x930) to its back branch (0x1820).
  assert report["loops"] == 1 and report["loop"] == [0x930, 0x1820]
  trip = report["per_trip"]
  # h @ W + x @ U in two 16-deep HMMA chains, 16 LDSM.x4 of the weights, tanh per element.
  assert (trip["instructions"], trip["hmma"], trip["ldsm"], trip["bar"], trip["mufu"]) == (
      240, 32, 16, 2, 16)
  assert trip["hgmma"] == 0 and trip["ldg"] == trip["stg"] == 0
  assert report["inner_loops"] == [] and report["other_step_loops"] == []
  assert report["total"]["instructions"] > trip["instructions"]


def test_hoisting_halves_the_dependent_mma_chain_and_leaves_the_elementwise_math():
  # The same kernel compiled with x @ U hoisted out of the loop (the default).
  before, after = (sass.loop_report(sass.parse(_sample(name))["pallas_loop_iterate_fwd"])
                   ["per_trip"] for name in ("sass_tanh_rnn_fwd_h200.sass",
                                             "sass_tanh_rnn_fwd_hoisted_h200.sass"))
  # Before: h @ W + x @ U accumulated as one chain of K/16 = 16 MMAs per
  # accumulator; after: h @ W alone, 8 deep.
  assert (before["hmma"], before["mma_chain"]) == (32, 16)
  assert (after["hmma"], after["mma_chain"]) == (16, 8)
  # The tanh (libdevice's: two MUFU and ~13 FP instructions per element, 8
  # elements a thread) is most of a trip either way.
  assert before["float_math"] == after["float_math"] == 120
  assert (before["instructions"], after["instructions"]) == (240, 219)


def test_backward_kernel_has_three_step_loops_and_the_vjp_is_the_main_one():
  function = sass.parse(_sample("sass_tanh_rnn_bwd_h200.sass.gz"))["pallas_loop_iterate_bwd"]
  all_loops = sass.loops(function)
  assert len(all_loops) == 5  # the checkpointed window: nested loops around the steps
  steps = sass.step_loops(function)
  assert len(steps) == 3
  counts = [sass.count([i for i in function.instructions if l.start <= i.address <= l.end])
            for l in steps]
  # Forward with checkpoints, recomputation, VJP: each innermost, each a step's worth of MMAs.
  assert [c["hmma"] for c in counts] == [32, 32, 96]
  report = sass.loop_report(function)
  assert report["loop"] == [steps[2].start, steps[2].end]
  assert report["per_trip"]["instructions"] == 1474 and report["per_trip"]["hgmma"] == 4
  assert [l["instructions"] for l in report["other_step_loops"]] == [250, 271]


_K_CHUNKED = """
  .section .text.pallas_loop_iterate_fwd,"ax",@progbits
  /*0000*/   MOV R0, RZ ;
.L_x_0:
  /*0010*/   LDSM.16.M88.4 R4, [R2] ;
.L_x_1:
  /*0020*/   LDS.128 R8, [R3] ;
  /*0030*/   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
  /*0040*/   IADD3 R3, R3, 0x100, RZ ;
  /*0050*/   @P1 BRA `(.L_x_1) ;
  /*0060*/   MUFU.TANH R12, R12 ;
  /*0070*/   BAR.SYNC.DEFER_BLOCKING 0x0 ;
  /*0080*/   NOP ;
  /*0090*/   @P0 BRA `(.L_x_0) ;
  /*00a0*/   EXIT ;
.L_x_2:
  /*00b0*/   BRA `(.L_x_2);
"""


def test_a_dot_split_in_k_chunks_counts_the_loop_around_it():
  function = sass.parse(_K_CHUNKED)["pallas_loop_iterate_fwd"]
  # The trap after EXIT branches to itself: not a loop.
  assert sass.loops(function) == [sass.Loop(0x10, 0x90), sass.Loop(0x20, 0x50)]
  report = sass.loop_report(function)
  assert report["loop"] == [0x10, 0x90]
  # Counted once per trip, NOP excluded; the K loop is reported apart.
  assert report["per_trip"]["instructions"] == 8
  assert (report["per_trip"]["hmma"], report["per_trip"]["mufu"]) == (1, 1)
  assert [(l["start"], l["instructions"], l["hmma"]) for l in report["inner_loops"]] == [
      (0x20, 4, 1)]


def test_a_kernel_without_a_loop_holding_an_mma_has_no_step_loop():
  function = sass.parse("""
  .section .text.k
.L_x_0:
  /*0000*/   FADD R0, R0, R1 ;
  /*0010*/   @P0 BRA `(.L_x_0) ;
  /*0020*/   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
  """)["k"]
  report = sass.loop_report(function)
  assert report["loop"] is None and report["per_trip"] is None and report["loops"] == 1


@pytest.mark.parametrize("registers, smem, warps, want, limit", [
    (128, 73_728, 8, 2, "by_registers"),      # the tanh RNN's forward before hoisting
    (246, 204_800, 8, 1, "by_registers"),     # the GRU's forward before hoisting
    (56, 73_728, 8, 3, "by_shared_memory"),   # 76,800 B with the reserved 1 KB: three fit
    (32, 0, 16, 4, "by_warps"),
    (16, 0, 1, 32, "by_blocks"),
])
def test_programs_per_sm(registers, smem, warps, want, limit):
  got = sass.programs_per_sm(registers, smem, warps)
  assert got["programs"] == want == got[limit]


def test_register_allocation_rounds_up_to_eight_per_thread():
  # 130 registers take 136 (a warp's 4,352 rounds to 4,352: 17 units of 256).
  assert sass.programs_per_sm(130, 0, 8)["by_registers"] == 65_536 // (136 * 32 * 8)


def test_ptxas_wrapper_keeps_the_ptx_and_cubin(tmp_path, monkeypatch):
  real = tmp_path / "real"
  (real / "bin").mkdir(parents=True)
  (real / "nvvm").mkdir()
  fake_ptxas = real / "bin" / "ptxas"
  # A stand-in for ptxas: writes its output file, and fails on an input named bad.ptx.
  fake_ptxas.write_text('#!/bin/sh\nprev=""\nfor a in "$@"; do\n'
                        '  case "$a" in *bad.ptx) exit 3;; esac\n'
                        '  if [ "$prev" = "-o" ]; then echo cubin > "$a"; fi; prev="$a"\n'
                        'done\n')
  fake_ptxas.chmod(0o755)
  (real / "bin" / "nvdisasm").write_text("")
  monkeypatch.setenv("CUDA_ROOT", str(real))
  dump = tmp_path / "dump"
  dump.mkdir()
  env, why_not = compile_check.ptxas_capture(str(dump))
  assert why_not is None
  root = env["CUDA_ROOT"]
  assert os.path.islink(os.path.join(root, "nvvm"))           # libdevice stays reachable
  assert os.path.islink(os.path.join(root, "bin", "nvdisasm"))
  ptx = tmp_path / "kernel.ptx"
  ptx.write_text(".visible .entry pallas_loop_iterate_fwd(\n")
  out = tmp_path / "kernel.cubin"
  wrapper = os.path.join(root, "bin", "ptxas")
  done = subprocess.run([wrapper, str(ptx), "-o", str(out), "-arch=sm_90a", "-v"], check=False)
  assert done.returncode == 0 and out.read_text() == "cubin\n"
  bad = tmp_path / "bad.ptx"
  bad.write_text("")
  failed = subprocess.run([wrapper, str(bad), "-o", str(tmp_path / "bad.cubin")], check=False)
  assert failed.returncode == 3  # ptxas's own status comes back; nothing is kept
  kept = sorted(os.listdir(dump / "capture"))
  assert len(kept) == 2 and kept[0].endswith(".cubin") and kept[1].endswith(".ptx")
  with open(dump / "capture" / kept[1]) as f:
    assert "pallas_loop_iterate_fwd" in f.read()


def test_capture_reports_why_without_nvdisasm(tmp_path, monkeypatch):
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "ptxas").write_text("")
  monkeypatch.setenv("CUDA_ROOT", str(tmp_path))
  env, why_not = compile_check.ptxas_capture(str(tmp_path / "dump"))
  assert env == {} and "nvdisasm" in why_not


def _result(label, kernels, capture=None):
  return {"case": {"target": "h200", "control": False}, "label": label, "compiled": True,
          "sass_capture": capture, "kernel_resources": kernels}


def test_loop_table_rows_and_missing_captures():
  report = sass.loop_report(sass.parse(_sample("sass_tanh_rnn_fwd_h200.sass"))[
      "pallas_loop_iterate_fwd"])
  kernels = {"pallas_loop_iterate_fwd": {
      "registers": 128, "spill_store_bytes": 0, "spill_load_bytes": 0, "grid": 256,
      "threads": 256, "shared_memory_bytes": 73_728, "sass": report}}
  table = compile_check.loop_table([
      _result("tanh_rnn D=128 bfloat16 full", kernels),
      _result("gru D=128 bfloat16 full", {}, capture="no nvdisasm in /x/bin")])
  row = next(l for l in table.splitlines() if "pallas_loop_iterate_fwd" in l)
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[2:] == ["256", "8", "128", "0 / 0", "73,728", "**2** (2, 3, 8)", "240", "32",
                       "0", "16", "0", "2", "16", "16", "120", "none", "none"]
  assert "* gru D=128 bfloat16 full: not captured: no nvdisasm in /x/bin" in table
  assert compile_check.loop_table([]) == ""


def _h200(label, fwd, bwd):
  def kernel(instructions, mma, registers, spills, smem):
    return {"registers": registers, "spill_store_bytes": spills, "threads": 256,
            "shared_memory_bytes": smem,
            "sass": {"per_trip": {"instructions": instructions, "hmma": mma, "hgmma": 0}}}
  return {"case": {"target": "h200", "control": False}, "label": label, "compiled": True,
          "kernel_resources": {"pallas_loop_iterate_fwd": kernel(*fwd),
                               "pallas_loop_iterate_bwd": kernel(*bwd)}}


def _gru_hoist_lines(before, after):
  """The hoisting table's forward and backward lines for a GRU whose
  hoist=False and default kernels are `before` and `after`: ((fwd), (bwd))
  each as `_h200` takes them."""
  table = compile_check.hoist_table([
      _h200("gru D=128 bfloat16 full hoist=False", *before),
      _h200("gru D=128 bfloat16 full", *after)])
  return tuple(next(l for l in table.splitlines() if f"iterate_{k}" in l)
               for k in ("fwd", "bwd"))


def test_hoist_table_reports_each_goal():
  fwd, bwd = _gru_hoist_lines(
      ((671, 96, 246, 0, 204_800), (5957, 300, 255, 1068, 36_864)),
      ((610, 48, 102, 0, 102_400), (3477, 150, 255, 408, 36_864)))
  assert "671 -> 610 (-9%)" in fwd and "96 -> 48" in fwd and "1 -> 2" in fwd
  assert ("MMA <= 1/2: met, SASS -40% of the issue's 671: MISSED, no spills: met, "
          "programs >= 2: met" in fwd)
  assert "5,957 -> 3,477 (-42%)" in bwd and "1,068 -> 408" in bwd
  assert compile_check.hoist_table([]) == ""
  # The instruction goal is against the trip, not hoist=False's.
  fwd, _ = _gru_hoist_lines(
      ((319, 96, 255, 0, 204_800), (5687, 300, 255, 1152, 36_864)),
      ((266, 48, 106, 0, 102_400), (3172, 150, 255, 440, 36_864)))
  assert "319 -> 266 (-17%)" in fwd and "SASS -40% of the issue's 671: met" in fwd
