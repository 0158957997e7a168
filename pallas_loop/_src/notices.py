"""Warnings the library gives once per process (a fallback, a sharding it
cannot see): repeated in every traced call they would drown the user's output."""

from __future__ import annotations

import warnings

_warned: set[str] = set()


def warn_once(message: str, *, stacklevel: int = 2) -> None:
  """`warnings.warn(message)` the first time this message is given."""
  if message in _warned:
    return
  _warned.add(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
