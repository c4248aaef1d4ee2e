"""User errors end a command with one line on stderr and status 2 (usage) or 1 (other), no
traceback; bugs keep theirs; SIGTERM in start-up exits 0 (docs/errors.md)."""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from simplified_flax import cli
from simplified_flax.data.errors import DataError
from simplified_flax.runs.config_checks import ConfigError
from simplified_flax.runs import checkpoints
from simplified_flax.runs import compatibility
from simplified_flax.runs.nonfinite import NonFiniteLossError
from simplified_flax.runs.workdir_lock import WorkdirLockedError
from test_loop import REPO, subprocess_env


def _train(workdir, *args):
  """The train command, run to the end: (status, stderr lines, seconds). The lines leave out
  the data preparation's progress, which the run that first prepares the default corpus
  prints (whichever test that is in its worker)."""
  start = time.time()
  proc = subprocess.run([sys.executable, "-m", "simplified_flax.train",
                         "--config=configs/preln.py:cpu", f"--workdir={workdir}", *args],
                        cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                        timeout=300)
  lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("prepare ")]
  return proc.returncode, lines, time.time() - start


def test_user_errors_map_to_statuses_and_bugs_to_none():
  assert cli.exit_status(ConfigError("model.n_layer=-1 ...")) == cli.USAGE_ERROR
  for error in (DataError("data.paths: ..."), WorkdirLockedError("in use"),
                compatibility.IncompatibleCheckpointError("shapes"),
                checkpoints.WorkdirError("no dir"), NonFiniteLossError("nan")):
    assert cli.exit_status(error) == cli.OTHER_ERROR, error
  assert cli.exit_status(ZeroDivisionError("a bug")) is None
  assert cli.exit_status(FileNotFoundError("not the user's")) is None


def test_a_full_disk_anywhere_in_the_chain_is_one_line():
  try:
    try:
      raise OSError(errno.ENOSPC, "No space left on device", "/w/checkpoints/7/state")
    except OSError as inner:
      raise RuntimeError("Orbax async save failed") from inner
  except RuntimeError as outer:
    error = outer
  assert cli.exit_status(error) == cli.OTHER_ERROR
  line = cli.one_line(error)
  assert "No space left on device writing /w/checkpoints/7/state" in line
  assert "rerun the same command" in line and "\n" not in line
  # Orbax sometimes keeps only the text of the OSError.
  assert cli.is_disk_full(ValueError("write failed: [Errno 28] No space left on device"))


@pytest.mark.slow
def test_a_mistyped_override_gets_one_line_with_the_suggestion(tmp_path):
  status, lines, _ = _train(tmp_path / "run", "--config.model.n_layr=2")
  assert status == cli.USAGE_ERROR, lines
  assert lines[-1] == ("simplified_flax.train: error: --config.model.n_layr: the config has no "
                       "field 'model.n_layr'; did you mean --config.model.n_layer? "
                       "(--verbose shows the traceback)"), lines
  assert not any("Traceback" in line for line in lines)
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_bad_value_fails_at_once_before_a_tokenizer_is_trained(tmp_path):
  status, lines, _ = _train(tmp_path / "run", "--config.model.n_layer=-1",
                            "--config.data.tokenizer=sentencepiece")
  assert status == cli.USAGE_ERROR, lines
  assert lines[-1].startswith("simplified_flax.train: error: model.n_layer=-1 must be"), lines
  assert not any("Traceback" in line for line in lines)
  assert not (tmp_path / "run").exists()
  status, lines, _ = _train(tmp_path / "run", "--config.batch_size=0", "--verbose")
  assert status == cli.USAGE_ERROR and any("Traceback" in line for line in lines), lines


@pytest.mark.slow
def test_sigterm_during_start_up_exits_0_with_a_message(tmp_path):
  proc = subprocess.Popen([sys.executable, "-m", "simplified_flax.train",
                           "--config=configs/preln.py:cpu", f"--workdir={tmp_path / 'run'}"],
                          cwd=REPO, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
  time.sleep(3.0)   # past the handler (the first import), long before the first step
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 0, stderr[-3000:]
  assert "Stopped by SIGTERM outside the training loop" in stderr
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_evaluate_on_a_folder_that_is_no_run_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "simplified_flax.evaluate",
                         f"--workdir={tmp_path / 'missing'}"], cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == cli.OTHER_ERROR and len(lines) == 1, lines[-20:]
  assert "config.json does not exist" in lines[0] and "--workdir of a training run" in lines[0]

def test_an_unprepared_tfds_dataset_without_network_fails_before_tfds_is_asked(tmp_path,
                                                                             monkeypatch):
  from simplified_flax.runs import data_preflight  # pylint: disable=import-outside-toplevel
  import configs  # pylint: disable=import-outside-toplevel
  data = configs.load("preln:cpu", {"data.name": "lm1b",
                                    "data.tfds_data_dir": str(tmp_path / "tfds")}).data
  monkeypatch.setattr(data_preflight, "network_reachable", lambda *a, **k: False)
  with pytest.raises(DataError, match=r"'lm1b' is not prepared in .*`tfds build lm1b"):
    data_preflight.check_tfds_available(data)
  (tmp_path / "tfds" / "lm1b" / "1.1.0").mkdir(parents=True)
  (tmp_path / "tfds" / "lm1b" / "1.1.0" / "dataset_info.json").write_text("{}")
  data_preflight.check_tfds_available(data)      # prepared: tfds reads it, no network needed
  assert not list((tmp_path / "tfds").glob("**/*.tmp"))


def test_the_train_command_on_an_unprepared_tfds_dataset_without_network_ends_within_10_s(
    tmp_path):
  from simplified_flax.runs import data_preflight  # pylint: disable=import-outside-toplevel
  if data_preflight.network_reachable():
    pytest.skip("this machine can reach the tfds download host")
  status, lines, secs = _train(tmp_path / "run", "--config.data.name=lm1b",
                               f"--config.data.tfds_data_dir={tmp_path / 'tfds'}")
  assert status == 1 and len(lines) == 1 and "is not prepared in" in lines[0], lines[-20:]
  assert secs <= 10, secs     # the whole command, start-up included (tfds alone retried 215 s)
  assert not (tmp_path / "run").exists()


def test_a_real_full_disk_is_one_line_and_the_run_resumes_once_space_is_freed(tmp_path):
  """An 8 MiB tmpfs (mounting needs root, as CI runs; skipped elsewhere) holds the checkpoint of
  step 10 but not that of step 20: Orbax's background writes fail and tensorstore reports on
  closed event loops, yet stderr holds one line; grown to 64 MiB ("space freed"), the same
  command resumes from step 10 and finishes."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                    capture_output=True, check=False).returncode != 0:
    pytest.skip("mounting a small tmpfs needs root")
  args = ("--config.model.n_layer=2", "--config.model.n_embd=128", "--config.model.n_head=2",
          "--config.num_train_steps=40", "--config.checkpoint_every_steps=10",
          "--config.eval_every_steps=0")
  try:
    status, lines, _ = _train(disk / "run", *args)
    assert status == 1 and len(lines) == 1, lines[-40:]
    assert "No space left on device" in lines[0] and "Free space" in lines[0]
    assert (disk / "run" / "checkpoints" / "10").is_dir()
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    status, lines, _ = _train(disk / "run", *args)
    assert status == 0, lines[-40:]
    assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())[-1] == "40"
  finally:
    subprocess.run(["umount", str(disk)], check=False)
