"""The parts CI splits the release tests into (tests/conftest.py, `--part`),
one for the floor and one for the newest JAX."""

import pytest

from tests import conftest

IDS = [f"tests/test_x.py::test_{i}[{p}]" for i in range(200) for p in ("a", "b")]


def test_parts_are_disjoint_and_hold_every_test():
  parts = [{i for i in IDS if conftest._in_part(i, "seed", k, 3)} for k in (1, 2, 3)]  # pylint: disable=protected-access
  assert set().union(*parts) == set(IDS)
  assert sum(map(len, parts)) == len(IDS)
  assert all(len(p) > len(IDS) // 6 for p in parts)  # even, not exactly


def test_a_seed_draws_the_same_split_and_another_seed_another():
  draw = lambda seed: {i for i in IDS if conftest._in_part(i, seed, 1, 2)}  # pylint: disable=protected-access
  assert draw("commit-a") == draw("commit-a")
  assert draw("commit-a") != draw("commit-b")


@pytest.mark.parametrize("text", ["1", "0/2", "3/2", "a/b"])
def test_a_malformed_part_is_a_usage_error(text):
  with pytest.raises(pytest.UsageError, match="--part"):
    conftest._part(text)  # pylint: disable=protected-access
