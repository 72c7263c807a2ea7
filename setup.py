"""Install: pip install -e ".[test]"  (see README.md)."""
from setuptools import find_packages, setup

setup(
    name="rollouts_jax",
    version="0.1.0",
    description="JAX-native rollout-centric reinforcement learning for language models.",
    packages=find_packages(include=["rollouts_jax", "rollouts_jax.*"]),
    package_data={"rollouts_jax.data": ["benchmark_files/*.jsonl", "benchmark_files/README.md"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.26",
        "jinja2>=3.1",
        "jax>=0.6.0",
        "flax>=0.10.0",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11.0",
        "ml-collections>=1.0.0",
        "absl-py>=2.1.0",
        "tensorflow-datasets>=4.9.7",
        "array_record>=0.5.1",
        "sentencepiece>=0.2.0",
        "safetensors>=0.4.3",
        "tokenizers>=0.20.0",
        "gguf>=0.17.0",
        "math-verify>=0.7.0",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "tensorboardX>=2.6",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "hypothesis>=6.100",
            "tensorboard>=2.16",
            "torch>=2.4",
            "transformers>=4.51",
            "accelerate>=1.0",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
        ],
        # experiments/benchmarks/bench_real_lm.py's GRPO comparison (TRL's GRPOTrainer on the same model).
        "bench": [
            "trl>=1.16",
            "datasets>=4.7",
        ],
        "notebooks": [
            "jupyter>=1.0",
            "nbclient>=0.10",
            "ipykernel>=6.29",
        ],
    },
)
