"""What resuming with a changed config does to the learning rate, said in one line.

Training resumes under the config it is given: a changed `num_train_steps` or warm-up or
schedule re-shapes the learning-rate schedule from the resume step on (the optimiser's
update count continues). `schedule_change` names the fields and gives the learning rate the
next update gets under the saved and under the new schedule, so the jump is visible before
it happens (README, "Resuming").
"""
import ml_collections

from simplified_flax.runs import checkpoints
from simplified_flax.training import optimizer

# The fields `optimizer.make_schedule` reads.
SCHEDULE_FIELDS = ("num_train_steps", "optimizer.learning_rate", "optimizer.schedule",
                   "optimizer.warmup_steps", "optimizer.warmup_fraction")


def learning_rate(config_dict: dict, count: int) -> float:
  """The learning rate of update number `count` (0-based) under a saved config dict."""
  opt = ml_collections.ConfigDict(config_dict["optimizer"])
  return float(optimizer.make_schedule(opt, int(config_dict["num_train_steps"]))(count))


def schedule_change(saved: dict | None, new: dict, step: int) -> str | None:
  """One line when `new` schedules the learning rate differently from `saved` (the config of
  the checkpoint of `step`), else None."""
  if not saved:
    return None
  diffs = checkpoints.config_differences(saved, new)
  fields = [k for k in SCHEDULE_FIELDS if k in diffs]
  if not fields:
    return None
  before, after = learning_rate(saved, step), learning_rate(new, step)
  listing = ", ".join(f"{k} {diffs[k][0]!r} -> {diffs[k][1]!r}" for k in fields)
  return (f"Learning-rate schedule changed on resume ({listing}): step {step + 1} trains at "
          f"lr {after:.3e} (the saved schedule: {before:.3e}) and the new schedule runs from "
          f"there; set these fields back to keep the saved one.")
