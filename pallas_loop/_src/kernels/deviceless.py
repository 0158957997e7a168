"""Lowering and compiling for a GPU or a TPU on a machine without either.

Two levels of proof, as `pallas_loop.testing.check_compiles` reports them:

* exported: `jax.export` lowers the function for the target platform under
  an abstract mesh of the target's device kind (so the backends' rules see
  the chip they plan for); the module holds each Pallas kernel it emitted.
  Needs nothing beyond JAX.
* compiled: the target's own compiler compiles it, deviceless, from a
  compile-only topology: libtpu's Mosaic for a TPU v5e (`pip install
  libtpu`, the version `jax[tpu]` pins), XLA's Triton pipeline and ptxas for
  an H200 (`pip install jax-cuda13-plugin jax-cuda13-pjrt nvidia-cuda-nvcc`).
  Where the compiler is not installed, the proof stops at exported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Callable

import jax
from jax import export
from jax import tree_util

from pallas_loop._src.kernels import backends

try:  # public from some JAX version on; private before
  from jax.sharding import AbstractDevice
except ImportError:  # pragma: no cover - depends on the JAX version
  from jax._src.mesh import AbstractDevice

# The Triton custom call, let through `jax.export`'s safety check (public
# from JAX 0.11; the same string before).
TRITON_CALL = "__gpu$xla.gpu.triton"

H200_TARGET = os.path.join(os.path.dirname(__file__), "targets", "h200.txtpb")


@dataclasses.dataclass(frozen=True)
class Target:
  """A chip to lower and compile for.

  Attributes:
    name: "tpu" or "gpu".
    platform: the lowering platform ("tpu", "cuda").
    device_platform: the abstract device's platform ("tpu", "gpu").
    device_kind: the device kind the rules plan for.
  """

  name: str
  platform: str
  device_platform: str
  device_kind: str

  @property
  def backend(self) -> str:
    """The name of the compiled backend that plans for it (the one serving
    its lowering platform, `backends.compiled()`)."""
    return next(b.name for b in backends.compiled() if self.platform in b.platforms)


# The chips `check_compiles` compiles for, without them.
TARGETS = {
    "tpu": Target("tpu", "tpu", "tpu", "TPU v5 lite"),
    "gpu": Target("gpu", "cuda", "gpu", "NVIDIA H200"),
}


def exported_text(fn: Callable[..., Any], args: tuple, target: Target) -> str:
  """The StableHLO text of `jit(fn)(*args)` exported for `target`.

  `args` are arrays or `jax.ShapeDtypeStruct`s made outside this call.
  """
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind=target.device_kind, num_cores=None, platform=target.device_platform))
  with jax.sharding.use_abstract_mesh(mesh):
    exported = export.export(
        jax.jit(fn), platforms=[target.platform],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  return exported.mlir_module()


def compiler(target: Target) -> tuple[Any, str]:
  """(a one-device mesh of the target's compile-only topology, its
  description), or (None, why the compiler is not available here)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  if target.name == "tpu":
    if importlib.util.find_spec("libtpu") is None:
      return None, "libtpu is not installed (pip install libtpu, the version jax[tpu] pins)"
    try:
      topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    except Exception as e:  # pylint: disable=broad-except  # the plugin says why
      return None, f"libtpu's compile-only topology is unavailable: {type(e).__name__}: {e}"
    what = "libtpu " + _version("libtpu")
  else:
    if not any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
      return None, ("the JAX CUDA plugin is not installed (pip install jax-cuda13-plugin "
                    "jax-cuda13-pjrt nvidia-cuda-nvcc)")
    try:
      with open(H200_TARGET) as f:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=f.read())
    except Exception as e:  # pylint: disable=broad-except
      return None, f"the CUDA plugin's compile-only topology is unavailable: {type(e).__name__}: {e}"
    what = "XLA's Triton pipeline and ptxas (jax CUDA plugin)"
  kind = getattr(topo.devices[0], "device_kind", target.device_kind)
  return jax.sharding.Mesh(topo.devices[:1], ("x",)), f"{what}, {kind}"


def compile_for(fn: Callable[..., Any], args: tuple, mesh: Any) -> Any:
  """`jit(fn)` compiled for the topology of `mesh` (from `compiler`)."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  structs = tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
  # Without `set_mesh`, Pallas would see the device kind "cpu".
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*structs).compile()


def _version(package: str) -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return "(version unknown)"
