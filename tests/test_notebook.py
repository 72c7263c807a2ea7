"""The quickstart notebook runs top to bottom (smoke settings), in the slow suite."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  monkeypatch.setenv("QUICKSTART_SMOKE", "1")
  monkeypatch.setenv("QUICKSTART_WORKDIR", str(tmp_path / "run"))
  monkeypatch.setenv("ROLLOUTS_JAX_CACHE", str(tmp_path / "cache"))
  nb = nbformat.read(REPO / "colab" / "quickstart.ipynb", as_version=4)
  nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                          resources={"metadata": {"path": str(REPO / "colab")}}).execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "before" in outputs and "after" in outputs and "reward.png" in outputs
  assert (tmp_path / "run" / "metrics.jsonl").exists()
