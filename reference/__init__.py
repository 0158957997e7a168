"""The oracle: `iterate`, a masked `lax.scan` over `max_iters`.

Deliberately the plainest correct program: no tiling, no sorting, no custom
gradients. Every step runs on every row and `jnp.where` keeps the old state
of rows whose count is spent (not `lax.cond`: under `vmap` it computes both
branches anyway). Gradients come from ordinary JAX autodiff through the
scan. Every test of `pallas_loop` compares against it;
`python -m benchmarks.run` uses it as the baseline.

It lives in the repository's top-level `reference/`, apart from the library,
and is installed as `pallas_loop._reference` (so that `pip install` claims
no top-level name but `pallas_loop`); import it as
`from pallas_loop import _reference as reference`. Of the library it uses
only the public per-(row, step) key derivation of `pallas_loop.random`; its
truncation argument and its `IterateInfo` are its own.
"""

from .iterate import IterateInfo, iterate

__all__ = ["IterateInfo", "iterate"]
