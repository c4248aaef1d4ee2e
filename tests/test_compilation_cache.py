"""The persistent compilation cache of the train, evaluate and sample commands (docs/training.md,
"Compilation cache"): filled by a run, read by the next, off with "off", a bad folder is one
line and status 2."""
import os
import subprocess
import sys

import ml_collections
import pytest

from simplified_flax import cli
from simplified_flax.runs import compilation_cache
from simplified_flax.runs.config_checks import ConfigError
from test_loop import REPO, TINY, cli_args, subprocess_env, write_corpus

HIT = "Persistent compilation cache hit for 'jit_step_under_mesh'"   # the train step


def _env(cache_home, **extra) -> dict:
  """A child's environment whose default cache folder is under `cache_home` (JAX's own
  JAX_COMPILATION_CACHE_DIR, which would take its place, removed)."""
  env = dict(subprocess_env(), XDG_CACHE_HOME=str(cache_home), **extra)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def _command(module, *args, env):
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def _train(workdir, data, env, *extra):
  return _command("simplified_flax.train", f"--workdir={workdir}",
                  *cli_args({**TINY, **data, "num_train_steps": 2}), *extra, env=env)


def _entries(folder) -> set[str]:
  return set(os.listdir(folder)) if os.path.isdir(folder) else set()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  """A 2-step train command on an empty default cache: (workdir, data, cache home, entries)."""
  root = tmp_path_factory.mktemp("cache_run")
  data, home = write_corpus(root / "corpus"), root / "home"
  done = _train(root / "run", data, _env(home))
  assert done.returncode == 0, done.stderr[-3000:]
  return root / "run", data, home, _entries(home / "simplified_flax" / "jax")


@pytest.mark.slow
def test_a_train_command_fills_the_default_folder_and_the_next_one_reads_it(first_run, tmp_path):
  _, data, home, entries = first_run
  assert any(e.startswith("jit_step_under_mesh-") for e in entries), entries
  again = _train(tmp_path / "run", data, _env(home, JAX_LOG_COMPILES="1"))   # logs cache hits
  assert again.returncode == 0, again.stderr[-3000:]
  assert HIT in again.stderr, again.stderr[-3000:]
  assert _entries(home / "simplified_flax" / "jax") == entries   # nothing compiled anew


@pytest.mark.slow
def test_off_writes_nothing(first_run, tmp_path):
  _, data, _, _ = first_run
  done = _train(tmp_path / "run", data, _env(tmp_path / "home"),
                "--config.compilation_cache_dir=off")
  assert done.returncode == 0, done.stderr[-3000:]
  assert not (tmp_path / "home").exists()


@pytest.mark.slow
def test_evaluate_and_sample_use_the_folder_of_the_flag(first_run, tmp_path):
  workdir, _, home, _ = first_run
  env = _env(home, JAX_LOG_COMPILES="1")
  evaluated = _command("simplified_flax.evaluate", f"--workdir={workdir}",
                       f"--compilation_cache_dir={tmp_path / 'evaluate'}", env=env)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert _entries(tmp_path / "evaluate")
  for _ in range(2):   # the second sample command reads what the first stored
    sampled = _command("simplified_flax.sample", f"--workdir={workdir}", "--prompt=def ",
                       "--max_new_tokens=2", f"--compilation_cache_dir={tmp_path / 'sample'}",
                       env=env)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
  assert _entries(tmp_path / "sample")
  assert "Persistent compilation cache hit" in sampled.stderr


@pytest.mark.slow
def test_a_file_as_the_folder_is_one_line_and_status_2_before_any_work(tmp_path):
  (tmp_path / "a_file").write_text("")
  done = _train(tmp_path / "run", {}, _env(tmp_path / "home"),
                f"--config.compilation_cache_dir={tmp_path / 'a_file'}")
  lines = done.stderr.strip().splitlines()
  assert done.returncode == cli.USAGE_ERROR, lines
  assert len(lines) == 1 and "--config.compilation_cache_dir=" in lines[0], lines
  assert "is a file, not a folder" in lines[0] and "--compilation_cache_dir=off" in lines[0]
  assert not (tmp_path / "run").exists()


def test_the_flag_wins_over_the_config_field_and_unset_is_the_default(tmp_path, monkeypatch):
  config = ml_collections.ConfigDict({"compilation_cache_dir": "/from/config"})
  assert compilation_cache.choose("/from/flag", config) == ("/from/flag",
                                                            "--compilation_cache_dir")
  assert compilation_cache.choose(None, config)[0] == "/from/config"
  assert compilation_cache.choose(None)[0] is None   # evaluate and sample: not the run's
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.default_dir() == str(tmp_path / "simplified_flax" / "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert compilation_cache.default_dir() == os.path.expanduser("~/.cache/simplified_flax/jax")


def test_a_folder_that_cannot_be_used_names_the_field_and_the_fix(tmp_path):
  (tmp_path / "a_file").write_text("")
  for bad, why in ((tmp_path / "a_file", "is a file"),
                   (tmp_path / "a_file" / "below", "cannot be created"), ("  ", "is empty")):
    with pytest.raises(ConfigError, match=why) as error:
      compilation_cache._folder(str(bad), "--config.compilation_cache_dir")   # pylint: disable=protected-access
    assert "--config.compilation_cache_dir=" in str(error.value)
  made = compilation_cache._folder(str(tmp_path / "new"), "x")   # pylint: disable=protected-access
  assert made == str(tmp_path / "new") and os.path.isdir(made)
