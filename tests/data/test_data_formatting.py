"""Prompt formatting, answer parsing, bucketed padding, prompt batches."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts_jax.data import arithmetic, batching, countdown, formatting
from rollouts_jax.data.tokenizers import CharTokenizer


def test_plain_prompts_by_hand():
  ex = {"numbers": [3, 7, 25], "target": 46, "solution": "25+3*7"}
  assert formatting.format_prompt(ex, "countdown") == (
      "Using the numbers [3, 7, 25], create an expression that equals 46. "
      "Use + - * / and each number exactly once.\nPut the final answer in <answer></answer>.\n")
  ar = {"question": "What is 347 + 589?", "answer": "936"}
  assert formatting.format_prompt(ar, "arithmetic", instruction=False) == "What is 347 + 589?\n"
  assert formatting.format_prompt(ar, "arithmetic", instruction="Go.") == (
      "What is 347 + 589?\nGo.\n")
  gsm = {"question": "  How many?  ", "answer": "3"}
  assert formatting.format_prompt(gsm, "gsm8k").endswith("\\boxed{}.\n")
  assert formatting.format_prompt(gsm, "gsm8k").startswith("How many?\n")


def test_chat_prompt_uses_the_tokenizer_template():
  tok = CharTokenizer.default()
  ar = {"question": "What is 2 + 3?"}
  text = formatting.format_prompt(ar, "arithmetic", "chat", tok, system_prompt="Be exact.")
  assert text == ("<|system|>Be exact.<|end|>\n<|user|>What is 2 + 3? Put the final answer in "
                  "<answer></answer>.<|end|>\n<|assistant|>")
  with pytest.raises(ValueError, match="needs a tokenizer"):
    formatting.format_prompt(ar, "arithmetic", "chat")
  with pytest.raises(ValueError, match="template must be"):
    formatting.format_prompt(ar, "arithmetic", "fancy")
  with pytest.raises(ValueError, match="template='chat'"):
    formatting.format_prompt(ar, "arithmetic", system_prompt="x")
  with pytest.raises(ValueError, match="unknown task"):
    formatting.format_prompt(ar, "sudoku")
  with pytest.raises(ValueError, match="needs the field 'target'"):
    formatting.format_prompt({"numbers": [1, 2]}, "countdown")


def test_completions_carry_the_answer_convention():
  for ex in countdown.generate_countdown(0, "train", 20, difficulty=2):
    completion = formatting.format_completion(ex, "countdown")
    expr = formatting.parse_answer(completion)
    assert countdown.check_solution(expr, ex["numbers"], ex["target"])
  for ex in arithmetic.generate_arithmetic(0, "train", 20, digits=3, ops="+*"):
    assert formatting.parse_answer(formatting.format_completion(ex, "arithmetic")) == ex["answer"]
  gsm = {"question": "q", "answer": "1300",
         "solution": "16 - 3 = <<16-3=13>>13\nSo 13 * 100 = <<13*100=1300>>1300\n#### 1,300"}
  assert formatting.format_completion(gsm, "gsm8k") == (
      "16 - 3 = 13\nSo 13 * 100 = 1300\n\\boxed{1300}")
  with pytest.raises(ValueError, match="no solution"):
    formatting.format_completion({"question": "q", "answer": "1", "solution": ""}, "amc23")


def test_parse_answer_cases():
  assert formatting.parse_answer("<answer>1</answer><answer>\n 22 \n</answer>") == "22"
  assert formatting.parse_answer("<answer>1") is None
  assert formatting.parse_answer("x <answer></answer>") == ""
  assert formatting.wrap_answer("7") == "<answer>7</answer>"
  assert set(formatting.ANSWER_FORMATS.values()) == {"tags", "boxed"}


@pytest.mark.parametrize("pad", [batching.pad_left, batching.pad_right])
def test_padding_by_hand(pad):
  ids, mask = pad([[5, 6, 7], [8], []], buckets=(2, 4, 8), pad_id=-1)
  assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == (3, 4)
  if pad is batching.pad_left:
    assert ids.tolist() == [[-1, 5, 6, 7], [-1, -1, -1, 8], [-1, -1, -1, -1]]
  else:
    assert ids.tolist() == [[5, 6, 7, -1], [8, -1, -1, -1], [-1, -1, -1, -1]]
  assert mask.tolist() == (ids != -1).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 1000), max_size=40), min_size=1, max_size=6))
def test_pad_left_properties(seqs):
  buckets = (8, 16, 32, 64)
  ids, mask = batching.pad_left(seqs, buckets=buckets, pad_id=0)
  longest = max(len(s) for s in seqs)
  # the smallest bucket that fits
  assert ids.shape == (len(seqs), min(b for b in buckets if b >= longest))
  for row_ids, row_mask, s in zip(ids, mask, seqs):
    assert row_ids[row_mask].tolist() == s
    assert row_mask.sum() == len(s)
    # real tokens sit at the right end: once True, the mask stays True
    assert np.all(np.diff(row_mask.astype(int)) >= 0)
    assert np.all(row_ids[~row_mask] == 0)


def test_bucket_errors():
  with pytest.raises(ValueError, match="largest prompt bucket 4"):
    batching.pad_left([[1] * 5], buckets=(2, 4), pad_id=0)
  with pytest.raises(ValueError, match="strictly increasing"):
    batching.pad_left([[1]], buckets=(4, 2), pad_id=0)
  with pytest.raises(ValueError, match="empty batch"):
    batching.pad_left([], buckets=(4,), pad_id=0)
  assert batching.bucket_length(32, (32, 64)) == 32
  assert batching.bucket_length(0, (32, 64)) == 32


def test_one_bucketing_rule_with_the_sampler():
  """Data and sampler share one bucket helper and tuple, so their padded widths cannot drift."""
  from rollouts_jax import sampling
  assert batching.bucket_length is sampling.bucket_length
  assert batching.DEFAULT_PROMPT_BUCKETS is sampling.DEFAULT_PROMPT_BUCKETS
  assert sampling.SamplingConfig().prompt_buckets == batching.DEFAULT_PROMPT_BUCKETS
  for n in (1, 15, 16, 17, 100, 4096):
    ids, _ = batching.pad_left([[1] * n], pad_id=0)   # default buckets
    assert ids.shape[1] == sampling.bucket_length(n, sampling.SamplingConfig().prompt_buckets)
  # The sampler's left padding of an already padded batch is then a no-op.
  ids, mask = batching.pad_left([[3, 4, 5], [6]], pad_id=0)
  P = sampling.bucket_length(ids.shape[1], sampling.DEFAULT_PROMPT_BUCKETS)
  ids2, mask2 = sampling.left_pad_to(ids, mask, P, 0)
  assert np.array_equal(np.asarray(ids2), ids) and np.array_equal(np.asarray(mask2), mask)


def test_make_prompt_batch_round_trips():
  tok = CharTokenizer.default()
  examples = arithmetic.generate_arithmetic(2, "test", 5, digits=4)
  batch = batching.make_prompt_batch(examples, "arithmetic", tok, buckets=(16, 32, 64),
                                     instruction=False, add_bos=True)
  assert batch.prompt_ids.shape == (5, 32)  # "What is 1234 + 5678?\n" + BOS <= 22 tokens
  for row, m, prompt, ex in zip(batch.prompt_ids, batch.prompt_mask, batch.prompts, examples):
    assert prompt == ex["question"] + "\n"
    assert row[m][0] == tok.bos_id
    assert tok.decode(row) == "<bos>" + prompt  # pads dropped
  assert batch.examples == examples
