"""Checkpoints with Orbax: save, resume from the latest good one, refuse incompatible configs.

A checkpoint `<workdir>/checkpoints/<step>/` holds four items:
    state   the train state: params, constants, optimiser state, step, RNG (StandardSave)
    data    the training iterator's state (JSON)
    config  the resolved config of the run (JSON)
    meta    {"step", "fingerprint", "elapsed_s"} (JSON)

Guarantees:
* Orbax writes a step into a temporary directory and renames it only when every item is
  complete; old steps beyond `max_to_keep` are deleted only after that, so a newer checkpoint
  never replaces an older good one before it is whole. Saving is asynchronous.
* `fingerprint` is an order-independent integer hash of every state leaf's bits, checked on
  restore: a truncated or corrupt step is reported and the previous step is tried; once a good
  one is found the bad ones move to `<workdir>/corrupt_checkpoints/`. If none is good the
  restore fails and nothing moves.
* A saved config that differs from the new one in a way that changes parameter shapes raises
  `IncompatibleCheckpointError` naming the fields; checkpoints are never touched for that.
"""
import dataclasses
import os
import time
from typing import Any, Callable

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from simplified_flax import config_files
from simplified_flax import storage
from simplified_flax.runs.fingerprint import fingerprint

ITEMS = ("state", "data", "config", "meta")
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"


class IncompatibleCheckpointError(ValueError):
  """The workdir holds checkpoints of a model with different parameter shapes."""


class CheckpointError(RuntimeError):
  """The workdir holds checkpoints but none of them can be restored."""


class WorkdirError(FileNotFoundError):
  """The workdir, or the checkpoint step asked for, does not exist."""


# Fields that only say how this start resumes; they never make a checkpoint incompatible.
RESUME_ONLY_FIELDS = ("restore_step",)


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_state: Any
  meta: dict
  config: dict | None = None   # the config the checkpoint was saved with


# ---------------------------------------------------------------------------------- manager

def make_manager(workdir: str, max_to_keep: int, save_interval_steps: int,
                 async_save: bool = True, keep_every_steps: int = 0) -> ocp.CheckpointManager:
  """The run's CheckpointManager over `<workdir>/checkpoints` (left-over temp dirs removed).

  It keeps the latest `max_to_keep` steps and, with `keep_every_steps` = K > 0, every step
  divisible by K as well (Orbax preservation policies): a sparse trail from before a blow-up.
  """
  preservation = ocp.checkpoint_managers.LatestN(max_to_keep)
  if keep_every_steps > 0:
    preservation = ocp.checkpoint_managers.AnyPreservationPolicy(
        [preservation, ocp.checkpoint_managers.EveryNSteps(keep_every_steps)])
  options = ocp.CheckpointManagerOptions(
      preservation_policy=preservation, save_interval_steps=max(1, save_interval_steps),
      enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
  return ocp.CheckpointManager(_directory(workdir), options=options, item_names=ITEMS)


def open_read_only(workdir: str) -> ocp.CheckpointManager:
  """A manager that only reads `<workdir>/checkpoints`, for evaluating, sampling or
  fine-tuning from a run that may still be training: it creates, deletes and cleans up
  nothing (a training manager removes temporary directories, which would destroy a step
  that the running job is writing). Raises FileNotFoundError if there is no such folder."""
  directory = _directory(workdir)
  if not directory.exists():
    raise WorkdirError(f"{directory} does not exist: is {workdir!r} the --workdir of a "
                            "training run?")
  # The values a read-only manager needs, given explicitly: Orbax warns about each default
  # it has to change (save_interval_steps=1, max_to_keep) on every evaluate or sample.
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                         max_to_keep=None, cleanup_tmp_directories=False)
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)   # and it warns that a read-only manager is read-only
  try:
    return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)
  finally:
    logging.set_verbosity(verbosity)


def _directory(workdir: str) -> epath.Path:
  """`<workdir>/checkpoints`, made absolute when local (Orbax wants absolute local paths)."""
  root = workdir if storage.is_remote(workdir) else os.path.abspath(workdir)
  return epath.Path(root) / CHECKPOINT_DIR


def save(manager: ocp.CheckpointManager, step: int, state, data_state, config_dict: dict,
         meta: dict) -> bool:
  """Starts saving `step` (asynchronously); `meta` gets the state's fingerprint added.

  Forced: the caller decides the steps (its interval, the last step, a preemption).
  """
  meta = dict(meta, step=int(step), fingerprint=int(jax.device_get(fingerprint(state))))
  return manager.save(step, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {}),
      config=ocp.args.JsonSave(config_dict), meta=ocp.args.JsonSave(meta)))


# --------------------------------------------------------------------- config compatibility

def flatten_config(d: dict) -> dict[str, Any]:
  """{"model": {"n_layer": 2}} -> {"model.n_layer": 2}."""
  return {k: v for k, v in config_files.dotted_items(d) if not isinstance(v, dict)}


