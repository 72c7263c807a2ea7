"""Prompts in, texts out: a task's prompts formatted and padded for the sampler, completions decoded.

>>> import numpy as np
>>> from rollouts_jax import data
>>> tok = data.CharTokenizer.default()
>>> ids = np.asarray([[tok.encode("12")]]); decode_completions(tok, ids, ids > 0)
[['12']]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from rollouts_jax import sampling, tasks


def decode_completions(tokenizer, ids_BxNxT: np.ndarray, mask_BxNxT: np.ndarray) -> list[list[str]]:
  """Texts of the completions `[B][N]`: EOS, end-of-turn ids, padding and special tokens dropped."""
  B, N, T = ids_BxNxT.shape
  stop = set(tokenizer.end_of_turn_ids)
  out = []
  for b in range(B):
    row = []
    for j in range(N):
      toks = [int(t) for t in ids_BxNxT[b, j][mask_BxNxT[b, j]] if int(t) not in stop]
      row.append(tokenizer.decode(toks, skip_special=True))
    out.append(row)
  return out


@dataclasses.dataclass
class Prompter:
  """Formats, tokenizes and left-pads a task's prompts (buckets keep the shapes few)."""
  task: tasks.Task
  tokenizer: Any
  template: str = "plain"
  instruction: bool = True
  max_prompt_len: int = 64
  buckets: tuple[int, ...] = sampling.DEFAULT_PROMPT_BUCKETS

  def __call__(self, examples: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    from rollouts_jax import data as data_lib  # pylint: disable=g-import-not-at-top
    texts = [self.task.prompt(ex, self.tokenizer, self.template, instruction=self.instruction) for ex in examples]
    ids = [self.tokenizer.encode(t) for t in texts]
    longest = max(len(x) for x in ids)
    if longest > self.max_prompt_len:
      raise ValueError(f"A prompt has {longest} tokens, more than data.max_prompt_len={self.max_prompt_len}.")
    ids, mask = data_lib.pad_left(ids, self.buckets, pad_id=self.tokenizer.pad_id)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)
