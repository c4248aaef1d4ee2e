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