def config_differences(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
  """{dotted field: (saved value, new value)} for every field that differs."""
  a, b = flatten_config(saved), flatten_config(new)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def shape_changing_fields(saved: dict, new: dict,
                          param_shapes: Callable[[dict], dict]) -> list[str]:
  """The differing model fields of `new` that can change `param_shapes(config_dict)`.

  `param_shapes` maps a config dict to {parameter path: shape}; it runs once per config (the
  model is traced with `jax.eval_shape`, never built per field). When the saved and new
  shapes agree the answer is []. Otherwise every differing model field is named except those
  that are numbers on both sides (gains, rates, epsilons: scalars that shape no parameter).
  """
  diffs = config_differences(saved, new)
  model_diffs = [k for k in diffs if k.startswith("model.")]
  if not model_diffs or param_shapes(saved) == param_shapes(new):
    return []
  culprits = [k for k in model_diffs if not all(isinstance(v, float) for v in diffs[k])]
  return culprits or model_diffs


def check_compatible(saved: dict, new: dict, param_shapes: Callable[[dict], dict],
                     where: str) -> None:
  """Raises IncompatibleCheckpointError when `saved` and `new` give different parameters."""
  diffs = config_differences(saved, new)
  culprits = shape_changing_fields(saved, new, param_shapes)
  if culprits:
    listing = ", ".join(f"{k} (saved {diffs[k][0]!r}, now {diffs[k][1]!r})" for k in culprits)
    # The first parameter (in path order) whose shape differs; a None shape is absent.
    path, shapes = next(iter(config_differences(param_shapes(saved), param_shapes(new)).items()))
    was, now = ("absent" if shape is None else shape for shape in shapes)
    raise IncompatibleCheckpointError(
        f"Refusing to resume from {where}: the new config changes parameter shapes through "
        f"{listing} (e.g. {path}: saved {was}, now {now}). Use a fresh --workdir, or set these "
        f"fields back.")
  others = {k: v for k, v in diffs.items() if k not in RESUME_ONLY_FIELDS}
  if others:
    logging.warning("Resuming with config changes that keep parameter shapes: %s",
                    ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in others.items()))


# ------------------------------------------------------------------- restore with fall-back

def restore_latest(manager: ocp.CheckpointManager, target_state, new_config: dict,
                   param_shapes: Callable[[dict], dict], workdir: str,
                   set_aside: bool = True, step: int | None = None) -> Restored | None:
  """The newest restorable checkpoint, or None when the workdir has no checkpoint.

  `target_state` gives shapes, dtypes and shardings (jax.ShapeDtypeStruct leaves); `step`
  restricts the search to that one step. Bad steps are handled as the module docstring says
  (CheckpointError when none is good: a run never silently restarts from scratch over
  unreadable checkpoints); readers of another job's run pass an `open_read_only` manager and
  `set_aside=False`, which moves nothing.
  """
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  if step is not None:
    if step not in steps:
      raise WorkdirError(f"No checkpoint step {step} under {manager.directory}; it holds "
                              f"steps {sorted(steps)}.")
    steps = [step]
  bad: list[tuple[int, str]] = []
  for s in steps:
    why, restored = _try_restore(manager, s, target_state, new_config, param_shapes)
    if why is not None:
      logging.error("Checkpoint %s/%d is truncated or corrupt: %s. Trying the previous one.",
                    manager.directory, s, why)
      bad.append((s, why))
      continue
    for bad_step, bad_why in bad if set_aside else ():
      _set_aside(manager, bad_step, workdir, bad_why)
    logging.info("Restored checkpoint %s/%d.", manager.directory, s)
    return restored
  if bad:
    raise CheckpointError(
        f"No checkpoint under {manager.directory} can be restored: "
        + "; ".join(f"step {s}: {w}" for s, w in bad)
        + ". Nothing was moved; fix the storage or start a new --workdir.")
  return None


def _try_restore(manager, step, target_state, new_config, param_shapes):
  """(None, Restored) for a good step, else (why it is bad, None)."""
  try:
    head = manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
  except Exception as e:  # pylint: disable=broad-except
    return f"its config/meta cannot be read ({e!r:.300})", None
  check_compatible(head["config"], new_config, param_shapes,
                   f"{manager.directory}/{step}")
  try:
    body = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target_state), data=ocp.args.JsonRestore()))
    got = int(jax.device_get(fingerprint(body["state"])))
  except Exception as e:  # pylint: disable=broad-except
    return f"its state cannot be read ({e!r:.300})", None
  if got != head["meta"]["fingerprint"]:
    return (f"its state fingerprint {got} does not match the saved "
            f"{head['meta']['fingerprint']}"), None
  return None, Restored(step, body["state"], body["data"], head["meta"], head["config"])


def _set_aside(manager: ocp.CheckpointManager, step: int, workdir: str, why: str) -> None:
  """Moves a bad step to <workdir>/corrupt_checkpoints/ (process 0 moves, all wait)."""
  source = epath.Path(manager.directory) / str(step)
  dest = epath.Path(workdir) / CORRUPT_DIR / f"{step}-{int(time.time())}"
  logging.error("Moving the bad checkpoint %s to %s (%s).", source, dest, why)
  if jax.process_index() == 0:
    storage.move_folder(source, dest)
  multihost_utils.sync_global_devices(f"set_aside_checkpoint_{step}")
  manager.reload()
