"""Test configuration: strict dtype promotion catches silent upcasts; CI's
share of the slow sweeps."""

import hashlib

import jax
import pytest


def pytest_addoption(parser):
  group = parser.getgroup("pallas_loop")
  group.addoption(
      "--slow-share", type=float, default=None, metavar="FRACTION",
      help="run only this share of the slow tests (the rest are deselected), "
           "chosen by --slow-seed: what CI runs, a different sample on each commit")
  group.addoption(
      "--slow-seed", default="", metavar="SEED",
      help="the slow sample's seed (CI: the commit hash); the same seed, the same tests")


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
