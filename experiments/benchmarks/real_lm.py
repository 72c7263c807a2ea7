"""What the real-model benchmarks share: the GSM8K chat prompts, the GRPO experiment at a shape,
`BxNxT` shapes and the process's resident memory.

`bench_real_lm.py` (ours against transformers / TRL) and `memory_real_lm.py` (peak memory with and
without the memory options) run the same experiment: `configs/smollm2_addition.py`'s update
settings on the first GSM8K test questions in SmolLM2's chat template.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource

REPO = pathlib.Path(__file__).resolve().parents[2]
GSM8K_TEST = REPO / "rollouts_jax" / "data" / "benchmark_files" / "gsm8k_test.jsonl"
TRAIN_CONFIG = REPO / "configs" / "smollm2_addition.py"
MB = 2 ** 20


def parse_shape(text: str, flag: str = "--shape") -> tuple[int, int, int]:
  """"BxNxT" (prompts x samples x new tokens) -> (B, N, T); a ValueError naming `flag` otherwise.

  >>> parse_shape("8x8x96")
  (8, 8, 96)
  """
  try:
    B, N, T = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise ValueError(f"{flag} must be BxNxT (prompts x samples x new tokens), e.g. 4x8x64; got {text!r}.") from None
  if min(B, N, T) < 1:
    raise ValueError(f"{flag} needs positive sizes, got {text!r}.")
  return B, N, T


def shape_name(shape) -> str:
  """(4, 8, 64) -> "4x8x64"."""
  return "x".join(str(s) for s in shape)


def peak_rss_mb() -> float:
  """The most this process has held resident, in MiB (`ru_maxrss`, KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mb(pid: int | str = "self") -> float:
  """The resident set of a process now, in MiB."""
  with open(f"/proc/{pid}/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def gsm8k_chat(tokenizer, count: int) -> dict:
  """The first `count` GSM8K test questions in the model's chat template: examples, texts, token ids
  (lists), reference answers and the pad id."""
  from rollouts_jax import tasks  # pylint: disable=g-import-not-at-top
  task = tasks.get("gsm8k")
  with open(GSM8K_TEST) as f:
    examples = [json.loads(line) for line, _ in zip(f, range(count))]
  texts = [task.prompt(ex, tokenizer, "chat") for ex in examples]
  return dict(examples=examples, texts=texts, ids=[list(map(int, tokenizer.encode(t))) for t in texts],
              answers=[ex["answer"] for ex in examples], pad_id=int(tokenizer.pad_id))


def left_pad(ids: list[list[int]], pad_id: int):
  """(ids int32 [B, P], mask bool [B, P]) left-padded to the longest row.

  >>> ids, mask = left_pad([[5, 6], [7]], pad_id=0)
  >>> ids.tolist(), mask.tolist()
  ([[5, 6], [0, 7]], [[True, True], [False, True]])
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  P = max(len(r) for r in ids)
  out, mask = np.full((len(ids), P), pad_id, np.int32), np.zeros((len(ids), P), bool)
  for i, r in enumerate(ids):
    out[i, P - len(r):], mask[i, P - len(r):] = r, True
  return out, mask


def grpo_experiment(B: int, N: int, T: int, seed: int, **settings):
  """`configs/smollm2_addition.py` on GSM8K chat prompts at B prompts x N samples x T new tokens (no
  dynamic sampling, no warmup), with `settings` as `section__key=value` (e.g. `rl__steps=2`)."""
  from rollouts_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.load_config_file(TRAIN_CONFIG)
  c.seed = seed
  c.data.task, c.data.template = "gsm8k", "chat"
  c.rollout.num_samples, c.rollout.max_new_tokens = N, T
  c.control.prompts_per_step, c.control.dynamic_sampling = B, False
  c.rl.warmup_steps = 0
  for name, value in settings.items():
    section, key = name.split("__")
    setattr(getattr(c, section), key, value)
  return config_lib.from_config_dict(c)
