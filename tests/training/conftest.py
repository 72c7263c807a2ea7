"""Fixtures shared by the loop's tests."""

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A module's dataset / warm-start cache (`ROLLOUTS_JAX_CACHE`): built by its first test, reused by the rest."""
  root = tmp_path_factory.mktemp("cache")
  mp = pytest.MonkeyPatch()
  mp.setenv("ROLLOUTS_JAX_CACHE", str(root))
  yield root
  mp.undo()
