"""The documentation says what the code does: figures that would go stale are checked."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pallas_loop

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _documented_signature(page: str, name: str) -> ast.arguments:
  """The first ```python block of `page` that calls `name(...)`, as parsed arguments."""
  text = (DOCS / page).read_text()
  for block in re.findall(r"```python\n(.*?)```", text, re.S):
    if block.lstrip().startswith(f"{name}("):
      call = block.strip()[len(name):]
      return ast.parse(f"def {name}{call}: pass").body[0].args  # type: ignore[attr-defined]
  raise AssertionError(f"no ```python block starting with {name}( in docs/{page}")


def test_semantics_page_shows_iterates_signature():
  """docs/semantics.md opens with iterate's signature: every parameter, in order,
  of the right kind, with its default."""
  documented = _documented_signature("semantics.md", "iterate")
  # `**kwargs` only catches the keywords `Options` replaced, to raise the
  # TypeError that shows the new spelling: not part of the documented call.
  params = [p for p in inspect.signature(pallas_loop.iterate).parameters.values()
            if p.kind is not p.VAR_KEYWORD]
  positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
  keyword = [p for p in params if p.kind is p.KEYWORD_ONLY]
  assert len(params) == len(positional) + len(keyword), params
  assert [a.arg for a in documented.args] == [p.name for p in positional]
  assert [a.arg for a in documented.kwonlyargs] == [p.name for p in keyword]

  def default(node):
    return "<required>" if node is None else ast.literal_eval(node)

  def actual(p):
    return "<required>" if p.default is p.empty else p.default

  pos_defaults = [None] * (len(documented.args) - len(documented.defaults))
  pos_defaults += documented.defaults
  assert [default(d) for d in pos_defaults] == [actual(p) for p in positional]
  assert [default(d) for d in documented.kw_defaults] == [actual(p) for p in keyword]
