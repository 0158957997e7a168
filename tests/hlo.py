"""Reading compiled HLO text: the collectives a sharded program communicates with."""

from __future__ import annotations

import re

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter",
               "all-reduce")


def collectives(compiled_text: str) -> dict[str, list[str]]:
  """The HLO instructions of each collective kind in a compiled module.

  Examples:
    >>> collectives("  %ar = f32[4] all-reduce(f32[4] %p), to_apply=%sum")
    {'all-reduce': ['%ar = f32[4] all-reduce(f32[4] %p), to_apply=%sum']}
  """
  found = {}
  for kind in COLLECTIVES:
    lines = [l.strip() for l in compiled_text.splitlines()
             if re.search(rf"\s{kind}(-start)?\(", l)]
    if lines:
      found[kind] = lines
  return found
