"""Warnings the library gives once per process (a fallback, a sharding it
cannot see): repeated in every traced call they would drown the user's output."""

from __future__ import annotations

import os
import sys
import types
from typing import cast
import warnings

import jax

_warned: set[str] = set()


def warn_once(message: str, *, stacklevel: int = 2) -> None:
  """`warnings.warn(message)` the first time this message is given."""
  if message in _warned:
    return
  _warned.add(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def warn_once_at(key: str, message: str, category: type[Warning],
                 site: tuple[str, int]) -> None:
  """Warns `message` the first time `key` is seen, attributed to `site` (file, line).

  For warnings raised from a host callback, where the Python stack is JAX's,
  not the user's: `site` is the user's line, captured when the call was
  traced.
  """
  if key in _warned:
    return
  _warned.add(key)
  filename, lineno = site
  module = os.path.splitext(os.path.basename(filename))[0]
  warnings.warn_explicit(message, category, filename, lineno, module=module)


# Where the caller's code is: the first frame outside this package and JAX.
_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(cast(str, m.__file__))) + os.sep for m in
                   (sys.modules["pallas_loop"], jax, sys.modules.get("jaxlib", jax)))


def user_site() -> tuple[str, int]:
  """(file, line) of the innermost frame outside this package and JAX: the
  user's line that called into them (for `warn_once_at`).

  Example:
    >>> user_site()[0] != "<unknown>"
    True
  """
  frame: types.FrameType | None = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    name = os.path.abspath(frame.f_code.co_filename)
    if not name.startswith(_SKIP_DIRS) and not name.startswith("<frozen"):
      return frame.f_code.co_filename, frame.f_lineno
    frame = frame.f_back
  return "<unknown>", 0
