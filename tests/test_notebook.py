"""experiments/colab.ipynb runs top to bottom at tiny settings (so it cannot rot)."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "colab.ipynb"
TINY = {"NB_STEPS": "4", "NB_N_LAYER": "2", "NB_N_EMBD": "32", "NB_N_HEAD": "2",
        "NB_CONTEXT": "32", "NB_BATCH": "4", "NB_EVAL_BATCHES": "1", "NB_SAMPLE_TOKENS": "4"}


@pytest.mark.slow
def test_colab_notebook_runs_at_tiny_settings(monkeypatch):
  for key, value in TINY.items():
    monkeypatch.setenv(key, value)          # the kernel inherits this environment
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for o in cell.get("outputs", []))
  assert "sas_p: 4 steps" in outputs and "preln: 4 steps" in outputs
  assert "--- sas_p" in outputs and "--- preln" in outputs
  images = [o for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert len(images) == 2                   # the loss curves and the gains


def test_install_cell_without_a_repository_says_how_to_provide_one(tmp_path, monkeypatch):
  """Off a checkout, with the package missing and no REPO_URL, the first cell stops with the
  fix rather than cloning a made-up address."""
  import importlib.util
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  install_cell = notebook.cells[1].source
  assert 'REPO_URL = ""' in install_cell
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match="Set REPO_URL"):
    exec(compile(install_cell.replace("/content/simplified_flax", str(tmp_path / "absent")),
                 "install_cell", "exec"), {})


@pytest.mark.slow
def test_install_cell_leaves_the_runtimes_jax_as_it_is(tmp_path):
  """A runtime with jax already installed (a venv over this interpreter's packages, as Colab's
  jax/jaxlib/libtpu are): installing the package from an uploaded archive keeps its jax
  version and location, and makes `simplified_flax` importable. Offline: --no-index."""
  import os
  import shutil
  import subprocess
  import sys
  repo = NOTEBOOK.parents[1]
  upload = tmp_path / "upload" / "simplified_flax"
  for name in ("pyproject.toml", "README.md", "requirements.txt"):
    upload.mkdir(parents=True, exist_ok=True)
    shutil.copy(repo / name, upload / name)
  for package in ("simplified_flax", "configs"):
    shutil.copytree(repo / package, upload / package,
                    ignore=shutil.ignore_patterns("__pycache__"))
  archive = shutil.make_archive(str(tmp_path / "simplified_flax"), "zip", upload.parent)
  subprocess.run([sys.executable, "-m", "venv", "--system-site-packages",
                  str(tmp_path / "runtime")], check=True)
  python = str(tmp_path / "runtime" / "bin" / "python")
  probe = "import jax; print(jax.__version__, jax.__file__)"
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(NB_SOURCE=archive, PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
             PIP_DISABLE_PIP_VERSION_CHECK="1")
  before = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout
  (tmp_path / "install_cell.py").write_text(nbformat.read(NOTEBOOK, as_version=4).cells[1].source)
  cell = subprocess.run([python, "install_cell.py"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert cell.returncode == 0, cell.stderr[-3000:]
  assert "jax stays: jax==" in cell.stdout
  after = subprocess.run([python, "-c", probe + "; import simplified_flax as s; print(s.__file__)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
  assert after.stdout.splitlines()[0] == before.strip()              # same version, same place
  assert str(tmp_path / "runtime") in after.stdout.splitlines()[1]   # the package went in
