"""Thin absl launchers: train, sft, evaluate (and a run's report, multi-turn episodes)."""
