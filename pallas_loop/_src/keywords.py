"""Keywords that were renamed: the old spelling raises a TypeError that shows the new one.

The library speaks of a loop's budget as `max_iters` everywhere (`iterate`,
`deq.fixed_point`, `deq.ImplicitAdjoint`, `halting.act`); `deq` and `act`
said `max_steps` before 0.3. A call with the old keyword fails at once with a
message naming the new spelling, instead of Python's bare "unexpected keyword
argument".
"""

from __future__ import annotations

import functools
from typing import Any, Callable


def renamed(**old_to_new: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorates a function so that each old keyword raises a TypeError naming its new one.

  Args:
    **old_to_new: old keyword -> new keyword, e.g. `max_steps="max_iters"`.

  Returns:
    A decorator; the wrapped function keeps the signature of the original
    (`inspect.signature` follows `__wrapped__`).

  Example:
    >>> from pallas_loop._src.keywords import renamed
    >>> @renamed(max_steps="max_iters")
    ... def solve(*, max_iters=10):
    ...   return max_iters
    >>> solve(max_steps=3)
    Traceback (most recent call last):
    ...
    TypeError: solve() got max_steps=3: the keyword is now spelled max_iters (as in pallas_loop.iterate): solve(..., max_iters=3).
  """

  def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
    name = fn.__qualname__.replace(".__init__", "")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      for old, new in old_to_new.items():
        if old in kwargs:
          raise TypeError(
              f"{name}() got {old}={kwargs[old]!r}: the keyword is now spelled {new} (as in "
              f"pallas_loop.iterate): {name}(..., {new}={kwargs[old]!r}).")
      return fn(*args, **kwargs)

    return wrapper

  return decorate
