"""Rows sharded over a mesh of 8 simulated CPU devices (pallas_loop/sharding.py).

The number of CPU devices is fixed when JAX initialises, which has long
happened in this process, so the checks live in `tests/multidevice_sharding.py`,
an absltest program that asks for 8 CPU devices at its start, and run here
as a subprocess. They hold every implementation to the single-device
reference (forward and gradients), check that outputs stay sharded like the
inputs, and read the compiled HLO: no all-gather (or other collective) of the
state, one all-reduce of the parameter gradients.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
from jax import export
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import pytest

import pallas_loop
from tests import lowering

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_sharded_rows_on_8_cpu_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "tests.multidevice_sharding"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  report = result.stdout + result.stderr
  assert result.returncode == 0, report
  # unittest ends with "OK", or "OK (skipped=N)" if anything was skipped.
  assert re.search(r"^Ran [1-9]\d* tests? in .*\n\nOK$", report, re.M), report


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernel_lowers_per_shard_for_gpu_and_tpu(platform):
  # Exporting for an abstract 8-device H200 / TPU v5 lite mesh needs no
  # devices. The Triton / Mosaic call must see one shard's 64 rows, never the
  # 512 of the batch: each device runs the kernel on its own rows only.
  batch, width, shards = 512, 32, 8
  kind, device_platform, marker = lowering.TARGETS[platform]
  mesh = AbstractMesh((shards,), ("rows",), axis_types=(AxisType.Explicit,),
                      abstract_device=lowering.AbstractDevice(
                          device_kind=kind, num_cores=None, platform=device_platform))
  rows = NamedSharding(mesh, P("rows"))
  w = jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=NamedSharding(mesh, P()))
  h0 = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=rows)
  n = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
  step = lambda p, h, x: jnp.tanh(h @ p)
  run = lambda p, h, n_: pallas_loop.iterate(step, p, h, iters=n_, max_iters=8,
                                             options=pallas_loop.Options(implementation="pallas",
                                                                         interpret=False))
  grads = jax.grad(lambda p, h, n_: jnp.sum(run(p, h, n_)), argnums=(0, 1))
  for fn in (run, grads):
    with jax.sharding.use_abstract_mesh(mesh):
      exported = export.export(
          jax.jit(fn), platforms=[platform],
          disabled_checks=[export.DisabledSafetyCheck.custom_call(lowering.TRITON_CALL)])(
              w, h0, n)
    text = exported.mlir_module()
    calls = [line for line in text.splitlines() if marker in line]
    assert calls, f"no {marker} call: the Pallas path was not taken"
    for line in calls:
      assert f"tensor<{batch // shards}x{width}xf32>" in line, line
      assert f"tensor<{batch}x{width}xf32>" not in line, line
    assert "sdy.manual_computation" in text
