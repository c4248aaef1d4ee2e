"""Where a (re)started run begins (docs/resuming.md, "Resuming"): with `config.restore_step`
None the latest good checkpoint; N: kept step N, once it reads back intact; 0: start over. A rewind
moves the later steps and metrics.jsonl rows (and a copy of the TensorBoard events) to
`<workdir>/set_aside/after_step_N_<time>/`, never deleting; the steps saved after it record its
restore_step, so a rerun resumes from the latest. A changed schedule gets a console line.
"""
import dataclasses
import time
from typing import Any

from absl import logging
from etils import epath
import jax
import ml_collections
import orbax.checkpoint as ocp

from simplified_flax.runs.config_checks import ConfigError
from simplified_flax.runs import checkpoints
from simplified_flax.runs import compatibility
from simplified_flax.runs import metrics_io
from simplified_flax.training import optimizer

SET_ASIDE_DIR = "set_aside"
# The fields `optimizer.make_schedule` reads.
SCHEDULE_FIELDS = ("num_train_steps", "optimizer.learning_rate", "optimizer.schedule",
                   "optimizer.warmup_steps", "optimizer.warmup_fraction")


@dataclasses.dataclass(frozen=True)
class Start:
  """Where the loop begins: the restored train state (None: a fresh run) and console notes."""
  state: Any = None
  step: int = 0
  elapsed_s: float = 0.0
  data_state: Any = None
  notes: tuple[str, ...] = ()


def start(workdir: str, manager: ocp.CheckpointManager, target_state, config_dict: dict,
          restore_step: int | None) -> Start:
  """The start of a run under `config_dict`, restored into `target_state`'s shapes, dtypes and
  shardings; the history cut back to it. ConfigError for a restore_step that is not kept."""
  rewind_to, later_steps = _plan(manager, restore_step)
  restored = None
  if rewind_to != 0:   # 0: start over, nothing to restore
    restored = checkpoints.restore_latest(manager, target_state, config_dict, workdir,
                                          step=rewind_to)
  step = 0 if restored is None else restored.step
  aside = None
  if rewind_to is not None:
    aside = (epath.Path(workdir) / SET_ASIDE_DIR
             / f"after_step_{rewind_to}_{time.strftime('%Y%m%d-%H%M%S')}")
    checkpoints.set_aside(manager, {s: aside / checkpoints.CHECKPOINT_DIR / str(s)
                                    for s in later_steps}, f"rewind to step {rewind_to}")
  if jax.process_index() == 0:
    metrics_io.cut_history(workdir, step, aside)
  if restored is None:
    return Start()
  notes = [f"Resuming from the checkpoint of step {step}."]
  schedule_note = schedule_change(restored.config, config_dict, step)
  if schedule_note:
    notes.append(schedule_note)
  return Start(state=restored.state, step=step, data_state=restored.data_state,
               elapsed_s=float(restored.meta.get("elapsed_s", 0.0)), notes=tuple(notes))


def _plan(manager: ocp.CheckpointManager, restore_step: int | None) -> tuple[int | None, list]:
  """(the step to rewind to, or None for the latest; the steps to set aside)."""
  manager.reload()
  steps = sorted(manager.all_steps())
  if restore_step is None:
    return None, []
  try:
    head = manager.restore(steps[-1], args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    applied = head["config"].get("restore_step") == restore_step
  except Exception:  # pylint: disable=broad-except
    applied = False   # no checkpoint, or an unreadable one: restore_latest reports it
  if applied:
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


def learning_rate(config_dict: dict, count: int) -> float:
  """The learning rate of update number `count` (0-based) under a saved config dict."""
  opt = ml_collections.ConfigDict(config_dict["optimizer"])
  return float(optimizer.make_schedule(opt, int(config_dict["num_train_steps"]))(count))


def schedule_change(saved: dict | None, new: dict, step: int) -> str | None:
  """One line when `new` schedules the learning rate differently from `saved` (the config of
  checkpoint `step`), naming the fields and the next update's learning rate under both."""
  diffs = compatibility.config_differences(saved or {}, new)
  fields = [k for k in SCHEDULE_FIELDS if k in diffs]
  if not saved or not fields:
    return None
  before, after = learning_rate(saved, step), learning_rate(new, step)
  listing = ", ".join(f"{k} {diffs[k][0]!r} -> {diffs[k][1]!r}" for k in fields)
  return (f"Learning-rate schedule changed on resume ({listing}): step {step + 1} trains at "
          f"lr {after:.3e} (the saved schedule: {before:.3e}) and the new schedule runs from "
          f"there; set these fields back to keep the saved one.")
