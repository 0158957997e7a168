"""pallas_loop: apply a block a different number of times per example, fused.

`iterate(step, params, h0, x, iters=..., max_iters=...)` runs `step` on each
row of the state its own number of times, inside one Pallas kernel (Triton on
GPU, Mosaic on TPU) or an XLA loop, differentiably. See README.md.
"""

from pallas_loop._version import __version__
from pallas_loop import halting
from pallas_loop.api import iterate
from pallas_loop.info import IterateInfo
from pallas_loop import testing

__all__ = ["IterateInfo", "__version__", "halting", "iterate", "testing"]
