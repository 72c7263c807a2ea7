"""Data: TFDS builders, benchmarks, tokenizers, prompt formatting, batching, streams.

Answer convention: countdown and arithmetic completions end with the final answer in
``<answer>...</answer>`` (countdown: an expression such as ``<answer>(12+7)*3</answer>``;
arithmetic: a number, ``<answer>936</answer>``); the benchmarks (gsm8k, math500, aime24,
amc23) ask for ``\\boxed{...}``. ``formatting.ANSWER_FORMATS`` records which is which and
``parse_answer`` extracts a tagged answer.

>>> from rollouts_jax import data
>>> tok = data.CharTokenizer.default()
>>> test = data.load_dataset("arithmetic", "test", data_dir="/tmp/tfds", digits=3,
...                          num_train=1000, num_test=100)  # doctest: +SKIP
>>> stream = data.PromptStream(test, batch_size=8, seed=0)  # doctest: +SKIP
>>> batch = data.make_prompt_batch(next(stream), "arithmetic", tok, buckets=(32, 64))  # doctest: +SKIP
>>> batch.prompt_ids.shape  # doctest: +SKIP
(8, 64)
"""

from rollouts_jax.data.arithmetic import generate_arithmetic, worked_solution
from rollouts_jax.data.batching import (DEFAULT_PROMPT_BUCKETS, PromptBatch, bucket_length,
                                        make_prompt_batch, pad_left, pad_right)
from rollouts_jax.data.benchmarks import (BENCHMARK_FILES, BENCHMARKS_ENV,
                                          BenchmarkFilesMissingError, default_benchmarks_dir,
                                          load_benchmark)
from rollouts_jax.data.builders import (Aime24, Amc23, Arithmetic, ArithmeticConfig, Countdown,
                                        CountdownConfig, ExampleSource, Gsm8k, Math500,
                                        get_builder, load_dataset, prepare)
from rollouts_jax.data.countdown import (COUNTDOWN_LEVELS, check_solution, evaluate_expression,
                                         generate_countdown)
from rollouts_jax.data.formatting import (ANSWER_FORMATS, TASKS, format_completion,
                                          format_prompt, parse_answer, question_text,
                                          wrap_answer)
from rollouts_jax.data.pipeline import PromptStream, host_prompt_stream, shuffled_order
from rollouts_jax.data.tokenizers import (CharTokenizer, HFTokenizer, SentencePieceTokenizer,
                                          Tokenizer, load_tokenizer, train_sentencepiece)

__all__ = [
    "generate_arithmetic", "worked_solution", "DEFAULT_PROMPT_BUCKETS", "PromptBatch", "bucket_length",
    "make_prompt_batch", "pad_left", "pad_right", "BENCHMARK_FILES", "BENCHMARKS_ENV",
    "BenchmarkFilesMissingError", "default_benchmarks_dir", "load_benchmark", "Aime24", "Amc23",
    "Arithmetic", "ArithmeticConfig", "Countdown", "CountdownConfig", "ExampleSource", "Gsm8k",
    "Math500", "get_builder", "load_dataset", "prepare", "COUNTDOWN_LEVELS", "check_solution",
    "evaluate_expression", "generate_countdown", "ANSWER_FORMATS", "TASKS", "format_completion",
    "format_prompt", "parse_answer", "question_text", "wrap_answer", "PromptStream",
    "host_prompt_stream", "shuffled_order", "CharTokenizer", "HFTokenizer",
    "SentencePieceTokenizer", "Tokenizer", "load_tokenizer", "train_sentencepiece",
]
