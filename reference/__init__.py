"""The oracle: `reference.iterate`, a masked `lax.scan` over `max_iters`.

Deliberately the plainest correct program: no tiling, no sorting, no custom
gradients, nothing imported from `pallas_loop`'s internals. Every step runs on
every row and `jnp.where` keeps the old state of rows whose count is spent
(not `lax.cond`: under `vmap` it computes both branches anyway). Gradients
come from ordinary JAX autodiff through the scan. Every test of `pallas_loop`
compares against it; `python -m benchmarks.run` uses it as the baseline.
"""

from reference.iterate import IterateInfo, iterate

__all__ = ["IterateInfo", "iterate"]
