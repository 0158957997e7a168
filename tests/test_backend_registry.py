"""A backend is one module: dispatch, the kernels' launch and tuning read it.

A stub backend for the CPU platform, defined in this file alone (no library
file changed), is planned and run by `iterate` (forward and backward, its
launch and persistent grid), named by interpret mode and tuned for; and no
library module outside a backend's own names one.
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop
from benchmarks import blocks
from pallas_loop import _reference as reference
from pallas_loop import tuning
from pallas_loop._src.kernels import backend as backend_lib
from pallas_loop._src.kernels import backend_interpret
from pallas_loop._src.kernels import backends
from pallas_loop._src import dispatch
from pallas_loop._src.step import jaxpr_eval
from tests import oracle

BATCH, MAX_ITERS = 20, 6
PROGRAMS = 2  # the stub's persistent grid


def _configure(fp, given):
  del given
  return backend_lib.KernelConfig(fp.block_rows, eval_rules=jaxpr_eval.PLAIN), []


# A compiled backend as a new one would be written: its platform, launch
# (rows by index, a persistent grid of its own), tile heights and rules. Its
# kernels run in Pallas interpret mode, so that it runs on the CPU.
STUB = backend_lib.Backend(
    name="stub_cpu",
    platforms=("cpu",),
    default_block_rows=lambda batch: 8,
    block_problems=lambda blocks_: [f"{b.what} is taller than 16 rows" for b in blocks_
                                    if b.row_axis == 0 and b.block_shape[0] > 16],
    configure=_configure,
    interpret=True,
    smallest_default_rows=8,
    device_platform="cpu",
    label="CPU (stub)",
    indexed_rows=True,
    persistent_programs=lambda config, tiles: min(tiles, PROGRAMS),
    tile_candidates=(4, 16),
)


@pytest.fixture
def stub():
  backends.register(STUB)
  try:
    yield STUB
  finally:
    backends.unregister(STUB)


def _problem():
  step, params, h0, x = blocks.make("tanh_rnn", BATCH, 16)
  n = jnp.asarray(np.random.default_rng(0).integers(0, MAX_ITERS + 1, BATCH), jnp.int32)
  return step, params, h0, x, n


def _grids(fn, *args):
  """(kernel name, grid) of every pallas_call in `fn`'s jaxpr."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append((str(eqn.params["name"]), eqn.params["grid_mapping"].grid))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_without_the_stub_no_compiled_backend_serves_the_cpu():
  step, params, h0, x, n = _problem()
  compiled = pallas_loop.Options(implementation="pallas", interpret=False)
  run = jax.jit(lambda p: pallas_loop.iterate(step, p, h0, x, iters=n, max_iters=MAX_ITERS,
                                               options=compiled))
  with pytest.raises(ValueError, match=r"needs a GPU \(Triton\) or TPU \(Mosaic\) platform"):
    run(params)
  assert tuning.default_candidates(100, "cpu") == (8, 16, 32, 64, 128)


