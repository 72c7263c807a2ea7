"""Files a run writes and reads: checkpoints (with integrity checks), metrics and plots,
interrupt handling and cross-process locks. Nothing here knows an experiment config or a
stage; `training/` (the loop, the workdir's config record) and `sharding/` build on it.

    from rollouts_jax.io import checkpoint, metrics
    with checkpoint.Checkpointer(workdir / "checkpoints", save_every=10) as ckpt: ...
"""
