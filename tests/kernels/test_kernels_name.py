"""The project's kernels live at `rollouts_jax.kernels`, so a top-level `kernels` package (a PyPI
package of that name exists, and `transformers` imports it when installed) is importable beside
them, in either import order and with the repository root on `sys.path`, without either one
shadowing the other.

The PyPI package is simulated by a fake `kernels/__init__.py` in a temporary folder; each check
runs in a fresh interpreter so that no module cache from this process hides a clash.
"""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

_CHECK = textwrap.dedent("""
    import importlib, pathlib, sys
    order = sys.argv[1].split(",")
    mods = {name: importlib.import_module(name) for name in order}
    top, ours = mods["kernels"], mods["rollouts_jax.kernels.fp4"]
    # The top-level name is the other package, not a folder of this repository.
    assert getattr(top, "IS_THE_OTHER_KERNELS_PACKAGE", False), top.__file__
    assert pathlib.Path(top.__file__).resolve().parent.parent == pathlib.Path(sys.argv[2]).resolve(), top.__file__
    # Ours is the project's FP4 module, inside the rollouts_jax package.
    import rollouts_jax, rollouts_jax.kernels
    assert rollouts_jax.kernels is not top and ours is sys.modules["rollouts_jax.kernels.fp4"]
    pkg_dir = pathlib.Path(rollouts_jax.__file__).resolve().parent
    assert pathlib.Path(ours.__file__).resolve().is_relative_to(pkg_dir), ours.__file__
    assert sorted(ours.FORMATS) == ["mxfp4", "nvfp4"]
    # `from rollouts_jax.kernels import fp4` (the documented import) gives the same module.
    from rollouts_jax.kernels import fp4
    assert fp4 is ours and sys.modules["kernels"] is top
    print("OK", top.get_kernel("x"))
""")


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory):
  site = tmp_path_factory.mktemp("site")
  (site / "kernels").mkdir()
  (site / "kernels" / "__init__.py").write_text(
      '"""Stand-in for the PyPI package named kernels."""\n'
      "IS_THE_OTHER_KERNELS_PACKAGE = True\n\n\n"
      "def get_kernel(name):\n  return 'hub:' + name\n")
  return site


@pytest.mark.parametrize("order", ["kernels,rollouts_jax.kernels.fp4", "rollouts_jax.kernels.fp4,kernels"])
def test_top_level_kernels_package_and_ours_coexist(fake_site, order):
  # Run from the repository root, as a user of a checkout would: `python -c` puts the cwd first on
  # sys.path, ahead of the other package, so a top-level kernels/ folder here would shadow it.
  paths = [str(REPO), str(fake_site)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(paths))
  proc = subprocess.run([sys.executable, "-c", _CHECK, order, str(fake_site)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert proc.stdout.strip().splitlines()[-1] == "OK hub:x"
