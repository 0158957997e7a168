"""Test configuration: strict dtype promotion catches silent upcasts; CI's
share of the slow sweeps and its parts of the release tests; one XLA
compilation cache for the run."""

import hashlib
import os
import shutil
import tempfile

import jax
import pytest

# The run's compilation cache: JAX's persistent cache in a fresh folder, made
# by the first pytest process (xdist's controller) before its workers start,
# so they and the subprocesses tests start inherit it. Many tests compile the
# same programs (the oracle's scan, a kernel at the same shapes under another
# name); with the cache each compiles once: tests/test_forward.py,
# test_gradients.py and test_grad_modes.py took 83 s against 148 s on 2 cores.
# A caller's own JAX_COMPILATION_CACHE_DIR is kept as it is. A worker that
# finds an entry unreadable (another still writing it, a full disk) gets JAX's
# warning and compiles the program itself (pyproject.toml lets it pass).
_CACHE_VARIABLES = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
_made_cache = []


def pytest_addoption(parser):
  group = parser.getgroup("pallas_loop")
  group.addoption(
      "--slow-share", type=float, default=None, metavar="FRACTION",
      help="run only this share of the slow tests (the rest are deselected), "
           "chosen by --slow-seed: what CI runs, a different sample on each commit")
  group.addoption(
      "--slow-seed", default="", metavar="SEED",
      help="the slow sample's seed (CI: the commit hash); the same seed, the same tests")
  group.addoption(
      "--part", default=None, metavar="K/N",
      help="run only part K of N of the selected tests (quick and slow alike), the parts "
           "drawn by --part-seed: CI's floor and newest JAX each run one half of the "
           "release tests, complementary, a different split on each commit")
  group.addoption(
      "--part-seed", default="", metavar="SEED",
      help="the split's seed (CI: the commit hash); the same seed, the same parts")


def pytest_configure(config):
  del config
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    folder = tempfile.mkdtemp(prefix="pallas_loop_test_xla_cache_")
    _made_cache.append(folder)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    for name, value in _CACHE_VARIABLES.items():
      os.environ.setdefault(name, value)
  # jax read its environment when imported (above): this process, too.
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  for name in _CACHE_VARIABLES:
    if name in os.environ:
      flag = name.lower()
      jax.config.update(flag, type(getattr(jax.config, flag))(os.environ[name]))


def pytest_unconfigure(config):
  del config
  for folder in _made_cache:
    shutil.rmtree(folder, ignore_errors=True)


def _draw(nodeid: str, seed: str) -> float:
  """The SHA-256 of (seed, test id) read as a fraction in [0, 1): every test
  is drawn as seeds change, and a seed always draws the same tests."""
  digest = hashlib.sha256(f"{seed}|{nodeid}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2**64


def _in_sample(nodeid: str, seed: str, share: float) -> bool:
  """Whether a test is in the sample of a `share` of the tests."""
  return _draw(nodeid, seed) < share


def _part(text: str) -> tuple[int, int]:
  """(K, N) from "K/N", 1 <= K <= N."""
  try:
    k, n = (int(v) for v in text.split("/"))
  except ValueError:
    raise pytest.UsageError(f"--part {text!r}: expected K/N, e.g. 1/2") from None
  if not 1 <= k <= n:
    raise pytest.UsageError(f"--part {text!r}: K must be in 1..N")
  return k, n


def _in_part(nodeid: str, seed: str, k: int, n: int) -> bool:
  """Whether a test is in part k of n: the parts split [0, 1) evenly, so for
  one seed they are disjoint and together hold every test."""
  return (k - 1) / n <= _draw(nodeid, seed) < k / n


def pytest_collection_modifyitems(config, items):
  share = config.getoption("--slow-share")
  part = config.getoption("--part")
  if share is None and part is None:
    return
  seed = config.getoption("--slow-seed")
  k, n = _part(part) if part is not None else (1, 1)
  part_seed = config.getoption("--part-seed")
  keep, drop = [], []
  for item in items:
    sampled = (share is None or item.get_closest_marker("slow") is None
               or _in_sample(item.nodeid, seed, share))
    sampled = sampled and (n == 1 or _in_part(item.nodeid, part_seed, k, n))
    (keep if sampled else drop).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_report_header(config):
  lines = []
  share = config.getoption("--slow-share")
  if share is not None:
    seed = config.getoption("--slow-seed")
    lines.append(f"slow tests: a {share:g} share, seed {seed!r} "
                 f"(pytest -m slow --slow-share {share:g} --slow-seed {seed} draws them again)")
  part = config.getoption("--part")
  if part is not None:
    seed = config.getoption("--part-seed")
    lines.append(f"tests: part {part}, seed {seed!r} (--part {part} --part-seed {seed} "
                 "draws it again)")
  return lines or None


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield


@pytest.fixture
def tpu_step_rules_lifted(monkeypatch):
  """Interpret mode without the TPU's step rules (tests only).

  Interpret mode declines what the TPU kernel declines (`backend_interpret`).
  The backward kernel's logic for what no compiled backend takes yet (untied
  per-step weights: `dynamic_slice` / `dynamic_update_slice` in the VJP) is
  still checked against the oracle, with those rules lifted.
  """
  import dataclasses  # pylint: disable=g-import-not-at-top
  from pallas_loop._src.kernels import backend_interpret  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(backend_interpret.INTERPRETERS, "tpu",
                      dataclasses.replace(backend_interpret.for_option(True), checks=None))
