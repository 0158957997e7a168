"""Test configuration: strict dtype promotion catches silent upcasts."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield

