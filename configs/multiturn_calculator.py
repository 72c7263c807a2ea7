r"""Multi-turn tool use: the small char model learns to call a calculator for 2-digit multiplication.

  python -m experiments.launch.train --config=configs/multiturn_calculator.py --workdir=/tmp/multiturn_calculator
  python -m experiments.launch.train --config=configs/multiturn_calculator.py:smoke --workdir=/tmp/smoke

Task `multiply_tool` ("What is 47 * 28?"), environment `calculator`: a turn that ends with
`<tool_call>47*28</tool_call>` gets `<tool_result>1316</tool_result>` appended (computed by the
sandboxed calculator; the observation's tokens carry no loss) and the policy goes on; a turn
without a call ends the episode and its `<answer>` is graded (reward 1 / 0). The warm start
(SFT) calls the tool on half of the problems and answers directly on the others; a 0.6M
char model multiplies 2-digit numbers poorly by heart, so GRPO on the trajectory rewards
raises the share of trajectories that call the tool (`env/tool_use_frac` in metrics.jsonl, per
step) together with the accuracy of the episodes (`env/accuracy`). The run's own `eval/*` samples
single turns without running the tool; the held-out before/after of whole episodes is

  python -m experiments.launch.multiturn_eval --workdir=/tmp/multiturn_calculator

(seed 0: tool use 0.58 -> 1.00, accuracy 0.61 -> 0.88 on 200 test problems x 4 episodes;
experiments/studies/results/multiturn_calculator.json).
"""

from rollouts_jax.training.config import apply_smoke, base_config_dict, parse_config_arg


def get_config(arg=None):
  smoke = "smoke" in parse_config_arg(arg)
  config = base_config_dict()
  config.data.task = "multiply_tool"
  config.data.difficulty = 2
  config.data.ops = "*"
  config.data.num_train = 8000       # of the 9,500 distinct 1-2 digit products
  config.data.num_test = 500
  config.reward.name = "task"        # with rollout.env the environment's rewards are the rewards
  config.reward.num_workers = 0
  # 300 steps left the char model unable to copy the operands into the call or the result into
  # the answer (held-out accuracy with the tool 0.02); at 1500 it copies both (0.86).
  config.sft.steps = 1500
  config.rl.steps = 150
  config.control.prompts_per_step = 16
  config.rollout.num_samples = 8
  config.rollout.max_new_tokens = 96  # all turns and observations of a trajectory
  config.rollout.generator = "multiturn"
  config.rollout.env = "calculator"
  config.rollout.env_kwargs = "max_calls=2"
  config.rollout.max_turns = 3
  config.rollout.turn_tokens = 40
  config.rollout.turn_credit = "trajectory"
  config.rl.advantage = "grpo"
  config.rl.learning_rate = 1.5e-4
  config.eval.num_examples = 200
  if smoke:
    apply_smoke(config)
    config.rollout.turn_tokens = min(config.rollout.turn_tokens, config.rollout.max_new_tokens)
  return config
