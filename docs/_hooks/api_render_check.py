"""mkdocs hook: fail the strict build when a page renders a docstring wrongly.

mkdocstrings turns a docstring it half-understands into valid but wrong HTML,
which `--strict` alone lets through. On the pages under api/, and in the
docstrings other pages render (`::: name` blocks), this hook warns (an error
under `mkdocs build --strict`) when:

* a docstring example is not a code block: `>>>` outside `<pre>`, or a
  blockquote (Markdown reads a bare `>>>` as three nested quotes). Google
  style's section is `Examples:`; `Example:` is not one and renders its
  body as text.
* a misnamed section became an admonition: griffe renders a title it does
  not know (`Example:`, `Usage:`, `Return:`, `Arg:`) as a collapsible box, as
  it does on purpose for `Note:` or `Warning:` (those are left alone).
* emphasis appears: the docstrings are read in `help()` too and use no
  Markdown emphasis, so `<em>`/`<strong>` means a `*` (e.g. `h*`, `2**k`)
  outside backticks paired with another one.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("mkdocs.plugins.api_render_check")

_PRE = re.compile(r"<pre\b.*?</pre>", re.S)
_ADMONITION = re.compile(r'<details class="(\w+)"[^>]*>\s*<summary>([^<]*)</summary>')
# Titles meant as a section that griffe does not know under that name.
_MISNAMED = re.compile(r"^(example|usage|return|arg|argument|param|parameter|raise|yield)s?$",
                       re.IGNORECASE)
_EMPHASIS = re.compile(r"<(em|strong)>(.*?)</\1>", re.S)
_DIV = re.compile(r"<div\b[^>]*>|</div>")
_DOC_OBJECT = re.compile(r'<div class="doc doc-object\b')


def rendered_docstrings(html: str) -> str:
  """The parts of a page that mkdocstrings rendered (its `::: name` blocks).

  Args:
    html: a page's HTML.

  Returns:
    The outermost `doc-object` blocks, concatenated ("" when there are none).

  Examples:
    >>> page = '<p>prose</p><div class="doc doc-object"><div>a</div></div><p>more</p>'
    >>> rendered_docstrings(page)
    '<div class="doc doc-object"><div>a</div></div>'
  """
  parts, pos = [], 0
  while (start := _DOC_OBJECT.search(html, pos)) is not None:
    depth, end = 0, len(html)
    for tag in _DIV.finditer(html, start.start()):
      depth += -1 if tag.group() == "</div>" else 1
      if depth == 0:
        end = tag.end()
        break
    parts.append(html[start.start():end])
    pos = end
  return "".join(parts)


def _text(fragment: str, limit: int = 80) -> str:
  text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", fragment)).strip()
  return text[:limit]


def problems(html: str) -> list[str]:
  """What is rendered wrongly in one API page's HTML.

  Args:
    html: the page's HTML as mkdocs writes it.

  Returns:
    One line per problem; empty when the page renders as written.

  Examples:
    >>> problems("<pre><code>&gt;&gt;&gt; 1 + 1\\n2</code></pre>")
    []
    >>> problems("<blockquote><p>1 + 1</p></blockquote>")[0][:30]
    'a docstring example rendered a'
    >>> problems('<details class="note" open><summary>Note</summary></details>')
    []
    >>> problems('<details class="example"><summary>Example</summary></details>')[0][:17]
    "section 'Example'"
  """
  found = []
  if "<blockquote" in html:
    found.append("a docstring example rendered as a quote, not a code block: "
                 "its section must be 'Examples:' (Google style)")
  outside = _PRE.sub("", html)
  for m in re.finditer(r"&gt;&gt;&gt;", outside):
    found.append(f"'>>>' outside a code block: {_text(outside[m.start():m.start() + 200])!r}")
  for m in _ADMONITION.finditer(html):
    if not _MISNAMED.match(m.group(2).strip()):
      continue
    found.append(f"section {m.group(2).strip()!r} is not a Google-style section griffe "
                 f"knows (rendered as a '{m.group(1)}' box): use Examples:, Args:, "
                 f"Returns:, Raises: or Yields:")
  for m in _EMPHASIS.finditer(html):
    found.append(f"<{m.group(1)}> around {_text(m.group(2))!r}: put expressions with '*' "
                 f"in backticks")
  return found


def on_post_page(output: str, page, config) -> str:
  """Warns (an error under `--strict`) for every problem on an API page, or in
  the docstrings another page renders.

  Args:
    output: the page's HTML.
    page: the mkdocs page.
    config: the mkdocs config (unused).

  Returns:
    `output`, unchanged.
  """
  checked = output if page.file.src_uri.startswith("api/") else rendered_docstrings(output)
  for problem in problems(checked):
    log.warning("%s: %s", page.file.src_uri, problem)
  return output
