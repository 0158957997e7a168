"""Rows sharded over the devices of two processes (docs/sharding.md, Several hosts).

Starts `tests/multiprocess_sharding.py`, an absltest program, as two JAX
processes on this machine: a coordinator on 127.0.0.1 and a free port, 4 CPU
devices each, Gloo collectives over loopback. Together they form one 8-device
mesh; each checks its own rows of `pallas_loop.iterate`'s forward and
gradients (XLA implementation and the kernel in interpret mode) against one
process computing the same batch unsharded.

Bounded: each process dumps its stacks and exits after `TIMEOUT_S`; the
launcher kills both (their process groups) once either fails, or when the
deadline passes, so a peer left waiting in a collective never outlives the test.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
# After one process fails, how long its peers may still run (to print their
# own failure) before they are killed.
GRACE_S = 5


@dataclasses.dataclass
class _Finished:
  """How one process of a run ended.

  Attributes:
    returncode: its exit status (negative: killed by that signal).
    output: its stdout and stderr, interleaved.
    killed: whether the launcher killed it.
  """
  returncode: int
  output: str
  killed: bool


def _free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now.

  Returns:
    The port number (the socket that found it is closed again).
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_processes(num_processes: int = 2, *, timeout_s: int = TIMEOUT_S,
                  extra_args: dict[int, list[str]] | None = None) -> list[_Finished]:
  """Runs `python -m tests.multiprocess_sharding` as `num_processes` JAX processes.

  Each process gets `--process_id`, `--num_processes`, a coordinator on
  127.0.0.1 and a free port, and `--timeout_s`. When one exits with a
  non-zero status, the others are killed `GRACE_S` seconds later; all are
  killed at `timeout_s` + 30 s. Each process runs in its own process group,
  and the whole group is killed.

  Args:
    num_processes: how many processes to start.
    timeout_s: passed to each process (it exits past it), and the launcher's
      deadline less 30 s.
    extra_args: more command-line arguments, by process id.

  Returns:
    One `_Finished` per process, by process id.
  """
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs, logs = [], []
  killed = [False] * num_processes
  try:
    for i in range(num_processes):
      log = tempfile.TemporaryFile(mode="w+")
      logs.append(log)
      cmd = [sys.executable, "-m", "tests.multiprocess_sharding", f"--process_id={i}",
             f"--num_processes={num_processes}", f"--coordinator=127.0.0.1:{port}",
             f"--timeout_s={timeout_s}", *(extra_args or {}).get(i, [])]
      procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s + 30
    failed_at = None
    while True:
      status = [p.poll() for p in procs]  # every one polled: any() would stop early
      if None not in status:
        break
      now = time.monotonic()
      if failed_at is None and any(s not in (None, 0) for s in status):
        failed_at = now
      if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
        break
      time.sleep(0.2)
  finally:
    for i, p in enumerate(procs):
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        killed[i] = True
        p.wait()
  finished = []
  for p, log, was_killed in zip(procs, logs, killed):
    log.seek(0)
    finished.append(_Finished(p.returncode, log.read(), was_killed))
    log.close()
  return finished


def _run_processes_on_a_free_port(*args, **kwargs) -> list[_Finished]:
  """`_run_processes`, again on another port if the coordinator could not
  bind its port (taken between `_free_port` and the bind), up to 3 times.

  Args:
    *args: passed to `_run_processes`.
    **kwargs: passed to `_run_processes`.

  Returns:
    The last attempt's `_Finished` per process.
  """
  for _ in range(3):
    finished = _run_processes(*args, **kwargs)
    if "Failed to start RPC server" not in finished[0].output:
      break
  return finished


def _report(finished: list[_Finished]) -> str:
  return "\n".join(f"===== process {i}: status {f.returncode}, killed {f.killed}\n{f.output}"
                   for i, f in enumerate(finished))


def test_rows_sharded_over_two_processes_match_one_process():
  start = time.monotonic()
  finished = _run_processes_on_a_free_port(2)
  report = _report(finished)
  for f in finished:
    assert f.returncode == 0 and not f.killed, report
    # unittest ends with "OK"; anything skipped would read "OK (skipped=N)".
    assert re.search(r"^Ran [1-9]\d* tests? in .*\n\nOK$", f.output, re.M), report
    assert "test_forward_and_grads_match_one_process_pallas" in f.output, report
  print(f"two-process run: {time.monotonic() - start:.1f} s")


def test_a_process_that_dies_takes_its_peer_down():
  # Process 1 exits right after joining; process 0 goes on to its first
  # collective, where it would wait for process 1 until the heartbeat
  # timeout. The launcher kills it GRACE_S seconds after process 1 failed.
  start = time.monotonic()
  finished = _run_processes_on_a_free_port(2, extra_args={1: ["--crash_after_init"]})
  report = _report(finished)
  assert finished[1].returncode == 3 and "crashing on purpose" in finished[1].output, report
  # Killed by the launcher, not by its own heartbeat timeout (30 s).
  assert finished[0].killed and finished[0].returncode == -signal.SIGKILL, report
  assert time.monotonic() - start < 60, report
