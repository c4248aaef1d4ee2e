"""experiments/colab.ipynb runs top to bottom at tiny settings (so it cannot rot), and its
install cell, on a runtime with an older stack already installed, keeps that runtime's jax,
jaxlib and libtpu, installs only what is missing or too old, and prints no conflict."""
import glob
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import nbformat
import pytest
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "experiments" / "colab.ipynb"
TINY = {"NB_STEPS": "4", "NB_N_LAYER": "2", "NB_N_EMBD": "32", "NB_N_HEAD": "2",
        "NB_CONTEXT": "32", "NB_BATCH": "4", "NB_EVAL_BATCHES": "1", "NB_SAMPLE_TOKENS": "4",
        "NB_LOG_EVERY": "1", "NB_TENSORBOARD": "0"}


def _install_cell() -> str:
  return nbformat.read(NOTEBOOK, as_version=4).cells[1].source


@pytest.mark.slow
def test_colab_notebook_runs_at_tiny_settings(tmp_path, monkeypatch):
  for key, value in TINY.items():
    monkeypatch.setenv(key, value)          # the kernel inherits this environment
  monkeypatch.setenv("NB_WORKDIR", str(tmp_path / "runs"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for o in cell.get("outputs", []))
  for variant in ("sas_p", "preln"):                 # live progress: a line per logged step
    section = outputs.split(f"--- training {variant}")[1]
    assert all(f"step {s}/4 | loss" in section for s in range(1, 5)), section[:2000]
    assert glob.glob(str(tmp_path / "runs" / variant / "tensorboard" / "events.out.*"))
  assert "--- sas_p\n" in outputs and "--- preln\n" in outputs
  images = [o for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert len(images) == 2                   # the loss curves and the gains
  # The CLI cell resumes SAS-P's run from its workdir and trains it on to step 8.
  assert "Resuming from the checkpoint of step 4." in outputs
  assert "Learning-rate schedule changed on resume (num_train_steps 4 -> 8)" in outputs
  assert "step 8/8 | loss" in outputs
  assert (tmp_path / "runs" / "preln" / "checkpoints" / "4").is_dir()
  assert (tmp_path / "runs" / "sas_p" / "checkpoints" / "8").is_dir()
  evaluated = [json.loads(l) for l in outputs.splitlines() if l.startswith('{"step"')]
  assert [r["step"] for r in evaluated] == [8]


def test_install_cell_without_a_source_says_how_to_provide_one(tmp_path, monkeypatch):
  """Off a checkout, with the package missing and no source named, the first cell stops with
  the fix rather than guessing an address."""
  install_cell = _install_cell()
  assert 'REPO_URL = ""' in install_cell
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("NB_SOURCE", raising=False)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match="set REPO_URL .* or SOURCE .* on Drive"):
    exec(compile(install_cell, "install_cell", "exec"), {})


# ------------------------------------------------------------------------------------------
# A simulated runtime: a venv whose "preinstalled" packages are small stand-in wheels with the
# versions and requirements of an older stack, and a local folder of wheels as the index.
# ------------------------------------------------------------------------------------------
RUNTIME = {   # name: (version, requirements), as a Colab image might have them
    "jax": ("0.8.3", ["jaxlib==0.8.3", "numpy>=2.0"]), "jaxlib": ("0.8.3", ["numpy>=2.0"]),
    "libtpu": ("0.0.20", []), "numpy": ("2.0.2", []), "scipy": ("1.13.0", []),
    "flax": ("0.12.0", ["jax>=0.7.1"]),
    "optax": ("0.2.5", ["jax>=0.4.27"]),              # older than simplified_flax needs
    "etils": ("1.7.0", []), "tensorboard": ("2.18.0", []), "sentencepiece": ("0.2.0", []),
    "absl-py": ("2.1.0", []),
}                                                      # orbax and ml-collections: missing
INDEX = [   # what pip may choose from: newer jax releases that must not be taken among them
    ("jax", "0.10.2", ["jaxlib==0.10.2"]), ("jaxlib", "0.10.2", []),
    ("flax", "0.12.8", ["jax>=0.8.1"]),
    ("optax", "0.2.6", ["jax>=0.5.3"]), ("optax", "0.2.8", ["jax>=0.9.0"]),
    ("orbax-checkpoint", "0.11.30", ["jax>=0.6.0", "absl-py"]),
    ("orbax-checkpoint", "0.12.8", ["jax>=0.9.0", "absl-py"]),
    ("ml-collections", "1.1.0", ["absl-py"]), ("tensorboardX", "2.6.5", []),
]


def _wheel(folder: pathlib.Path, name: str, version: str, requires, files=None,
           extras=()) -> pathlib.Path:
  """A minimal valid wheel: `files` {path in the wheel: bytes} plus its dist-info."""
  stem = f"{name.replace('-', '_')}-{version}"
  files = dict(files or {f"{name.replace('-', '_')}_stub/__init__.py": b""})
  info = f"{stem}.dist-info"
  files[f"{info}/METADATA"] = "".join(
      [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
      + [f"Provides-Extra: {e}\n" for e in extras]
      + [f"Requires-Dist: {r}\n" for r in requires]).encode()
  files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                            b"Tag: py3-none-any\n")
  record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
  path = folder / f"{stem}-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as archive:
    for member, data in files.items():
      archive.writestr(member, data)
    archive.writestr(f"{info}/RECORD", record)
  return path


def _package_wheel(folder: pathlib.Path) -> pathlib.Path:
  """This repository as the wheel a user uploads: the package, configs/ inside it, and the
  requirements of pyproject.toml (runtime and extras)."""
  project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
  requires = list(project["dependencies"]) + [
      f"{r}; extra == '{extra}'" for extra, rs in project["optional-dependencies"].items()
      for r in rs]
  files = {}
  for top, inside in (("simplified_flax", "simplified_flax"), ("configs",
                                                               "simplified_flax/configs")):
    for path in (REPO / top).rglob("*.py"):
      files[f"{inside}/{path.relative_to(REPO / top)}"] = path.read_bytes()
  return _wheel(folder, "simplified_flax", project["version"], requires, files,
                extras=project["optional-dependencies"])


def _versions(python: str, env: dict) -> dict[str, str]:
  code = ("import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: "
          "d.version for d in m.distributions()}))")
  out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout
  return {k.lower().replace("_", "-"): v for k, v in json.loads(out).items()}


@pytest.mark.slow
def test_install_cell_keeps_an_older_runtimes_jax_and_adds_only_what_is_missing_or_old(
    tmp_path):
  index, preinstalled = tmp_path / "index", tmp_path / "preinstalled"
  index.mkdir()
  preinstalled.mkdir()
  for name, version, requires in INDEX:
    _wheel(index, name, version, requires)
  stand_ins = [_wheel(preinstalled, name, version, requires,
                      extras=("epath", "epy") if name == "etils" else ())
               for name, (version, requires) in RUNTIME.items()]
  upload = _package_wheel(tmp_path)
  # A venv of its own (not over this interpreter's packages, which may be another venv's).
  subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "runtime")], check=True)
  python = str(tmp_path / "runtime" / "bin" / "python")
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
  env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index), PIP_CONFIG_FILE=os.devnull,
             PIP_DISABLE_PIP_VERSION_CHECK="1", NB_SOURCE=str(upload))
  subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", *map(str, stand_ins)],
                 env=env, check=True)
  before = _versions(python, env)
  (tmp_path / "install_cell.py").write_text(_install_cell())

  cell = subprocess.run([python, "install_cell.py"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  printed = cell.stdout + cell.stderr
  assert cell.returncode == 0, printed[-3000:]
  after = _versions(python, env)
  for name in ("jax", "jaxlib", "libtpu", "flax", "etils", "numpy"):
    assert after[name] == before[name], name          # kept, though newer ones were offered
  assert (after["optax"], after["orbax-checkpoint"], after["ml-collections"]) == (
      "0.2.6", "0.11.30", "1.1.0")                     # too old / missing: the newest that fit
  assert after["simplified-flax"] == "0.1.0"
  assert "jax stays: jax==0.8.3, jaxlib==0.8.3, libtpu==0.0.20" in cell.stdout
  assert "installed: optax>=0.2.6, orbax-checkpoint>=0.11.30, ml-collections>=1.1.0" in (
      cell.stdout)
  for word in ("conflict", "ERROR", "incompatible", "Warning"):
    assert word not in printed, printed

  again = subprocess.run([python, "install_cell.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and "installed: nothing else" in again.stdout, again.stderr
  assert _versions(python, env) == after
  check = subprocess.run([python, "-m", "pip", "check"], env=env, capture_output=True,
                         text=True)
  assert check.returncode == 0, check.stdout
