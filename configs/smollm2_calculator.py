r"""Multi-turn tool use on the real model: SmolLM2-135M-Instruct with a calculator, in its chat template.

  python -m experiments.launch.train --config=configs/smollm2_calculator.py --workdir=/tmp/smollm2_calculator
  python -m experiments.launch.multiturn_eval --workdir=/tmp/smollm2_calculator --num_examples=100 --samples=4
  python -m experiments.launch.train --config=configs/smollm2_calculator.py:smoke --workdir=/tmp/smoke

Task `multiply_tool` (1-2 digit multiplication) in the `calculator` environment, rendered in the
model's own ChatML template (`rollout.env_render="chatml"`): the user turn asks "What is 47 * 28?"
and explains the tool ("You may call a calculator with <tool_call>expression</tool_call>. Put the
final answer in <answer></answer>."); a turn that ends with `</tool_call>` gets the calculator's
output back as a `tool` message, rendered by the tokenizer's template once and appended as ids
(zero loss), and the assistant turn reopens. A turn without a call ends the episode; its
`<answer>` is graded (reward 1 / 0).

As shipped the model almost never writes the format (100 test problems x 4 episodes at temperature
1: tool use 0.02, accuracy 0.00), so GRPO alone has no reward to learn from. A short SFT of the
shipped model (`sft.from_pretrained`, cached like the small models' warm starts) teaches the format
on the task's targets: half of the problems call the calculator and copy its result into the answer,
half answer directly (`multiply_tool`'s `tool_frac`); in the chat format the `tool` message of
the target is untrained, as in an episode. GRPO on the trajectory rewards then decides how often
to call the tool. `env/tool_use_frac` and `env/accuracy` are logged per step; the held-out
before/after of whole episodes is `multiturn_eval` ("before" is the SFT warm start).

Seed 0, the same 400 held-out episodes (README, `experiments/studies/results/smollm2_calculator.json`):
SFT warm start tool use 0.265, accuracy 0.533; after 40 GRPO steps tool use 1.000, accuracy 1.000.
"""

import os

from rollouts_jax.training.config import apply_smoke, load_config_file, parse_config_arg

_HERE = os.path.dirname(__file__)


def get_config(arg=None):
  smoke = "smoke" in parse_config_arg(arg)
  config = load_config_file(os.path.join(_HERE, "smollm2_addition.py"), None)
  config.data.task = "multiply_tool"
  config.data.ops = "*"
  config.data.max_prompt_len = 96
  config.data.num_train = 8000       # of the 9,500 distinct 1-2 digit products
  config.data.num_test = 200
  config.sft.from_pretrained = True
  config.sft.steps = 80
  config.sft.batch_size = 8
  config.sft.learning_rate = 5e-5
  config.sft.warmup_steps = 5
  config.sft.log_every = 10
  config.rollout.generator = "multiturn"
  config.rollout.env = "calculator"
  config.rollout.env_kwargs = "max_calls=2,instruction=True"
  config.rollout.env_render = "chatml"
  config.rollout.max_turns = 3
  config.rollout.turn_tokens = 32
  config.rollout.max_new_tokens = 112  # all turns and the observations (tool messages) between them
  config.rollout.turn_credit = "trajectory"
  config.rollout.temperature = 1.0
  config.control.prompts_per_step = 8
  config.control.dynamic_sampling = False
  config.control.max_refills = -1
  config.rl.steps = 40
  config.rl.learning_rate = 1e-5
  config.eval.every = 0               # the run's single-turn eval never runs the tool: multiturn_eval does
  config.eval.num_examples = 100
  if smoke:
    apply_smoke(config)
    config.rl.micro_batch_size = 0
    config.rollout.turn_tokens = min(config.rollout.turn_tokens, config.rollout.max_new_tokens)
  return config
