"""What differs between the JAX versions pallas_loop supports, in one place.

The floor is JAX 0.10.2 (Python 3.11: the TPU machine's, where the Mosaic
kernels have run), the pin 0.11.2, and the newest release; CI tests all
three (`.ci/run`). Code that must behave differently on one of them asks
here, so each difference has one name, its reason and its test.
"""

from __future__ import annotations

import re

import jax


def parse(version: str) -> tuple[int, ...]:
  """A JAX version string as a tuple of its leading numbers.

  Example:
    >>> parse("0.12.0.1"), parse("0.10.2"), parse("0.11.0.dev20260101")
    ((0, 12, 0, 1), (0, 10, 2), (0, 11, 0))
  """
  numbers = []
  for part in version.split("."):
    match = re.match(r"\d+", part)
    if match is None:
      break
    numbers.append(int(match.group()))
    if match.group() != part:  # "0.dev2026...": the numbers end here
      break
  return tuple(numbers)


JAX = parse(jax.__version__)

# JAX < 0.11 traces a custom_vjp's backward under `jax.vmap` only when the
# gradient is transposed, after the vmap's trace has ended: a step that closes
# over a batched value (a per-example array, or the key under a vmap over
# keys) then touches a dead tracer when the backward retraces it
# (UnexpectedTracerError). So `iterate` traces its backward once more in the
# forward, while those values are live, and `StepFn` keeps each traced shape
# for the backward to reuse (tests/test_keys.py::test_per_example_keys_under_vmap,
# tests/test_gradients.py::test_grad_of_vmap_over_a_closed_over_array).
BACKWARD_TRACED_AFTER_VMAP = JAX < (0, 11)
