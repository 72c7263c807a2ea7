"""Scripts that use rollouts_jax, by kind: launch/, benchmarks/, studies/.

Run each as a module from the repository root: `python -m experiments.launch.train --config=...`.
"""
