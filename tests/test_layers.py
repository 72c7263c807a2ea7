"""The package's floors: lower modules do not import higher ones (read from the source, no import)."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "rollouts_jax"


def _package_imports(path: pathlib.Path) -> set[str]:
  """The rollouts_jax subpackages (first component after the root) a file imports."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for name in names:
      parts = name.split(".")
      if parts[0] == "rollouts_jax" and len(parts) > 1:
        out.add(parts[1])
  return out


def test_types_is_the_bottom_floor():
  assert _package_imports(PKG / "types.py") == set()


def test_replay_stores_batches_without_knowing_how_they_were_generated():
  for path in sorted((PKG / "replay").glob("*.py")):
    assert _package_imports(path) <= {"replay", "types"}, path.name


def test_the_batch_type_has_one_definition():
  defined = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if "class RolloutBatch" in p.read_text()]
  assert defined == ["types.py"]


def test_the_config_imports_no_training_module_so_there_is_no_import_circle():
  """training/config.py checks every section with the stages' own registries, never with the
  modules that consume the config (rl_step, the loop ... import it)."""
  text = (PKG / "training" / "config.py").read_text()
  training = {n.module for n in ast.walk(ast.parse(text))
              if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("rollouts_jax.training")}
  training |= {f"rollouts_jax.training.{a.name}" for n in ast.walk(ast.parse(text))
               if isinstance(n, ast.ImportFrom) and n.module == "rollouts_jax.training" for a in n.names}
  assert training == set()


def test_io_and_sharding_sit_below_training():
  """Checkpoints, metrics, plots, interrupts and locks know no stage and no config; sharding builds
  its checkpoint helpers on them, never on training."""
  for path in sorted((PKG / "io").glob("*.py")):
    assert _package_imports(path) <= {"io"}, path.name
  for path in sorted((PKG / "sharding").glob("*.py")):
    assert "training" not in _package_imports(path), path.name


def test_the_rollout_step_sits_below_training():
  """The rollout step and its batch sources (sync and async) know the stages and the model, not
  the loop or its config: they take config sections and plain values."""
  for path in sorted((PKG / "rollout").glob("*.py")):
    assert "training" not in _package_imports(path), path.name


def test_data_pads_prompts_without_importing_sampling():
  """Tokenizers, TFDS builders and batching sit below GENERATE: the prompt buckets are on the bottom floor."""
  for path in sorted((PKG / "data").glob("*.py")):
    assert not _package_imports(path) & {"sampling", "rollout", "training", "control", "replay"}, path.name


def test_sampling_imports_no_stage_above_it():
  """GENERATE's primitives know the model, kernels and sharding, not CONTROL, FILTER, REPLAY or the loop."""
  for path in sorted((PKG / "sampling").glob("*.py")):
    assert not _package_imports(path) & {"control", "rewards", "replay", "rollout", "training", "data"}, path.name


def test_filter_grades_without_importing_tasks():
  """FILTER's verifiers sit below the tasks that use them: a task's own verifier reaches a grader worker
  as the pickled task, not by a lookup that imports `tasks` from inside `rewards`."""
  for path in sorted((PKG / "rewards").glob("*.py")):
    assert not _package_imports(path) & {"tasks", "data", "sampling", "rollout", "training"}, path.name
