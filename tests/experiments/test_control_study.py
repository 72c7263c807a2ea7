"""The control study's real-loop report: a method's spend counts what it decodes before step 1."""

import json

from experiments.studies import control
from rollouts_jax.training import config as config_lib


def _method(steps, rollouts, tokens, pass_after, **extra):
  return {"informative_groups": [0.5] * steps, "reward_mean_sampled": [0.4] * steps,
          "rollouts": [rollouts] * steps, "generated_tokens": [tokens] * steps,
          "evals": [(0, 0.4)], "summary": {"before": {"eval/pass@1": 0.4}, "after": {"eval/pass@1": pass_after}},
          **extra}


def test_real_report_counts_pvpo_pre_sampling_in_the_equal_budget(tmp_path, monkeypatch):
  monkeypatch.setattr(control, "RESULTS", tmp_path)
  out = {"config": "configs/default.py", "steps": 4, "seed": 0, "tag": "t", "extra": [], "methods": {
      "uniform": _method(4, 100.0, 1000.0, 0.5),
      # 4 steps of 100 after 200 pre-sampled rollouts: 600 spent in all, uniform's 400 is the equal budget.
      "pvpo": _method(4, 100.0, 1000.0, 0.6, presample_rollouts=200.0, presample_tokens=2000.0)}}
  out["methods"]["pvpo"]["evals"] = [(0, 0.4), (1, 0.45), (3, 0.55)]   # its steps spend 1000 tokens each
  control.real_report(out)
  md = (tmp_path / "control_real_t.md").read_text()
  assert "Equal rollouts = 400" in md and "equal generated tokens = 4000" in md
  rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
  assert "| 600 |" in rows["pvpo"] and "| 400 |" in rows["uniform"]   # total rollouts, pre-sampling counted
  doc = json.loads((tmp_path / "control_real_t.json").read_text())
  assert doc["methods"]["pvpo"]["at_equal_rollouts"]["steps"] == 2        # 200 + 2 x 100 = 400
  assert doc["methods"]["uniform"]["at_equal_rollouts"]["steps"] == 4
  # The evaluation nearest the equal tokens (4000): uniform's final one (4000, 100%). PVPO's evaluations spent
  # 2000 (step 0: its pre-sampling), 3000 (1), 5000 (3) and 6000 (4, final): steps 1 and 3 are 1000 away, the
  # earlier is taken.
  assert "0.500 (4, 100%)" in rows["uniform"] and "0.450 (1, 75%)" in rows["pvpo"]
  assert "200 rollouts (2000 tokens) pre-sampled" in md


def test_every_real_loop_recipe_is_a_valid_config():
  for method, flags in control.REAL_METHODS.items():
    cfg = config_lib.load_config_file("configs/default.py")
    for flag in flags:
      key, value = flag.removeprefix("--config.").split("=", 1)
      section, name = key.split(".")
      field = cfg[section][name]
      cfg[section][name] = type(field)(value == "True") if isinstance(field, bool) else type(field)(value)
    config_lib.from_config_dict(cfg)   # validates (PVPO: its reference samples are set), method by method
