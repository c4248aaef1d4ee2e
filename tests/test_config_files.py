"""Config files by name or by path, from any folder and from an installed (non-editable) wheel;
a wrong name or switch is one line naming the known ones, status 2."""
import json
import shutil
import subprocess
import sys

import pytest

from simplified_flax import config_files
from test_loop import REPO, TINY, subprocess_env, write_corpus

RUN = {**TINY, "num_train_steps": 20, "log_every_steps": 5, "checkpoint_every_steps": 10,
       "eval_every_steps": 10}


def test_a_config_loads_by_name_file_name_or_repository_path_from_another_folder(
    tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  by_name = config_files.load("sas_p:cpu")
  assert by_name.model.parallel_layers and by_name.num_train_steps < 40_000
  for spec in ("sas_p.py:cpu", "configs/sas_p.py:cpu", f"{REPO}/configs/sas_p.py:cpu"):
    assert config_files.load(spec).to_dict() == by_name.to_dict(), spec


def test_a_users_own_file_loads_by_path_with_relative_or_package_imports(tmp_path, monkeypatch):
  copy = (REPO / "configs" / "sas_p.py").read_text() + (
      "\n\n_shipped = get_config\n\n\ndef get_config(arg=''):\n"
      "  c = _shipped(arg)\n  c.batch_size = 7\n  return c\n")
  (tmp_path / "mine.py").write_text(copy)                 # keeps `from . import sas`
  (tmp_path / "own.py").write_text("from simplified_flax.configs import base\n\n\n"
                                   "def get_config(arg=''):\n  c = base.get_config(arg)\n"
                                   "  c.seed = 3\n  return c\n")
  monkeypatch.chdir(tmp_path)
  mine = config_files.load("mine.py:cpu")
  assert mine.batch_size == 7 and mine.model.parallel_layers
  assert config_files.load(str(tmp_path / "own.py")).seed == 3
  assert config_files.load("sas_p:cpu").batch_size != 7   # the shipped file is untouched


@pytest.mark.parametrize("spec, says", [
    ("sasp:cpu", "No config file 'sasp': did you mean 'sas_p'?"),
    ("configs/missing.py", "No config file 'configs/missing.py'"),
    ("sas_p:gpu", "Unknown config switch 'gpu' in 'sas_p:gpu'"),
])
def test_a_wrong_name_or_switch_names_the_known_configs_and_switches(spec, says):
  with pytest.raises(config_files.ConfigSpecError) as error:
    config_files.load(spec)
  text = str(error.value)
  assert says in text and "\n" not in text
  assert "known configs: base, bert_parallel, " in text and ", sas_p, " in text
  assert "switches after ':' (comma-separated): cpu, encoder" in text


def _cli(module, args, cwd, env):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


def _train_20_steps(cwd, workdir, env, data):
  args = ["--config=sas_p:cpu", f"--workdir={workdir}", "--notensorboard",
          *[f"--config.{k}={v}" for k, v in {**RUN, **data}.items()]]
  done = _cli("simplified_flax.train", args, cwd, env)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def test_a_20_step_run_by_config_name_from_another_folder(tmp_path):
  """Also: `evaluate --step` reads that checkpoint (its loss is the one training logged
  there) without Orbax's read-only warnings."""
  data = write_corpus(tmp_path / "corpus")
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = subprocess_env()
  _train_20_steps(elsewhere, "run", env, data)
  rows = [json.loads(l) for l in (elsewhere / "run" / "metrics.jsonl").read_text().splitlines()]
  logged = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
  assert sorted(logged) == [10, 20]
  done = _cli("simplified_flax.evaluate", ["--workdir=run", "--step=10"], elsewhere, env)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["step"] == 10
  assert result["eval_loss"] == pytest.approx(logged[10], rel=1e-6)
  assert "read only" not in done.stderr and "read_only" not in done.stderr, done.stderr


@pytest.mark.slow
def test_an_installed_wheel_has_no_top_level_configs_and_trains_by_name(tmp_path):
  source = tmp_path / "source"
  source.mkdir()
  for name in ("configs", "simplified_flax"):
    shutil.copytree(REPO / name, source / name,
                    ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(REPO / name, source / name)
  target = tmp_path / "site"
  built = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=300)
  assert built.returncode == 0, built.stderr[-3000:]
  assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == [
      "simplified_flax"]
  assert (target / "simplified_flax" / "configs" / "sas_p.py").is_file()
  env = dict(subprocess_env(), PYTHONPATH=str(target))    # the wheel, not the repository
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  wrong = _cli("simplified_flax.train", ["--config=sasp:cpu", "--workdir=w"], elsewhere, env)
  assert wrong.returncode == 2
  lines = wrong.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "simplified_flax.train: error: flag --config=sasp:cpu: No config file 'sasp'"), lines
  assert not (elsewhere / "w").exists()
  done = _train_20_steps(elsewhere, "w", env, write_corpus(tmp_path / "corpus"))
  assert "step 20/20" in done.stdout
  where = subprocess.run([sys.executable, "-c", "import simplified_flax.configs as c; "
                          "print(c.__file__)"], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=120)
  assert where.stdout.strip() == str(target / "simplified_flax" / "configs" / "__init__.py")
