"""mkdocs hook: serve benchmarks/'s plot, raw results and compile report with the site.

The performance page includes benchmarks/RESULTS.md (pymdownx.snippets), whose
links (`speedup_cpu.png`, `results_cpu_quick.json`, `compile_report.md`) are
relative to benchmarks/. The files are added here at the docs root, beside the
performance page, so those links and the plot resolve without a second copy in
the repository.
"""

from __future__ import annotations

import os

from mkdocs.structure.files import File, Files

FILES = ("speedup_cpu.png", "results_cpu_quick.json", "compile_report.md")


def on_files(files: Files, config) -> Files:
  root = os.path.dirname(os.path.abspath(config["docs_dir"]))   # the repository root
  for name in FILES:
    path = os.path.join(root, "benchmarks", name)
    if os.path.exists(path):
      files.append(File.generated(config, name, abs_src_path=path))
  return files
