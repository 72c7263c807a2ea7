"""TFDS builders: synthetic tasks generated from a seed, and benchmarks from local files.

All builders write ``array_record`` files and are read back with ``as_data_source`` /
``tfds.data_source``: random access, no TensorFlow needed (TensorFlow is not installed).
What makes that work without TensorFlow: ``GeneratorBasedBuilder`` with
``file_format="array_record"`` (the default of every builder here), a ``DatasetInfo`` built
directly (``dataset_info_from_configs`` would look for metadata files beside the code), a
``code_path`` that does not need the ``importlib_resources`` backport, and reading through
``ArrayRecordDataSource`` rather than ``as_dataset``.

Builders (registered under these names when this module is imported):

* ``countdown``: :mod:`rollouts_jax.data.countdown`; config ``seed``, ``difficulty`` (1-3),
  ``num_train``, ``num_test``.
* ``arithmetic``: :mod:`rollouts_jax.data.arithmetic`; config ``seed``, ``digits``,
  ``min_digits``, ``ops`` (``"+"``, ``"*"`` or ``"+*"``), ``num_train``, ``num_test``.
* ``gsm8k`` (train, test), ``math500``, ``aime24``, ``amc23`` (test): the JSONL files of
  :mod:`rollouts_jax.data.benchmarks` (packaged, or a ``manual_dir``). Their config is named
  by the files' content (``files_<sha256 prefix>``), so an edited file gets its own folder and
  is read again instead of an outdated cache.

A synthetic config's name spells out every parameter (``d2_seed0_train1000_test100``), so
each parameter set gets its own folder and files are reused only for the very same
parameters. :func:`prepare` builds when the files are missing and reuses them otherwise;
``rebuild=True`` regenerates them. Train and test splits never share an instance; a split
asked to have 0 examples is left out (TFDS cannot write an empty split). Several processes
may prepare the same dataset at once: :func:`prepare` builds under a cross-process lock
(``<data_dir>/.locks/``), so one builds and the others wait and reuse its files.

>>> test = load_dataset("countdown", "test", data_dir="/tmp/tfds", seed=0,
...                     num_train=100, num_test=10)  # doctest: +SKIP
>>> sorted(test[0])  # doctest: +SKIP
['difficulty', 'numbers', 'solution', 'target']
>>> import tensorflow_datasets as tfds  # the plain TFDS route gives the same records
>>> tfds.data_source("countdown/d2_seed0_train100_test10", split="test",
...                  data_dir="/tmp/tfds")  # doctest: +SKIP
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import os
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from rollouts_jax.data import arithmetic as arithmetic_lib
from rollouts_jax.data import benchmarks as benchmarks_lib
from rollouts_jax.data import countdown as countdown_lib

__all__ = ["CountdownConfig", "ArithmeticConfig", "Countdown", "Arithmetic", "Gsm8k", "Math500",
           "Aime24", "Amc23", "BenchmarkConfig", "SYNTHETIC_BUILDERS", "BENCHMARK_BUILDERS", "get_builder",
           "prepare", "ExampleSource", "load_dataset", "decode_example"]

_FILE_FORMAT = "array_record"


def _check_sizes(num_train: int, num_test: int, seed: int):
  for what, n in (("num_train", num_train), ("num_test", num_test)):
    if not isinstance(n, (int, np.integer)) or n < 0:
      raise ValueError(f"{what} must be a non-negative int, got {n!r}")
  if num_train + num_test == 0:
    raise ValueError("num_train and num_test are both 0: nothing to build")
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")


@dataclasses.dataclass(eq=False)
class CountdownConfig(tfds.core.BuilderConfig):
  """Countdown parameters; the config name is derived from them when not given."""
  name: str = ""
  seed: int = 0
  difficulty: int = 2
  num_train: int = 10_000
  num_test: int = 500

  def __post_init__(self):
    _check_sizes(self.num_train, self.num_test, self.seed)
    if self.difficulty not in countdown_lib.COUNTDOWN_LEVELS:
      raise ValueError(f"countdown difficulty must be one of "
                       f"{sorted(countdown_lib.COUNTDOWN_LEVELS)}, got {self.difficulty}")
    if not self.name:
      self.name = (f"d{self.difficulty}_seed{self.seed}_train{self.num_train}"
                   f"_test{self.num_test}")
    if self.description is None:
      self.description = f"countdown, difficulty {self.difficulty}, seed {self.seed}"


_OPS_NAMES = {"+": "add", "*": "mul", "+*": "addmul", "*+": "muladd"}


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(tfds.core.BuilderConfig):
  """Arithmetic parameters; the config name is derived from them when not given."""
  name: str = ""
  seed: int = 0
  digits: int = 3
  min_digits: int = 1
  ops: str = "+"
  num_train: int = 10_000
  num_test: int = 500

  def __post_init__(self):
    _check_sizes(self.num_train, self.num_test, self.seed)
    if self.ops not in _OPS_NAMES:
      raise ValueError(f"arithmetic ops must be one of {sorted(_OPS_NAMES)}, got {self.ops!r}")
    if not 1 <= self.min_digits <= self.digits:
      raise ValueError(f"need 1 <= min_digits <= digits, got {self.min_digits}, {self.digits}")
    if not self.name:
      self.name = (f"{_OPS_NAMES[self.ops]}_d{self.min_digits}-{self.digits}_seed{self.seed}"
                   f"_train{self.num_train}_test{self.num_test}")
    if self.description is None:
      self.description = f"arithmetic {self.ops}, {self.min_digits}-{self.digits} digits"


class _ArrayRecordBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Writes array_record files unless told otherwise."""

  def __init__(self, *, file_format: str | None = None, **kwargs: Any):
    super().__init__(file_format=file_format or _FILE_FORMAT, **kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS' own lookup (4.9.x) imports the `importlib_resources` backport for builders that
    # live in a package, which Python >= 3.9 installs do not have.
    return epath.Path(inspect.getfile(cls))

  def _features(self) -> tfds.features.FeaturesDict:
    raise NotImplementedError

  def _splits(self, **splits: list[dict]) -> dict:
    # TFDS cannot write an empty split: a split asked to have 0 examples is left out.
    return {name: self._generate_examples(examples) for name, examples in splits.items()
            if examples}

  def _info(self) -> tfds.core.DatasetInfo:
    # Built directly: dataset_info_from_configs would read metadata files beside the code.
    return tfds.core.DatasetInfo(builder=self, description=self.__doc__,
                                 features=self._features())


class Countdown(_ArrayRecordBuilder):
  """Countdown: numbers and a target, answer an expression (see rollouts_jax.data.countdown)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  BUILDER_CONFIGS = [CountdownConfig(difficulty=d) for d in sorted(countdown_lib.COUNTDOWN_LEVELS)]
  DEFAULT_CONFIG_NAME = BUILDER_CONFIGS[1].name

  def _features(self):
    return tfds.features.FeaturesDict({
        "numbers": tfds.features.Sequence(np.int64),
        "target": np.int64,
        "solution": tfds.features.Text(),
        "difficulty": np.int32,
    })

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    test = countdown_lib.generate_countdown(cfg.seed, "test", cfg.num_test, cfg.difficulty)
    train = countdown_lib.generate_countdown(cfg.seed, "train", cfg.num_train, cfg.difficulty,
                                             exclude={countdown_lib.countdown_key(e)
                                                      for e in test})
    return self._splits(train=train, test=test)

  def _generate_examples(self, examples):
    for i, ex in enumerate(examples):
      yield i, ex


class Arithmetic(_ArrayRecordBuilder):
  """Multi-digit + and * with worked solutions (see rollouts_jax.data.arithmetic)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  BUILDER_CONFIGS = [ArithmeticConfig(digits=d, ops=ops) for ops in ("+", "*")
                     for d in (2, 3, 4)]
  DEFAULT_CONFIG_NAME = BUILDER_CONFIGS[1].name

  def _features(self):
    return tfds.features.FeaturesDict({
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "solution": tfds.features.Text(),
        "a": np.int64,
        "b": np.int64,
        "op": tfds.features.Text(),
        "difficulty": np.int32,
    })

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    kw = dict(digits=cfg.digits, min_digits=cfg.min_digits, ops=cfg.ops)
    test = arithmetic_lib.generate_arithmetic(cfg.seed, "test", cfg.num_test, **kw)
    train = arithmetic_lib.generate_arithmetic(
        cfg.seed, "train", cfg.num_train, exclude={arithmetic_lib.arithmetic_key(e)
                                                   for e in test}, **kw)
    return self._splits(train=train, test=test)

  def _generate_examples(self, examples):
    for i, ex in enumerate(examples):
      yield i, ex


_MANUAL_INSTRUCTIONS = (
    "Put the benchmark JSONL files (gsm8k_train.jsonl, gsm8k_test.jsonl, math500.jsonl, "
    "aime24.jsonl, amc23.jsonl) in one folder and pass it as manual_dir "
    "(rollouts_jax.data.prepare(builder, manual_dir=...) or "
    "tfds.download.DownloadConfig(manual_dir=...)), or set the environment variable "
    f"{benchmarks_lib.BENCHMARKS_ENV}.")


@dataclasses.dataclass(eq=False)
class BenchmarkConfig(tfds.core.BuilderConfig):
  """The benchmark files a dataset was built from: their content digest names the config."""
  name: str = ""
  digest: str = ""
  manual_dir: str = ""

  def __post_init__(self):
    if not self.name:
      self.name = f"files_{self.digest}"


class _BenchmarkBuilder(_ArrayRecordBuilder, skip_registration=True):
  """A benchmark read from ``<manual_dir>/<file>.jsonl`` (see rollouts_jax.data.benchmarks)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = _MANUAL_INSTRUCTIONS
  BENCHMARK = ""
  EXTRA_FEATURES: dict = {}

  def _features(self):
    return tfds.features.FeaturesDict({
        "question": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "solution": tfds.features.Text(),
        "id": tfds.features.Text(),
        **self.EXTRA_FEATURES,
    })

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    try:
      folder = dl_manager.manual_dir
    except AssertionError:  # TFDS' default manual dir is missing or empty.
      folder = (cfg.manual_dir if cfg is not None and cfg.manual_dir else
                benchmarks_lib.default_benchmarks_dir())
    files = {split: benchmarks_lib.benchmark_file(self.BENCHMARK, split, os.fspath(folder))
             for split in benchmarks_lib.BENCHMARK_FILES[self.BENCHMARK]}
    if cfg is not None and cfg.digest:
      digest = benchmarks_lib.files_digest(self.BENCHMARK, os.fspath(folder))
      if digest != cfg.digest:
        raise ValueError(
            f"the {self.BENCHMARK} files in {folder} (content {digest}) are not the ones this builder "
            f"was created for ({cfg.digest}); create it with get_builder({self.BENCHMARK!r}, "
            f"data_dir=..., manual_dir={os.fspath(folder)!r}).")
    return {split: self._generate_examples(path) for split, path in files.items()}

  def _generate_examples(self, path):
    for index, record in benchmarks_lib.read_jsonl(path):
      yield index, benchmarks_lib.normalize_record(self.BENCHMARK, record, index)


class Gsm8k(_BenchmarkBuilder):
  """GSM8K grade-school math (train 7473, test 1319)."""
  BENCHMARK = "gsm8k"


class Math500(_BenchmarkBuilder):
  """MATH-500, the subset of the MATH test set chosen in "Let's Verify Step by Step"."""
  BENCHMARK = "math500"
  EXTRA_FEATURES = {"subject": tfds.features.Text(), "level": np.int32}


class Aime24(_BenchmarkBuilder):
  """AIME 2024 I and II (30 problems, integer answers)."""
  BENCHMARK = "aime24"
  EXTRA_FEATURES = {"url": tfds.features.Text()}


class Amc23(_BenchmarkBuilder):
  """AMC 2023 (40 problems)."""
  BENCHMARK = "amc23"
  EXTRA_FEATURES = {"url": tfds.features.Text()}


SYNTHETIC_BUILDERS = {"countdown": (Countdown, CountdownConfig),
                      "arithmetic": (Arithmetic, ArithmeticConfig)}
BENCHMARK_BUILDERS = {"gsm8k": Gsm8k, "math500": Math500, "aime24": Aime24, "amc23": Amc23}
_LOCK_TIMEOUT_S = 3600.0


def _config_params(cfg) -> dict:
  return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "description"}


def get_builder(name: str, *, data_dir: str | os.PathLike | None,
                manual_dir: str | os.PathLike | None = None, **config: Any) -> tfds.core.DatasetBuilder:
  """A builder (not yet prepared) for one of the datasets of this module.

  Args:
    name: ``"countdown"``, ``"arithmetic"``, ``"gsm8k"``, ``"math500"``, ``"aime24"`` or
      ``"amc23"``.
    data_dir: where TFDS keeps the prepared files (``None``: TFDS' default,
      ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
    manual_dir: benchmarks only: the folder of the JSONL files (``None``: see
      :func:`rollouts_jax.data.benchmarks.resolve_manual_dir`); the config is keyed by their
      content.
    **config: fields of :class:`CountdownConfig` / :class:`ArithmeticConfig` (synthetic
      tasks only).

  Returns:
    The builder.

  >>> b = get_builder("arithmetic", data_dir="/tmp/tfds", digits=2, num_train=50,
  ...                 num_test=5)
  >>> b.builder_config.name
  'add_d1-2_seed0_train50_test5'
  """
  data_dir = None if data_dir is None else os.fspath(data_dir)
  if manual_dir is not None and name not in BENCHMARK_BUILDERS:
    raise ValueError(f"manual_dir is only for the benchmark builders, not {name!r}")
  if name in SYNTHETIC_BUILDERS:
    builder_cls, config_cls = SYNTHETIC_BUILDERS[name]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(config) - known
    if unknown:
      raise ValueError(f"unknown {name} config keys {sorted(unknown)}; known: "
                       f"{sorted(known - {'version', 'release_notes', 'supported_versions', 'tags'})}")
    cfg = config_cls(**config)
    predefined = {c.name: c for c in builder_cls.BUILDER_CONFIGS}
    if cfg.name in predefined and _config_params(predefined[cfg.name]) == _config_params(cfg):
      # TFDS refuses a custom config named like a predefined one, even an identical one.
      return builder_cls(data_dir=data_dir, config=cfg.name)
    return builder_cls(data_dir=data_dir, config=cfg)
  if name in BENCHMARK_BUILDERS:
    if config:
      raise ValueError(f"benchmark {name!r} takes no config, got {sorted(config)}")
    folder = benchmarks_lib.resolve_manual_dir(manual_dir)
    cfg = BenchmarkConfig(digest=benchmarks_lib.files_digest(name, folder), manual_dir=os.fspath(folder),
                          description=f"{name} from {folder}")
    return BENCHMARK_BUILDERS[name](data_dir=data_dir, config=cfg)
  raise ValueError(f"unknown dataset {name!r}; known: "
                   f"{sorted(SYNTHETIC_BUILDERS) + sorted(BENCHMARK_BUILDERS)}")


def _same_builder(builder: tfds.core.DatasetBuilder) -> tfds.core.DatasetBuilder:
  """A fresh builder for the same dataset (it reads the info another process has written)."""
  cfg = builder.builder_config
  predefined = {c.name for c in type(builder).BUILDER_CONFIGS}
  config = cfg.name if cfg is not None and cfg.name in predefined else cfg
  return type(builder)(data_dir=builder._data_dir_root, config=config)  # pylint: disable=protected-access


def _lock_path(builder: tfds.core.DatasetBuilder) -> str:
  cfg = builder.builder_config
  name = f"{builder.name}__{cfg.name if cfg is not None else 'default'}__{builder.version}.lock"
  return os.path.join(builder._data_dir_root, ".locks", name)  # pylint: disable=protected-access


def prepare(builder: tfds.core.DatasetBuilder, *, rebuild: bool = False,
            manual_dir: str | os.PathLike | None = None) -> tfds.core.DatasetBuilder:
  """Builds the dataset's files if they are missing (or always, with ``rebuild=True``).

  Args:
    builder: from :func:`get_builder` (or any builder of this module).
    rebuild: regenerate the files even when they exist (TFDS ``FORCE_REDOWNLOAD``).
    manual_dir: benchmarks only: the folder of the JSONL files (``None``: the folder the
      builder was keyed on, else ``$ROLLOUTS_JAX_BENCHMARKS`` or the packaged files).

  Returns:
    The builder, prepared: the same one, or for the same dataset a fresh one (when another
    process built it meanwhile, or a benchmark's files differ from those it was keyed on).

  Raises:
    BenchmarkFilesMissingError: a benchmark file is missing (the message names the path).
  """
  folder = None
  if isinstance(builder, _BenchmarkBuilder):
    cfg = builder.builder_config
    if manual_dir is None and cfg is not None and cfg.manual_dir:
      manual_dir = cfg.manual_dir
    folder = benchmarks_lib.resolve_manual_dir(manual_dir)
    for split in benchmarks_lib.BENCHMARK_FILES[builder.BENCHMARK]:
      benchmarks_lib.benchmark_file(builder.BENCHMARK, split, folder)  # clear error early
    if cfg is None or cfg.digest != benchmarks_lib.files_digest(builder.BENCHMARK, folder):
      # Other files than the builder was keyed on (or an unkeyed builder): key it on these.
      builder = get_builder(builder.BENCHMARK, data_dir=builder._data_dir_root,  # pylint: disable=protected-access
                            manual_dir=folder)
  elif manual_dir is not None:
    raise ValueError(f"manual_dir is only for the benchmark builders, not {builder.name!r}")
  if not rebuild and builder.is_prepared():
    return builder if builder.info.splits else _same_builder(builder)
  from rollouts_jax.io import filelock  # pylint: disable=g-import-not-at-top
  mode = (tfds.download.GenerateMode.FORCE_REDOWNLOAD if rebuild else
          tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
  with filelock.FileLock(_lock_path(builder), timeout_s=_LOCK_TIMEOUT_S,
                            what=f"The build of {builder.name}/{builder.builder_config.name}"):
    if not rebuild and _same_builder(builder).is_prepared():
      return _same_builder(builder)  # another process built it while we waited
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            download_mode=mode, manual_dir=None if folder is None else os.fspath(folder)))
  return builder


def decode_example(example: dict) -> dict:
  """Turns a record of a TFDS data source into plain Python (bytes -> str, numpy -> int/list)."""

  def convert(x):
    if isinstance(x, bytes):
      return x.decode("utf-8")
    if isinstance(x, np.ndarray):
      return [convert(v) for v in x.tolist()] if x.ndim else convert(x.item())
    if isinstance(x, np.generic):
      return x.item()
    if isinstance(x, (list, tuple)):
      return [convert(v) for v in x]
    if isinstance(x, dict):
      return {k: convert(v) for k, v in x.items()}
    return x

  return convert(example)


class ExampleSource(collections.abc.Sequence):
  """Random access to a prepared split as plain Python dicts.

  Args:
    source: a TFDS ``ArrayRecordDataSource`` (``builder.as_data_source(split)``).

  src = load_dataset("arithmetic", "test", data_dir="/tmp/tfds", num_train=20,
                     num_test=5)
  len(src), src[0]["answer"]
  # (5, '1032')
  """

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    n = len(self)
    if not -n <= index < n:
      raise IndexError(f"index {index} out of range for {n} examples")
    return decode_example(self._source[index % n])

  def __repr__(self) -> str:
    return f"ExampleSource({self._source!r}, n={len(self)})"


def load_dataset(name: str, split: str, *, data_dir: str | os.PathLike | None,
                 rebuild: bool = False, manual_dir: str | os.PathLike | None = None,
                 **config: Any) -> ExampleSource:
  """Prepares (if needed) and opens one split of a dataset of this module.

  Args:
    name: see :func:`get_builder`.
    split: ``"train"`` or ``"test"`` (benchmarks: see ``BENCHMARK_FILES``).
    data_dir: where TFDS keeps the prepared files.
    rebuild: regenerate the files even when they exist.
    manual_dir: benchmarks only, the folder of the JSONL files.
    **config: synthetic task parameters (see :func:`get_builder`).

  Returns:
    An :class:`ExampleSource` over the split.

  src = load_dataset("countdown", "train", data_dir="/tmp/tfds", difficulty=1,
                     num_train=8, num_test=2)
  len(src)
  # 8
  """
  keyed = {"manual_dir": manual_dir} if name in BENCHMARK_BUILDERS else {}
  builder = prepare(get_builder(name, data_dir=data_dir, **keyed, **config), rebuild=rebuild,
                    manual_dir=manual_dir)
  if split not in builder.info.splits:
    raise ValueError(f"{name} has splits {sorted(builder.info.splits)}, not {split!r}")
  return ExampleSource(builder.as_data_source(split=split))
