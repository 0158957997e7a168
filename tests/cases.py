"""Named count patterns, implementations, sizes and steps shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import pallas_loop

MAX_ITERS = 6


def counts(pattern: str, batch: int, max_iters: int = MAX_ITERS, seed: int = 0):
  """int32 [batch] counts for a named pattern (some outside [0, max_iters])."""
  rng = np.random.default_rng(seed)
  if pattern == "zero":
    n = np.zeros(batch)
  elif pattern == "max":
    n = np.full(batch, max_iters)
  elif pattern == "clipped":  # above max and negative: clipped to [0, max]
    n = np.where(np.arange(batch) % 2 == 0, max_iters + 5, -3)
  elif pattern == "ragged":
    n = rng.integers(0, max_iters + 1, batch)
  elif pattern == "one_long_per_tile":  # a slow row in every tile of 8 rows
    n = np.where(np.arange(batch) % 8 == 3, max_iters, 1)
  else:
    raise ValueError(pattern)
  return jnp.asarray(n, jnp.int32)


PATTERNS = ("zero", "max", "clipped", "ragged", "one_long_per_tile")

# (id, iterate's options): every implementation the tests hold to the reference.
IMPLEMENTATIONS = {
    "xla": pallas_loop.Options(implementation="xla"),
    "pallas": pallas_loop.Options(implementation="pallas", interpret=True),
    "pallas_tpu_interpret": pallas_loop.Options(implementation="pallas",
                                                interpret=pltpu.InterpretParams()),
}


def tree_sum(tree):
  return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def mixed_rank_step(params, state, x):
  """State leaves of rank 1, 2 and 3; a 0-d parameter; x absent."""
  scale, w = params
  v, m, t = state
  m_new = jnp.tanh(jnp.dot(m, w, preferred_element_type=jnp.float32)) * scale
  v_new = 0.5 * v + jnp.sum(m_new, axis=1) * (1.0 / m.shape[1])
  t_new = 0.9 * t + 0.1 * jnp.tanh(t)
  return v_new, m_new, t_new
