"""The quickstart notebook runs top to bottom on a runtime without the project, as on Colab.

The slow test makes a fresh virtual environment whose interpreter has never seen rollouts_jax,
runs the notebook's kernel in it, and lets the notebook's first cell pip-install the project,
as a fresh Colab runtime does. Colab comes with jax, numpy, matplotlib, torch and the like
preinstalled; here the new environment sees this environment's packages instead (the venv is
created with `--system-site-packages`, plus a `.pth` line naming this environment's
site-packages, since `--system-site-packages` from inside a venv only reaches the base
interpreter's). Nothing is downloaded: pip runs with `PIP_NO_INDEX=1` and without build
isolation, so every requirement must already be met, which a Colab runtime does through PyPI.

The notebook installs from `ROLLOUTS_JAX_SRC` (set here to a copy of this checkout: its tracked
and untracked-but-not-ignored files, like a fresh clone with the local changes) instead of
cloning `REPO_URL`, and runs in smoke mode (`QUICKSTART_SMOKE=1`).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "colab" / "quickstart.ipynb"


def _code(nb) -> list[str]:
  return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebook_install_cell_uses_the_repository_and_no_folder_search():
  nb = json.loads(NOTEBOOK.read_text())
  install = _code(nb)[0]
  assert "REPO_URL" in install and "ROLLOUTS_JAX_SRC" in install and "pip\", \"install\"" in install
  assert "git\", \"clone\"" in install
  code = "\n".join(_code(nb))
  assert "while " not in code and ".parent" not in code  # no search over parent folders
  assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")  # stored clean


def _copy_checkout(dst: pathlib.Path) -> None:
  """Tracked files and untracked files that git does not ignore (what a clone plus local edits has)."""
  files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout.decode().split("\0")
  for name in filter(None, files):
    src = REPO / name
    if src.is_file():  # skips files deleted in the work tree
      (dst / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, dst / name)


_RUNNER = textwrap.dedent("""
    import sys, nbformat, nbclient
    nb = nbformat.read(sys.argv[1], as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": sys.argv[2]}}).execute()
    nbformat.write(nb, sys.argv[3])
""")


@pytest.mark.slow
def test_quickstart_notebook_executes_in_a_fresh_venv(tmp_path):
  pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  venv = tmp_path / "runtime"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
  python = venv / "bin" / "python"
  site = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
  host = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  (site / "_preinstalled.pth").write_text("".join(p + "\n" for p in sorted(host)))
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PIP_NO_INDEX="1",
             PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1", JAX_PLATFORMS="cpu")
  # The runtime starts without the project: the notebook's own install cell must provide it.
  probe = subprocess.run([str(python), "-c", "import rollouts_jax"], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
  assert probe.returncode != 0 and "No module named 'rollouts_jax'" in probe.stderr, probe.stderr
  src = tmp_path / "checkout"
  _copy_checkout(src)
  cwd = tmp_path / "content"  # Colab's working folder: nothing of the project in it
  cwd.mkdir()
  env.update(ROLLOUTS_JAX_SRC=str(src), QUICKSTART_SMOKE="1", QUICKSTART_WORKDIR=str(tmp_path / "run"),
             ROLLOUTS_JAX_CACHE=str(tmp_path / "cache"))
  out_nb = tmp_path / "executed.ipynb"
  proc = subprocess.run([str(python), "-c", _RUNNER, str(NOTEBOOK), str(cwd), str(out_nb)], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  nb = json.loads(out_nb.read_text())
  outputs = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                    for o in c.get("outputs", []))
  # The kernel imported the freshly installed package, not this checkout.
  package_line = next(line for line in outputs.splitlines() if line.startswith("package:"))
  assert str(site) in package_line and str(REPO) not in package_line, package_line
  assert "before" in outputs and "after" in outputs and "reward.png" in outputs and "eval.png" in outputs
  assert (tmp_path / "run" / "metrics.jsonl").exists() and any((tmp_path / "run" / "tb").iterdir())
