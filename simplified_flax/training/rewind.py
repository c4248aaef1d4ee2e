"""Where a (re)started run begins, and a workdir's history cut back to that step.

`config.restore_step`:
    None  resume from the latest good checkpoint (the default);
    N     rewind to the kept checkpoint of step N: the later steps, their metrics.jsonl rows
          and TensorBoard events are moved to `<workdir>/set_aside/after_step_N_<time>/`,
          never deleted;
    0     start over: every checkpoint and the whole history are set aside the same way.

A rewind is done once: the checkpoints saved after it record the same restore_step, so
rerunning the same command later (after a preemption, say) resumes from the latest step
instead of rewinding again. Every resume also drops the TensorBoard events after the
restored step (a run that died wrote them), as metrics.jsonl drops its rows.
"""
import json
import os
import shutil
import time

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from simplified_flax.model.checks import ConfigError
from simplified_flax.training import metrics_io

SET_ASIDE_DIR = "set_aside"


def saved_restore_step(manager: ocp.CheckpointManager, step: int):
  """The restore_step recorded in the config of checkpoint `step` (None if unreadable)."""
  try:
    head = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return head["config"].get("restore_step")
  except Exception:  # pylint: disable=broad-except
    return None


def plan(manager: ocp.CheckpointManager, restore_step: int | None) -> tuple[int | None, list]:
  """(step to restore or None for the latest, steps to set aside) for `restore_step`.

  Raises ConfigError when `restore_step` names no kept checkpoint, listing the kept ones.
  """
  manager.reload()
  steps = sorted(manager.all_steps())
  if restore_step is None:
    return None, []
  if steps and saved_restore_step(manager, steps[-1]) == restore_step:
    logging.info("restore_step=%d was applied before; resuming from the latest step.",
                 restore_step)
    return None, []
  if restore_step == 0:
    return 0, steps
  if restore_step not in steps:
    raise ConfigError(f"restore_step={restore_step} is not a kept checkpoint of "
                      f"{manager.directory}; kept steps: {steps}. Pick one of them, or 0 to "
                      f"start over.")
  return restore_step, [s for s in steps if s > restore_step]


def set_aside(workdir: str, manager: ocp.CheckpointManager, restore_step: int,
              later_steps: list[int]) -> str | None:
  """Moves `later_steps` and the history after `restore_step` to a new folder under
  `<workdir>/set_aside/` (process 0 moves, all wait); returns that folder."""
  rows = [r for r in metrics_io.read_history(os.path.join(workdir, metrics_io.METRICS_FILE))
          if r.get("step", 0) > restore_step]
  if not later_steps and not rows:
    return None
  dest = os.path.join(workdir, SET_ASIDE_DIR,
                      f"after_step_{restore_step}_{time.strftime('%Y%m%d-%H%M%S')}")
  if jax.process_index() == 0:
    os.makedirs(os.path.join(dest, "checkpoints"), exist_ok=True)
    for step in later_steps:
      _move(os.path.join(str(manager.directory), str(step)),
            os.path.join(dest, "checkpoints", str(step)))
    if rows:
      with open(os.path.join(dest, metrics_io.METRICS_FILE), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tensorboard = os.path.join(workdir, metrics_io.TENSORBOARD_DIR)
    if os.path.isdir(tensorboard):
      shutil.copytree(tensorboard, os.path.join(dest, metrics_io.TENSORBOARD_DIR))
  multihost_utils.sync_global_devices(f"rewind_to_{restore_step}")
  manager.reload()
  logging.warning("Rewound to step %d: steps %s and the later history are in %s.",
                  restore_step, later_steps, dest)
  return dest


def _move(source: str, dest: str) -> None:
  if metrics_io.is_remote(source):
    epath.Path(source).rename(dest)
  else:
    shutil.move(source, dest)


def truncate_tensorboard(workdir: str, last_step: int) -> int:
  """Drops the summaries after `last_step` from every event file of `<workdir>/tensorboard`
  (each file rewritten atomically); returns how many events were dropped."""
  directory = os.path.join(workdir, metrics_io.TENSORBOARD_DIR)
  if jax.process_index() != 0 or not os.path.isdir(directory):
    return 0
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (slow: only on resume)
  from tensorboard.compat.proto import event_pb2  # pylint: disable=import-outside-toplevel
  dropped = 0
  for path in tf.io.gfile.glob(os.path.join(directory, "**", "events.out.tfevents.*")) + \
      tf.io.gfile.glob(os.path.join(directory, "events.out.tfevents.*")):
    records, torn = [], False
    try:
      for record in tf.data.TFRecordDataset(path):
        records.append(bytes(record.numpy()))
    except tf.errors.DataLossError:
      torn = True   # the last record of a killed writer: drop it too
    kept = [r for r in records if not _is_after(event_pb2.Event.FromString(r), last_step)]
    if len(kept) == len(records) and not torn:
      continue
    dropped += len(records) - len(kept)
    with tf.io.TFRecordWriter(path + ".tmp") as writer:
      for record in kept:
        writer.write(record)
    tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
  return dropped


def _is_after(event, last_step: int) -> bool:
  return event.HasField("summary") and event.step > last_step
