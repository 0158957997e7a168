"""pallas_loop: apply a block a different number of times per example, fused.

`iterate(step, params, h0, x, iters=..., max_iters=...)` runs `step` on each
row of the state its own number of times, inside one Pallas kernel (Triton on
GPU, Mosaic on TPU) or an XLA loop, differentiably; `options=Options(...)`
says how to run it.

The public surface is what this module exports; everything under
`pallas_loop._src` is internal and may change.
"""

from pallas_loop._version import __version__
from pallas_loop._src.grad_modes import Full, Implicit, Phantom, Truncated
from pallas_loop._src.info import IterateInfo
from pallas_loop._src.iterate import iterate
from pallas_loop._src.options import Options
from pallas_loop import deq
from pallas_loop import halting
from pallas_loop import random
from pallas_loop import sampling
from pallas_loop import testing
from pallas_loop import tuning

__all__ = ["Full", "Implicit", "IterateInfo", "Options", "Phantom", "Truncated", "__version__",
           "deq", "halting", "iterate", "random", "sampling", "testing", "tuning"]
