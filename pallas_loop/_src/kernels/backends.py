"""The compiled backends `dispatch` chooses among: the one list of them.

A backend is a `backend.Backend` value in a module of its own
(`backend_<name>.py`) that holds all that is its own: platforms, launch,
rules, tile heights, interpret mode, its own kernel if it has one. Adding one
is that module plus a line in `BUILT_IN`; nothing else in the library names a
backend (`tests/test_backend_registry.py` checks both: a backend registered
from a test file alone is planned, run and tuned for).

Interpret mode is not listed here: `backend_interpret.py` makes, for every
backend listed, the interpret backend that applies its rules on the CPU.
"""

from __future__ import annotations

from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backend_mosaic_tpu
from pallas_loop._src.kernels import backend_triton

# In the order messages list them ("a GPU (Triton) or TPU (Mosaic) platform").
BUILT_IN: tuple[backend_lib.Backend, ...] = (backend_triton.TRITON, backend_mosaic_tpu.MOSAIC_TPU)

# The target whose rules interpret mode applies when the caller names none
# (`Options(interpret=None or True)`): the TPU, where the kernels have run.
DEFAULT_INTERPRET_TARGET = backend_mosaic_tpu.MOSAIC_TPU

_registered: list[backend_lib.Backend] = []


def compiled() -> tuple[backend_lib.Backend, ...]:
  """Every compiled backend: the built-in ones, then those `register`ed.

  Example:
    >>> [b.name for b in compiled()]
    ['triton', 'mosaic_tpu']
  """
  return BUILT_IN + tuple(_registered)


def register(backend: backend_lib.Backend) -> backend_lib.Backend:
  """Adds a compiled backend (a backend outside the library, or a test's).

  Args:
    backend: a `Backend` with a new name, lowering platforms no listed
      backend serves, and a new `device_platform`.

  Returns:
    `backend`, for `X = register(Backend(...))`.

  Raises:
    ValueError: it would clash with a listed backend, or names no platform.
  """
  if not backend.platforms or backend.device_platform is None:
    raise ValueError(f"backend {backend.name!r} needs platforms= (the lowering platforms it "
                     "compiles for) and device_platform=; interpret mode is not registered.")
  for other in compiled():
    shared = set(other.platforms) & set(backend.platforms)
    if (other.name == backend.name or shared
        or other.device_platform == backend.device_platform):
      raise ValueError(f"backend {backend.name!r} clashes with the backend {other.name!r} "
                       f"(its name, platforms {other.platforms} or device platform "
                       f"{other.device_platform!r}): give it its own.")
  _registered.append(backend)
  return backend


def unregister(backend: backend_lib.Backend) -> None:
  """Removes a backend `register` added (ValueError if it was not added)."""
  if backend not in _registered:
    raise ValueError(f"backend {backend.name!r} was not registered (built-in backends "
                     "cannot be removed).")
  _registered.remove(backend)


def for_device_platform(device_platform: str) -> backend_lib.Backend | None:
  """The compiled backend whose devices are of `device_platform` ("tpu",
  "gpu", ... as `jax.default_backend()` names them), or None.

  Example:
    >>> for_device_platform("gpu").name, for_device_platform("cpu")
    ('triton', None)
  """
  return next((b for b in compiled() if b.device_platform == device_platform), None)
