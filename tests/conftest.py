"""Test configuration: strict dtype promotion catches silent upcasts; CI's
share of the slow sweeps; one XLA compilation cache for the run."""

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


def _in_sample(nodeid: str, seed: str, share: float) -> bool:
  """Whether a test is in the sample: the SHA-256 of (seed, test id) read as
  a fraction in [0, 1) is below `share`, so every test is drawn as seeds
  change, and a seed always draws the same tests."""
  digest = hashlib.sha256(f"{seed}|{nodeid}".encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2**64 < share


def pytest_collection_modifyitems(config, items):
  share = config.getoption("--slow-share")
  if share is None:
    return
  seed = config.getoption("--slow-seed")
  keep, drop = [], []
  for item in items:
    sampled = item.get_closest_marker("slow") is None or _in_sample(item.nodeid, seed, share)
    (keep if sampled else drop).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_report_header(config):
  share = config.getoption("--slow-share")
  if share is None:
    return None
  seed = config.getoption("--slow-seed")
  return (f"slow tests: a {share:g} share, seed {seed!r} "
          f"(pytest -m slow --slow-share {share:g} --slow-seed {seed} draws them again)")


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
