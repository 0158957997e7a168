"""PonderNet (examples/ponder_net.py) against loops written here, step by step.

The oracles run the cell one step at a time in plain Python (no `iterate`, no
oracle of the library): the training loss from each step's prediction and
halting probability, its gradient, and sampled halting at inference with the
same per-(row, step) keys.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_loop

_PATH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "ponder_net.py"


def _example():
  spec = importlib.util.spec_from_file_location("ponder_net", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


pn = _example()


def _loss_by_steps(params, x, target):
  """The loss of the paper, from a Python loop over the N steps."""
  h = jnp.zeros((x.shape[0], pn.HIDDEN))
  survive = jnp.ones(x.shape[0])
  rec = kl = 0.0
  prior = pn.LAMBDA_P * (1 - pn.LAMBDA_P) ** np.arange(pn.N)
  prior = prior / prior.sum()
  for n in range(pn.N):
    h, y = pn.cell(params, h, x)
    lam = y["lam"] if n < pn.N - 1 else jnp.ones_like(y["lam"])
    p_n = survive * lam
    survive = survive * (1 - lam)
    bce = -(target * jax.nn.log_sigmoid(y["logit"]) + (1 - target) * jax.nn.log_sigmoid(-y["logit"]))
    rec = rec + p_n * bce
    kl = kl + p_n * (jnp.log(p_n + 1e-12) - np.log(prior[n]))
  return jnp.mean(rec) + pn.BETA * jnp.mean(kl)


def test_training_loss_and_gradient_match_a_step_loop():
  params = pn.init(jax.random.key(1))
  x, target = pn.parity_batch(jax.random.key(2), 32)
  loss, _ = pn.loss_fn(params, x, target)
  np.testing.assert_allclose(loss, _loss_by_steps(params, x, target), rtol=1e-5)
  got = jax.grad(lambda p: pn.loss_fn(p, x, target)[0])(params)
  want = jax.grad(_loss_by_steps)(params, x, target)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=1e-6, err_msg=name)


def test_sampled_halting_matches_a_row_loop():
  """Row i stops after the first step n whose draw on its key (i, n) is below
  lambda_n; rows stop at different steps."""
  params = pn.init(jax.random.key(3))
  x, _ = pn.parity_batch(jax.random.key(4), 24)
  key = jax.random.key(5)
  predicted, steps = pn.infer(params, x, key)
  words = pallas_loop.random.key_data(key).reshape(1, 2)
  for i in range(x.shape[0]):
    h = jnp.zeros((1, pn.HIDDEN))
    for n in range(pn.N):
      h, y = pn.cell(params, h, x[i:i + 1])
      k = pallas_loop.random.step_keys(words, jnp.full((1, 1), i), jnp.full((1, 1), n))
      if pallas_loop.random.uniform(k, (1,))[0] < y["lam"][0]:
        break
    assert int(steps[i]) == n + 1, (i, int(steps[i]), n + 1)
    assert bool(predicted[i]) == bool(jnp.sum(h * params["out"]) > 0)
  assert len(set(np.asarray(steps).tolist())) > 1  # rows halt at different steps


def test_the_example_runs(capsys):
  pytest.importorskip("optax", reason='needs the examples extra: pip install -e ".[examples]"')
  assert pn.main(["--quick", "--steps", "3"]) == 0
  assert capsys.readouterr().out.rstrip().endswith("OK")
