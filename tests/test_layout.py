"""The package's folders keep their imports one way (docs/architecture.md,
"Four concerns, four folders"): `_src/step/` reads the user's step and
imports none of the other folders; the kernels and the XLA loop never import
each other; nothing but the top of `_src/` and `deq/` imports `deq/`."""

from __future__ import annotations

import ast
import os
import pathlib

import pallas_loop
from benchmarks import compile_check
from pallas_loop._src.kernels import deviceless

_SRC = pathlib.Path(pallas_loop.__file__).parent / "_src"
FOLDERS = ("step", "kernels", "xla", "deq")
# folder -> the folders its modules must not import
FORBIDDEN = {
    "step": {"kernels", "xla", "deq"},
    "kernels": {"xla", "deq"},
    "xla": {"kernels", "deq"},
}


def _imported_folders(path: pathlib.Path) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for name in names:
      parts = name.split(".")
      if parts[:2] == ["pallas_loop", "_src"] and len(parts) > 2 and parts[2] in FOLDERS:
        found.add(parts[2])
  return found


def test_every_folder_holds_modules():
  for folder in FOLDERS:
    assert len(list((_SRC / folder).glob("*.py"))) > 1, folder


def test_imports_run_one_way():
  wrong = {}
  for folder, forbidden in FORBIDDEN.items():
    for path in sorted((_SRC / folder).glob("*.py")):
      bad = _imported_folders(path) & forbidden
      if bad:
        wrong[f"{folder}/{path.name}"] = sorted(bad)
  assert not wrong, wrong


def test_the_check_sees_a_folder_imported(tmp_path):
  module = tmp_path / "m.py"
  module.write_text("from pallas_loop._src.kernels import backend\n"
                    "import pallas_loop._src.xla.xla_forward\n"
                    "from pallas_loop._src import tiling\n")
  assert _imported_folders(module) == {"kernels", "xla"}


def test_the_compile_check_reads_the_library_s_gpu_target():
  assert os.path.samefile(compile_check.H200_TARGET, deviceless.H200_TARGET)
