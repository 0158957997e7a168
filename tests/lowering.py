"""Lowering the kernels for GPU and TPU on a CPU-only machine, via jax.export."""

from __future__ import annotations

import warnings

import jax
from jax import export
from jax.sharding import AbstractMesh

try:  # public from some JAX version on; private in 0.11
  from jax.sharding import AbstractDevice  # type: ignore[attr-defined]
except ImportError:
  from jax._src.mesh import AbstractDevice

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as pl_triton

# Public from JAX 0.11; the same string before.
TRITON_CALL = getattr(pl_triton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")

TARGETS = {
    # platform: (abstract device kind, device platform, text proving the kernel)
    "cuda": ("NVIDIA H200", "gpu", TRITON_CALL),
    "tpu": ("TPU v5 lite", "tpu", "tpu_custom_call"),
}


def export_text(fn, *args, platform: str) -> str:
  """StableHLO text of `jit(fn)(*args)` exported for `platform`.

  `args` must be built outside this function (outside the abstract mesh).
  """
  kind, device_platform, _ = TARGETS[platform]
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind=kind, num_cores=None, platform=device_platform))
  with jax.sharding.use_abstract_mesh(mesh):
    exported = export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  return exported.mlir_module()


def kernel_marker(platform: str) -> str:
  return TARGETS[platform][2]
