"""Test configuration: strict dtype promotion catches silent upcasts."""

import pathlib

import jax
import pytest


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield


def pytest_ignore_collect(collection_path, config):
  """`multidevice_sharding.py` runs only when named (test_sharding.py does so in
  a subprocess with 8 devices): collected for doctests it would only skip."""
  if collection_path.name == "multidevice_sharding.py":
    named = any(pathlib.Path(arg.split("::")[0]).name == collection_path.name
                for arg in config.args)
    return None if named else True
  return None
