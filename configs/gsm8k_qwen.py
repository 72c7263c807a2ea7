r"""GSM8K with a real Qwen2.5 / Qwen3 / Llama 3 checkpoint from a local folder (GPU / TPU).

Nothing is downloaded: put a Hugging Face checkpoint folder (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json) somewhere and pass it as the config argument, and the
GSM8K JSONL files in `data.manual_dir` (default: the shared benchmarks folder or
$ROLLOUTS_JAX_BENCHMARKS).

  python -m experiments.launch.train --config=configs/gsm8k_qwen.py:/path/to/Qwen2.5-0.5B-Instruct \
      --workdir=/tmp/rollouts_gsm8k
  python -m experiments.launch.train --config=configs/gsm8k_qwen.py:/path/to/ckpt,smoke ...
"""

from rollouts_jax.training.config import apply_smoke, base_config_dict


def get_config(arg=None):
  parts = [p for p in (arg or "").split(",") if p]
  smoke = "smoke" in parts
  paths = [p for p in parts if p != "smoke"]
  config = base_config_dict()
  config.data.task = "gsm8k"
  config.data.template = "chat"
  config.data.max_prompt_len = 512
  config.tokenizer.kind = "hf"
  config.model.init = "hf"
  config.model.path = paths[0] if paths else ""
  config.model.dtype = "bfloat16"
  config.reward.name = "task"
  config.reward.num_workers = 4
  config.rl.steps = 200
  config.control.prompts_per_step = 32
  config.rollout.num_samples = 8
  config.rollout.max_new_tokens = 512
  config.rl.learning_rate = 1e-6
  config.rl.warmup_steps = 10
  config.rl.clip_high = 0.28
  config.rl.kl_coef = 0.0
  config.rl.num_minibatches = 4
  config.rl.micro_batch_size = 8
  config.rollout.sample_chunk = 8
  config.control.dynamic_sampling = True
  config.eval.every = 50
  config.eval.num_examples = 500
  config.eval.k = 4
  config.eval.batch_size = 64
  config.checkpoint.every = 20
  config.model.remat = True
  if smoke:
    apply_smoke(config)
    config.model.dtype = "float32"
    config.data.max_prompt_len = 1024
  return config