@pytest.mark.parametrize("sched", [None, "persistent"])
def test_dispatch_plans_and_runs_the_registered_backend(stub, sched):
  step, params, h0, x, n = _problem()
  options = pallas_loop.Options(implementation="pallas", interpret=False, schedule=sched)
  run = functools.partial(pallas_loop.iterate, step, iters=n, max_iters=MAX_ITERS,
                          options=options)
  with dispatch.observe_plans() as seen:
    grids = _grids(lambda p: run(p, h0, x), params)
  # Every platform's branch is planned and traced; the CPU's is the stub's.
  mine = [plan for what, name, plan in seen if name == stub.name]
  assert len(mine) == 1 and mine[0].block_rows == 8  # its default tile height
  backends.unregister(stub)
  try:
    others = _grids(lambda p: run(p, h0, x), params)
  finally:
    backends.register(stub)
  added = collections.Counter(grids) - collections.Counter(others)
  tiles = -(-BATCH // 8)
  assert list(added.elements()) == [("pallas_loop_iterate_fwd", (PROGRAMS if sched else tiles,))]
  got = run(params, h0, x)
  want, want_f32 = oracle.reference_pair(step, params, h0, x, iters=n, max_iters=MAX_ITERS)
  oracle.assert_trees_close(got, want, want_f32)

  # The backward kernel too.
  loss = lambda it, p: jnp.sum(jnp.tanh(it(step, p, h0, x, iters=n, max_iters=MAX_ITERS)))
  with dispatch.observe_plans() as seen:
    got = jax.grad(functools.partial(loss, functools.partial(pallas_loop.iterate,
                                                             options=options)))(params)
  assert ("backward", stub.name) in [(what, name) for what, name, _ in seen]
  want = jax.grad(functools.partial(loss, reference.iterate))(params)
  oracle.assert_trees_close(got, want, what="gradient")


def test_its_rules_decline_with_its_name(stub):
  step, params, h0, x, n = _problem()
  options = pallas_loop.Options(implementation="pallas", interpret=False, block_rows=32)
  run = jax.jit(lambda p: pallas_loop.iterate(step, p, h0, x, iters=n, max_iters=MAX_ITERS,
                                               options=options))
  with pytest.raises(ValueError, match=r"the Pallas stub_cpu forward kernel cannot run this "
                     r"step: iters is taller than 16 rows"):
    run(params)


def test_interpret_mode_applies_its_rules(stub):
  assert "cpu" in backend_interpret.targets()
  assert backend_interpret.for_option("cpu").checks is stub
  step, params, h0, x, n = _problem()
  options = pallas_loop.Options(implementation="pallas", interpret="cpu", block_rows=32)
  # The stub's block rule is a tile rule, which interpret mode does not
  # apply (`backend_interpret.py`): the step runs, under the stub's name.
  with dispatch.observe_plans() as seen:
    got = pallas_loop.iterate(step, params, h0, x, iters=n, max_iters=MAX_ITERS,
                              options=options)
  assert [(what, name) for what, name, _ in seen] == [("forward", "interpret")]
  assert seen[0][2].backend.checks is stub
  want, want_f32 = oracle.reference_pair(step, params, h0, x, iters=n, max_iters=MAX_ITERS)
  oracle.assert_trees_close(got, want, want_f32)


def test_tuning_reads_its_tile_candidates(stub):
  assert tuning.default_candidates(100, "cpu") == (4, 8, 16)
  assert tuning.default_candidates(100, "tpu") == (128,)  # the others' unchanged
  step, params, h0, x, n = _problem()
  result = tuning.tune_block_rows(step, params, h0, x, iters=n, max_iters=MAX_ITERS,
                                  repeats=1, options=pallas_loop.Options(interpret=False))
  assert set(result.seconds) == {4, 8, 16} and not result.rejected


def test_register_refuses_a_clash():
  with pytest.raises(ValueError, match="clashes with the backend 'triton'"):
    backends.register(backend_lib.Backend(
        name="other", platforms=("cuda",), default_block_rows=lambda b: 8,
        block_problems=lambda b: [], configure=_configure, device_platform="other"))
  with pytest.raises(ValueError, match="needs platforms="):
    backends.register(backend_lib.INTERPRET)
  with pytest.raises(ValueError, match="was not registered"):
    backends.unregister(backends.BUILT_IN[0])


# --- No module outside a backend's own names one -------------------------

_SRC = pathlib.Path(pallas_loop.__file__).parent

# The modules that may name backends: the backends' own, the list of them,
# and the TPU backend's own kernels (reached only through its
# `Backend.plan_forward` and `Backend.plan_backward`).
_OWN = ("backends.py", "kernel_tpu_groups.py", "kernel_tpu_groups_backward.py")
# The chips `testing.check_compiles` compiles for without them (a TPU v5e,
# an H200: `deviceless.TARGETS`) are named by their platforms there; which
# backend plans for each is looked up (`Target.backend`).
_CHIPS = ("deviceless.py", "testing.py")


def _is_own(path: pathlib.Path) -> bool:
  return path.name.startswith("backend_") or path.name in _OWN


def _docstrings(tree: ast.AST) -> set[int]:
  ids = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        ids.add(id(body[0].value))
  return ids


def _namings(source: str, platforms: bool = True) -> list[str]:
  """How `source`'s code (not its docstrings or comments) names a backend:
  imports of a backend's module, its `Backend` values' names, and string
  constants equal to a backend's name or (with `platforms`) one of its
  platforms."""
  modules = {b.configure.__module__ for b in backends.compiled()}
  values = {name for m in modules for name, v in vars(__import__(m, fromlist=["_"])).items()
            if isinstance(v, backend_lib.Backend)}
  words = {b.name for b in backends.compiled()}
  if platforms:
    words |= {p for b in backends.compiled() for p in (*b.platforms, b.device_platform)}
  tree = ast.parse(source)
  docstrings = _docstrings(tree)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      found += [f"line {node.lineno}: imports {node.module}.{a.name}" for a in node.names
                if f"{node.module}.{a.name}" in modules or node.module in modules]
    elif isinstance(node, ast.Import):
      found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in modules]
    elif isinstance(node, ast.Attribute) and node.attr in values:
      found.append(f"line {node.lineno}: .{node.attr}")
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings and node.value in words):
      found.append(f"line {node.lineno}: {node.value!r}")
  return found


def test_the_check_sees_a_backend_named():
  """What the check below finds: the ways the library named backends before."""
  before = (
      '"""Docstrings and comments may speak of Triton and TPUs."""\n'
      "from pallas_loop._src.kernels import backend_triton  # the import\n"
      "from pallas_loop._src.kernels.backend_mosaic_tpu import SMALLEST_TILE\n"
      "INDEXED_BACKENDS = ('triton', 'interpret')\n"
      "select = dict(cuda=1, tpu=2, default=0) or {'rocm': 1}\n"
      "rules = m.MOSAIC_TPU.configure\n")
  assert sorted({f.split(":")[0] for f in _namings(before)}) == [
      "line 2", "line 3", "line 4", "line 5", "line 6"], _namings(before)
  assert _namings((_SRC / "_src" / "kernels" / "backends.py").read_text())  # the list names them


def test_no_module_outside_a_backends_own_names_one():
  named = {str(path.relative_to(_SRC.parent)): found
           for path in sorted(_SRC.rglob("*.py")) if not _is_own(path)
           for found in [_namings(path.read_text(), platforms=path.name not in _CHIPS)]
           if found}
  assert not named, named
