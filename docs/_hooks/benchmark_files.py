"""mkdocs hook: serve benchmarks/'s results, plot and compile report with the site.

`benchmarks/RESULTS.md` (every measured table) becomes the page `results.md`; its
links (`speedup_cpu.png`, `results_cpu_quick.json`, `compile_report.md`) are
relative to benchmarks/, so those files are added beside it at the docs root. One
copy of each in the repository, served where the pages link to them. RESULTS.md
links documentation pages as `../docs/PAGE.md` (right where the repository shows
it); on the site, beside those pages, that is `PAGE.md`.
"""

from __future__ import annotations

import os

from mkdocs.structure.files import File, Files

# benchmarks/ file -> its path in the site.
FILES = {"RESULTS.md": "results.md", "speedup_cpu.png": "speedup_cpu.png",
         "results_cpu_quick.json": "results_cpu_quick.json",
         "compile_report.md": "compile_report.md"}


def on_files(files: Files, config) -> Files:
  root = os.path.dirname(os.path.abspath(config["docs_dir"]))   # the repository root
  for name, dest in FILES.items():
    path = os.path.join(root, "benchmarks", name)
    if not os.path.exists(path):
      continue
    if name == "RESULTS.md":
      with open(path, encoding="utf-8") as f:
        text = f.read().replace("](../docs/", "](")
      files.append(File.generated(config, dest, content=text))
    else:
      files.append(File.generated(config, dest, abs_src_path=path))
  return files
