"""A way back from divergence: a sparse checkpoint trail, the non-finite error naming the kept
steps and the command, and `restore_step` setting later steps aside (docs/resuming.md,
"A way back from divergence")."""
import collections
import os

import jax.numpy as jnp
import numpy as np
import pytest

from simplified_flax.runs.config_checks import ConfigError
from simplified_flax.runs import checkpoints
from simplified_flax.runs import metrics_io
from simplified_flax.runs import resume
from simplified_flax.train import NonFiniteLossError, train_and_evaluate
from test_loop import TINY, make_config, train_rows, write_corpus


def _tensorboard_steps(workdir) -> collections.Counter:
  """How often each (tag, step) appears in the run's TensorBoard, read as TensorBoard's
  Scalars and Text tabs read it."""
  # pylint: disable-next=import-outside-toplevel
  from tensorboard.backend.event_processing import plugin_event_accumulator
  events = plugin_event_accumulator.EventAccumulator(
      os.path.join(workdir, "tensorboard"), size_guidance={"tensors": 0})
  events.Reload()
  return collections.Counter((tag, e.step) for tag in events.Tags()["tensors"]
                             for e in events.Tensors(tag))


def test_the_trail_keeps_every_kth_step_beside_the_latest(tmp_path):
  manager = checkpoints.make_manager(str(tmp_path), max_to_keep=2, save_interval_steps=1,
                                     async_save=False, keep_every_steps=4)
  for step in range(1, 11):
    checkpoints.save(manager, step, {"w": jnp.full((3,), step, jnp.float32)}, {}, {}, {})
  manager.wait_until_finished()
  assert sorted(manager.all_steps()) == [4, 8, 9, 10]
  manager.close()


@pytest.mark.slow
def test_diverge_then_rewind_with_a_lower_learning_rate_and_train_to_the_end(tmp_path):
  steps = 12
  base = {**TINY, **write_corpus(tmp_path), "num_train_steps": steps,
          "checkpoint_every_steps": 1, "max_to_keep": 1, "keep_every_steps": 4,
          "optimizer.warmup_steps": 0}
  workdir = tmp_path / "run"
  train = lambda **o: train_and_evaluate(make_config({**base, **o}, "sas_p_nonorm"),
                                         str(workdir), tensorboard=True)
  train(num_train_steps=4)                             # healthy: the trail keeps step 4
  with pytest.raises(NonFiniteLossError) as err:
    train(**{"optimizer.learning_rate": 1e4})          # blows up after step 4
  kept = sorted(int(s) for s in os.listdir(workdir / "checkpoints"))
  assert kept[0] == 4 and len(kept) == 2, kept
  message = str(err.value)
  assert f"Kept checkpoint steps in {workdir}: {kept}" in message
  assert "--config.restore_step=4 --config.optimizer.learning_rate=<lower>" in message

  with pytest.raises(ConfigError, match=rf"restore_step=3 is not a kept .* {kept}"):
    train(restore_step=3)
  assert sorted(int(s) for s in os.listdir(workdir / "checkpoints")) == kept   # untouched

  train(restore_step=4)                                # the sane learning rate
  rows = train_rows(workdir)
  assert sorted(rows) == list(range(1, steps + 1))
  assert all(np.isfinite(rows[s]["loss"]) for s in rows)
  aside = os.listdir(workdir / resume.SET_ASIDE_DIR)
  assert len(aside) == 1 and aside[0].startswith("after_step_4_")
  aside = workdir / resume.SET_ASIDE_DIR / aside[0]
  assert sorted(int(s) for s in os.listdir(aside / "checkpoints")) == kept[1:]
  assert [r["step"] for r in metrics_io.read_history(str(aside / metrics_io.METRICS_FILE))
          if "loss" in r] == list(range(5, kept[-1] + 1))
  assert os.listdir(aside / "tensorboard")          # the diverged run stays viewable there
  counts = _tensorboard_steps(workdir)
  assert {s for (tag, s) in counts if tag == "train/loss"} == set(range(1, steps + 1))
  assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]

  train(restore_step=4)          # the same command again: the rewind is not repeated
  assert len(os.listdir(workdir / resume.SET_ASIDE_DIR)) == 1
  assert sorted(train_rows(workdir)) == list(range(1, steps + 1))
