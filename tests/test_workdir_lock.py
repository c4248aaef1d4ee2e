"""One training run per workdir: a second run is refused naming the holder and touching
nothing; a dead holder's lock is taken over (docs/resuming.md, "One run per workdir")."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from simplified_flax.runs import workdir_lock
from simplified_flax.runs.workdir_lock import WorkdirLock, WorkdirLockedError
from test_loop import (REPO, TINY, log_tail, start_training, subprocess_env, train_rows,
                             wait_for_rows, write_corpus)


def _snapshot(directory):
  """Modification times by name, leaving out a heartbeat being written at that moment (its
  `.tmp-<pid>` file exists only until the atomic rename)."""
  return {p: os.path.getmtime(os.path.join(directory, p)) for p in sorted(os.listdir(directory))
          if ".tmp-" not in p}


def _write_holder(workdir, host, pid, started, heartbeat):
  (workdir / workdir_lock.LOCK_FILE).write_text(json.dumps(
      {"host": host, "pid": pid, "started": started, "token": "old"}))
  (workdir / workdir_lock.HEARTBEAT_FILE).write_text(json.dumps({"time": heartbeat}))


def test_a_second_lock_is_refused_naming_the_holder_and_touching_nothing(tmp_path):
  first = WorkdirLock(tmp_path, heartbeat_every_s=0.05)
  first.acquire()
  time.sleep(0.2)
  before = _snapshot(tmp_path)
  with pytest.raises(WorkdirLockedError) as err:
    WorkdirLock(tmp_path).acquire()
  message = str(err.value)
  assert f"host {socket.gethostname()}, pid {os.getpid()}, started" in message
  assert "\n" not in message
  first.release()
  assert sorted(os.listdir(tmp_path)) == []
  assert set(before) == {workdir_lock.LOCK_FILE, workdir_lock.HEARTBEAT_FILE}
  WorkdirLock(tmp_path).acquire()     # free again


def test_the_heartbeat_thread_keeps_the_lock_fresh(tmp_path):
  lock = WorkdirLock(tmp_path, heartbeat_every_s=0.05)
  lock.acquire()
  first = json.loads((tmp_path / workdir_lock.HEARTBEAT_FILE).read_text())["time"]
  time.sleep(0.3)
  assert json.loads((tmp_path / workdir_lock.HEARTBEAT_FILE).read_text())["time"] > first
  lock.release()


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path, capsys):
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  _write_holder(tmp_path, socket.gethostname(), int(gone.stdout), time.time(), time.time())
  lock = WorkdirLock(tmp_path)
  lock.acquire()
  assert f"pid {int(gone.stdout)} is gone" in capsys.readouterr().out
  assert json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
  lock.release()


def test_a_holder_on_another_host_is_dead_only_once_its_heartbeat_is_stale(tmp_path, capsys):
  _write_holder(tmp_path, "other-host", 1, time.time() - 100, time.time() - 1)
  with pytest.raises(WorkdirLockedError, match="host other-host, pid 1"):
    WorkdirLock(tmp_path, stale_after_s=30).acquire()
  _write_holder(tmp_path, "other-host", 1, time.time() - 100, time.time() - 31)
  lock = WorkdirLock(tmp_path, stale_after_s=30)
  lock.acquire()
  assert "heartbeat is 31 s old" in capsys.readouterr().out
  lock.release()


@pytest.mark.slow
def test_a_second_train_command_is_refused_and_the_first_run_loses_nothing(tmp_path):
  overrides = {**TINY, **write_corpus(tmp_path), "num_train_steps": 1_000_000,
               "checkpoint_every_steps": 10, "max_to_keep": 2}
  env = subprocess_env(cache_dir=str(tmp_path / "jax_cache"))
  workdir = tmp_path / "run"
  first = start_training(workdir, overrides, env)
  try:
    wait_for_rows(workdir, first, 12)
    second = subprocess.run(
        [sys.executable, "-m", "simplified_flax.train", f"--workdir={workdir}",
         "--config=configs/preln.py:cpu", *[f"--config.{k}={v}" for k, v in overrides.items()]],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 1, second.stderr[-3000:]
    last = second.stderr.strip().splitlines()[-1]
    assert "is in use by another training run (host" in last and f"pid {first.pid}" in last
    assert first.poll() is None, log_tail(workdir)      # the first run was not disturbed
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == 0, log_tail(workdir)
  finally:
    if first.poll() is None:
      first.kill()
  saved = sorted(int(s) for s in os.listdir(workdir / "checkpoints"))
  assert len(saved) == 2, saved                         # max_to_keep: no stray step
  assert sorted(train_rows(workdir)) == list(range(1, saved[-1] + 1))
  assert not (workdir / workdir_lock.LOCK_FILE).exists()
