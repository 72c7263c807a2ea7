"""The ``>>>`` examples in the rewards docstrings are true."""
import doctest
import importlib

import pytest

MODULES = ["arithmetic", "common", "countdown", "extract", "format", "gsm8k", "label_free",
           "math_verifier", "pool", "registry", "selection"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"rollouts_jax.rewards.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
