"""Items 1 and 2 of issue 18: damaged or non-finite checkpoints are never restored silently.

Each test writes real checkpoints, damages the latest step's files the way disks and killed
copies do (flipped bytes in the array data, a truncated file, a deleted manifest or metadata
file, NaN weights), and checks that restoring falls back to the newest intact step, bitwise,
or raises an error that names the folder.
"""
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollouts_jax.io import checkpoint
from rollouts_jax.io.checkpoint import (CheckpointDamagedError, Checkpointer, NonFiniteStateError,
                                              load_params, save_params)

ABSTRACT = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "b": jax.ShapeDtypeStruct((64,), jnp.float32)}


def _state(step):
  k = jax.random.fold_in(jax.random.key(0), step)
  return {"w": jax.random.normal(k, (64, 64)), "b": jnp.full((64,), float(step))}


def _write(tmp_path, steps=(2, 4, 6)):
  with Checkpointer(tmp_path, save_every=2, keep=5) as ckpt:
    for s in steps:
      assert ckpt.save(s, _state(s), {"step": s})
  return tmp_path


def _largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  root = step_dir / "state" if (step_dir / "state").is_dir() else step_dir
  files = [p for p in root.rglob("*") if p.is_file() and "/d/" in str(p)]
  return max(files, key=lambda p: p.stat().st_size)


def _flip(path: pathlib.Path, n: int = 64, seed: int = 0):
  data = bytearray(path.read_bytes())
  rng = np.random.default_rng(seed)
  for i in rng.choice(len(data), size=min(n, len(data)), replace=False):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path):
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {
    "flipped_bytes": lambda d: _flip(_largest_data_file(d)),
    "truncated_data": lambda d: _truncate(_largest_data_file(d)),
    "missing_manifest": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "missing_metadata": lambda d: (d / "state" / "_METADATA").unlink(),
    "flipped_meta_json": lambda d: _flip(d / "meta" / "metadata", n=2),
    "missing_checksums": lambda d: (d / checkpoint.CHECKSUM_FILE).unlink(),
}


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_latest_step_falls_back_to_previous(tmp_path, damage, caplog):
  _write(tmp_path)
  DAMAGES[damage](tmp_path / "6")
  with Checkpointer(tmp_path, save_every=2, keep=5) as ckpt:
    assert ckpt.check_step(6) is not None and ckpt.check_step(4) is None
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
      state, meta, step = ckpt.restore(ABSTRACT)
    assert step == 4 and meta == {"step": 4}
    _assert_equal(state, _state(4))
    lines = [r.getMessage() for r in caplog.records if "resuming from step 4" in r.getMessage()]
    assert len(lines) == 1 and "6" in lines[0] and str(tmp_path) in lines[0]
    # An explicit request for the damaged step is an error, never a silent read.
    with pytest.raises(CheckpointDamagedError, match=f"step 6 in {tmp_path}"):
      ckpt.restore(ABSTRACT, step=6)


def test_nothing_intact_names_the_folder(tmp_path):
  _write(tmp_path, steps=(2, 4))
  _flip(_largest_data_file(tmp_path / "4"))
  _truncate(_largest_data_file(tmp_path / "2"))
  with Checkpointer(tmp_path, save_every=2) as ckpt:
    with pytest.raises(CheckpointDamagedError) as info:
      ckpt.restore(ABSTRACT)
  msg = str(info.value)
  assert f"No intact checkpoint in {tmp_path}" in msg and "step 4: checksum mismatch" in msg
  assert "step 2:" in msg and "truncated" in msg


def test_nan_weights_are_refused(tmp_path):
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(1, _state(1))
    bad = _state(2)
    bad["w"] = bad["w"].at[3, 5].set(jnp.nan)
    ckpt.save(2, bad)
    state, _, step = ckpt.restore(ABSTRACT)
    assert step == 1
    _assert_equal(state, _state(1))
    with pytest.raises(NonFiniteStateError, match=r"step 2 .* NaN or inf in 1 array\(s\): w"):
      ckpt.restore(ABSTRACT, step=2)


def test_resumed_writer_replaces_a_damaged_step(tmp_path):
  """The training process quarantines damaged steps; saving that step again writes it afresh."""
  _write(tmp_path)
  _flip(_largest_data_file(tmp_path / "6"))
  with Checkpointer(tmp_path, save_every=2, keep=5) as ckpt:
    _, _, step = ckpt.restore_latest_intact(ABSTRACT, quarantine=True)
    assert step == 4 and ckpt.all_steps() == [2, 4]
    assert len(list((tmp_path / "damaged").iterdir())) == 1
    assert ckpt.save(6, _state(6), {"step": 6})
    state, _, step = ckpt.restore(ABSTRACT)
    assert step == 6
    _assert_equal(state, _state(6))
  # Without quarantine a damaged step is also replaced by the next save of that step.
  _flip(_largest_data_file(tmp_path / "6"), seed=1)
  with Checkpointer(tmp_path, save_every=2, keep=5) as ckpt:
    assert ckpt.save(6, _state(6), {"step": 6})
    assert ckpt.restore(ABSTRACT)[2] == 6


def test_checkpoints_without_checksums_still_restore(tmp_path):
  """A folder written before checksums existed restores (unverified, still checked for NaN)."""
  _write(tmp_path, steps=(2,))
  (tmp_path / "2" / checkpoint.CHECKSUM_FILE).unlink()
  with Checkpointer(tmp_path, save_every=2) as ckpt:
    state, _, step = ckpt.restore(ABSTRACT)
  assert step == 2
  _assert_equal(state, _state(2))


def test_save_params_checksums_and_finiteness(tmp_path):
  save_params(tmp_path / "p", _state(3))
  _assert_equal(load_params(tmp_path / "p", ABSTRACT), _state(3))
  _flip(_largest_data_file(tmp_path / "p"))
  with pytest.raises(CheckpointDamagedError, match="checksum mismatch"):
    load_params(tmp_path / "p", ABSTRACT)
  save_params(tmp_path / "nan", {"w": jnp.full((64, 64), jnp.inf), "b": jnp.zeros(64)})
  with pytest.raises(NonFiniteStateError, match="hold NaN or inf in 1 array"):
    load_params(tmp_path / "nan", ABSTRACT)


def test_read_without_abstract_state(tmp_path):
  _write(tmp_path)
  _flip(_largest_data_file(tmp_path / "6"))
  with Checkpointer(tmp_path, save_every=2) as ckpt:
    state, meta, step = ckpt.read()
  assert step == 4 and meta == {"step": 4}
  _assert_equal(state, _state(4))


def test_read_refuses_nan_weights(tmp_path):
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.save(1, _state(1))
    ckpt.save(2, {"w": jnp.full((64, 64), jnp.nan), "b": jnp.zeros(64)})
    state, _, step = ckpt.read()
    assert step == 1
    _assert_equal(state, _state(1))
    with pytest.raises(NonFiniteStateError, match="step 2"):
      ckpt.read(step=2)
