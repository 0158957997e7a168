"""Warnings the library gives once per process (a fallback, a sharding it
cannot see): repeated in every traced call they would drown the user's output."""

from __future__ import annotations

import os
import warnings

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
