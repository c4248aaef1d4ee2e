"""Two processes x two CPU devices joined with jax.distributed (gloo collectives on 127.0.0.1)
train with the losses of one process on the same global batches; a SIGTERM to one of them
makes both save the same step together, and both resume from it."""
import os
import signal
import socket

import numpy as np
import pytest

from test_loop import (TINY, log_tail, make_config, start_training, subprocess_env,
                             train_rows, wait_for_rows, write_corpus)
from simplified_flax.train import train_and_evaluate

pytestmark = pytest.mark.slow

STEPS = 30


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_two_processes(workdir, overrides, env):
  address = f"127.0.0.1:{_free_port()}"
  return [start_training(workdir, overrides, env, extra_args=(
      f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}"))
          for i in range(2)]


def _wait(procs, workdir) -> list[int]:
  try:
    return [p.wait(timeout=600) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    assert all(p.returncode == 0 for p in procs), log_tail(workdir, 6000)


def test_two_processes_match_one_and_save_and_resume_together(tmp_path):
  overrides = {**TINY, **write_corpus(tmp_path), "num_train_steps": STEPS,
               "checkpoint_every_steps": STEPS}
  # One process, one device: the reference (it also prepares the corpus for the children).
  single = tmp_path / "single"
  train_and_evaluate(make_config(overrides), str(single), tensorboard=False)
  reference = train_rows(single)

  multi = tmp_path / "multi"
  env = subprocess_env(devices=2, cache_dir=str(tmp_path / "jax_cache"))
  procs = _start_two_processes(multi, overrides, env)
  wait_for_rows(multi, procs[0], 3)
  procs[1].send_signal(signal.SIGTERM)     # only process 1 is told; JAX syncs the stop step
  _wait(procs, multi)
  saved = [int(s) for s in os.listdir(multi / "checkpoints")]
  assert len(saved) == 1 and 3 <= saved[0] < STEPS, saved
  assert f"saved the checkpoint of step {saved[0]}" in log_tail(multi, 100_000)
  assert "on 4 devices" in log_tail(multi, 100_000)

  _wait(_start_two_processes(multi, overrides, env), multi)
  assert f"Resuming from the checkpoint of step {saved[0]}" in log_tail(multi, 100_000)
  rows = train_rows(multi)
  assert sorted(rows) == sorted(reference) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([rows[s]["loss"] for s in sorted(rows)],
                             [reference[s]["loss"] for s in sorted(reference)], atol=1e-5)


def test_two_processes_in_pmap_mode_match_one(tmp_path):
  """The maintained `pmap` mode across hosts: each process feeds its local devices' shards."""
  steps = 6
  overrides = {**TINY, **write_corpus(tmp_path), "num_train_steps": steps,
               "checkpoint_every_steps": steps}
  single = tmp_path / "single"
  train_and_evaluate(make_config(overrides), str(single), tensorboard=False)
  multi = tmp_path / "multi"
  env = subprocess_env(devices=2, cache_dir=str(tmp_path / "jax_cache"))
  _wait(_start_two_processes(multi, {**overrides, "parallel.mode": "pmap"}, env), multi)
  assert "on 4 devices (pmap)" in log_tail(multi, 100_000)
  rows, reference = train_rows(multi), train_rows(single)
  assert sorted(rows) == sorted(reference) == list(range(1, steps + 1))
  np.testing.assert_allclose([rows[s]["loss"] for s in sorted(rows)],
                             [reference[s]["loss"] for s in sorted(reference)], atol=1e-5)
  assert [int(s) for s in os.listdir(multi / "checkpoints")] == [steps]
