"""The sections of experiments/benchmarks/bench_gpu.py: matmul, sampler, rl_step, lowering; common.py."""
