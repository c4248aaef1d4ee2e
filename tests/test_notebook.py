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
