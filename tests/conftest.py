"""Test configuration: strict dtype promotion catches silent upcasts."""

import jax
import pytest


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
  from pallas_loop._src import backend_interpret  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(backend_interpret, "ON_TPU",
                      dataclasses.replace(backend_interpret.ON_TPU, checks=None))
