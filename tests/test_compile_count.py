"""A jitted function that calls `iterate` compiles once, on its first call.

Importing a module that registers a JAX config option changes JAX's tracing
context; if `iterate` imported one lazily (inside the user's first trace),
the second call of the user's jitted function would miss the cache and
compile again. The check needs a fresh interpreter (the test process has
imported everything already), so it runs in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp, pallas_loop
    from jax._src import config

    context = len(config.trace_context())
    step = lambda w, h, x, key: jnp.tanh(h @ w + x) * pallas_loop.random.dropout(key, jnp.ones_like(h), 0.1)
    w, h0, x = jnp.eye(16) * 0.5, jnp.zeros((64, 16)), jnp.ones((64, 16))
    n = jnp.arange(64, dtype=jnp.int32) % 5
    key = jax.random.key(0)

    def loss(w, implementation, grad):
      h = pallas_loop.iterate(step, w, h0, x, iters=n, max_iters=4, tol=1e-4, key=key,
                              grad=grad, options=pallas_loop.Options(implementation=implementation))
      return jnp.sum(h)

    cases = {
        "auto, full": (None, "full"),
        "xla, implicit": ("xla", pallas_loop.Implicit()),
        "pallas (interpret), truncated": ("pallas", pallas_loop.Truncated(2)),
    }
    for name, (implementation, grad) in cases.items():
      f = jax.jit(jax.value_and_grad(lambda w: loss(w, implementation, grad)))
      for _ in range(3):
        jax.block_until_ready(f(w))
      print(name, "compiles:", f._cache_size())
    print("tracing context grew by", len(config.trace_context()) - context)
""")


def test_a_jitted_call_compiles_once():
  result = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                          timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert lines[-1] == "tracing context grew by 0", result.stdout
  for line in lines[:-1]:
    assert line.endswith("compiles: 1"), result.stdout
  assert len(lines) == 4, result.stdout
