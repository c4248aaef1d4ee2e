"""Exact resume through the command line: a run killed (SIGKILL) or stopped (SIGTERM) and
resumed matches a straight run step for step, to the last bit of the final parameters."""
import os
import random
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from test_loop import (TINY, kill_and_resume, log_tail, start_training, subprocess_env,
                             train_rows, wait_for_rows, write_corpus)

pytestmark = pytest.mark.slow

STEPS = 40
# Big enough that a step takes milliseconds, so a signal lands mid-run.
RUN = {**TINY, "model.n_embd": 128, "model.context_length": 64, "batch_size": 16,
       "num_train_steps": STEPS, "checkpoint_every_steps": 10, "eval_every_steps": STEPS,
       "eval_steps": 2}


def _final_state(workdir):
  path = os.path.join(workdir, "checkpoints", str(STEPS), "state")
  return ocp.StandardCheckpointer().restore(path)


def _assert_same_run(resumed, straight):
  a, b = train_rows(resumed), train_rows(straight)
  assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
  for step in b:
    for key in ("loss", "learning_rate", "grad_norm"):
      assert a[step][key] == b[step][key], (resumed, step, key, a[step][key], b[step][key])
  leaves_a = jax.tree_util.tree_leaves_with_path(_final_state(resumed))
  leaves_b = jax.tree_util.tree_leaves_with_path(_final_state(straight))
  assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


def test_resume_after_sigkill_or_sigterm_is_exact(tmp_path):
  # One test: the straight run is shared, and xdist would repeat a fixture per worker.
  overrides = {**RUN, **write_corpus(tmp_path)}
  env = subprocess_env(cache_dir=str(tmp_path / "jax_cache"))   # later runs skip compiling
  straight = tmp_path / "straight"
  assert start_training(straight, overrides, env).wait(timeout=600) == 0, log_tail(straight)

  # SIGKILL mid-run (after the step-20 checkpoint started), then resume.
  killed = tmp_path / "killed"
  kill_and_resume(killed, overrides, env, after_rows=25, steps=STEPS)
  _assert_same_run(killed, straight)

  # SIGTERM at a random step: saves at the next step, exits 0, then resume.
  terminated = tmp_path / "terminated"
  stop_after = random.randint(3, 30)
  proc = start_training(terminated, overrides, env)
  wait_for_rows(terminated, proc, stop_after)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 0, log_tail(terminated)     # a clean exit
  saved = sorted(int(s) for s in os.listdir(terminated / "checkpoints"))
  assert stop_after <= saved[-1] < STEPS, (stop_after, saved)
  assert f"saved the checkpoint of step {saved[-1]}" in log_tail(terminated)
  assert start_training(terminated, overrides, env).wait(timeout=600) == 0, log_tail(terminated)
  _assert_same_run(terminated, straight)
