"""Shared test set-up: fp32 matmuls on CPU and paths to shared data."""
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = pathlib.Path(
    os.environ.get("ROLLOUTS_JAX_BENCHMARKS", REPO.parent / "shared" / "data" / "benchmarks"))
