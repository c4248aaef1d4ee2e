"""Where a (re)started run begins, and a workdir's history cut back to that step.

`config.restore_step`:
    None  resume from the latest good checkpoint (the default);
    N     rewind to the kept checkpoint of step N: the later steps, their metrics.jsonl rows
          and TensorBoard events are moved to `<workdir>/set_aside/after_step_N_<time>/`,
          never deleted;
    0     start over: every checkpoint and the whole history are set aside the same way.

A rewind is done once: the checkpoints saved after it record the same restore_step, so
rerunning the same command later (after a preemption, say) resumes from the latest step
instead of rewinding again. Every resume then drops the rows and TensorBoard summaries after
the restored step (`metrics_io.truncate_history`). Every file goes through `etils.epath`, so a
gs:// workdir rewinds in its bucket.
"""
import json
import time

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from simplified_flax import storage
from simplified_flax.runs.config_checks import ConfigError
from simplified_flax.runs import checkpoints, metrics_io

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
              later_steps: list[int]) -> epath.Path | None:
  """Moves `later_steps` and the history after `restore_step` to a new folder under
  `<workdir>/set_aside/` (process 0 moves, all wait); returns that folder."""
  workdir = epath.Path(workdir)
  rows = [r for r in metrics_io.read_history(workdir / metrics_io.METRICS_FILE)
          if r.get("step", 0) > restore_step]
  if not later_steps and not rows:
    return None
  dest = workdir / SET_ASIDE_DIR / f"after_step_{restore_step}_{time.strftime('%Y%m%d-%H%M%S')}"
  if jax.process_index() == 0:
    for step in later_steps:
      storage.move_folder(epath.Path(manager.directory) / str(step),
                          dest / checkpoints.CHECKPOINT_DIR / str(step))
    dest.mkdir(parents=True, exist_ok=True)
    if rows:
      (dest / metrics_io.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = list((workdir / metrics_io.TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    if events:
      (dest / metrics_io.TENSORBOARD_DIR).mkdir(exist_ok=True)
    for file in events:
      file.copy(dest / metrics_io.TENSORBOARD_DIR / file.name)
  multihost_utils.sync_global_devices(f"rewind_to_{restore_step}")
  manager.reload()
  logging.warning("Rewound to step %d: steps %s and the later history are in %s.",
                  restore_step, later_steps, dest)
  return dest
