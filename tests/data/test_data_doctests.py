"""The `>>>` examples in the data modules' docstrings run and hold."""
import doctest
import importlib

import pytest

MODULES = ["arithmetic", "batching", "benchmarks", "builders", "countdown", "formatting",
           "pipeline", "tokenizers"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(f"rollouts_jax.data.{name}")
  result = doctest.testmod(module, verbose=False, report=True)
  assert result.failed == 0
