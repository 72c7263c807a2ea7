"""The fault drill (issue 18): a smoke run killed with SIGKILL at random moments and resumed ends
bit for bit where an uninterrupted run ends."""
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path):
  out = subprocess.run([sys.executable, "-m", "experiments.studies.fault_drill", "--kills=2", "--steps=3",
                        "--seed=1", f"--root={tmp_path}"], capture_output=True, text=True, timeout=3600, cwd=REPO)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  survived, tried = map(int, re.search(r"kills survived / kills tried: (\d+)/(\d+)", out.stdout).groups())
  assert tried >= 1 and survived == tried
  assert "final state equal to the uninterrupted run: yes" in out.stdout
