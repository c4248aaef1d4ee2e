"""Orbax checkpoints `<workdir>/checkpoints/<step>/` (`state`, iterator `data`, `config`, `meta`
with the state's `fingerprint` and the data state's `data_digest`), saved asynchronously and
renamed into place only once whole; restored from the latest step whose digests match (bad
ones are moved to `corrupt_checkpoints/` once a good one is found, never deleted; a step saved
before `data_digest` existed is checked on its state only); a config that changes
parameter shapes is refused naming the fields (compatibility.py). `StopRequest`: SIGTERM or a multi-host
preemption makes the loop save at its next step and return (docs/resuming.md, "Resuming").
"""
import dataclasses
import json
import os
import signal
import threading
import time
import weakref
import zlib
from typing import Any

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from simplified_flax import retries
from simplified_flax import storage
from simplified_flax.runs import checkpoint_digest
from simplified_flax.runs import compatibility

ITEMS = ("state", "data", "config", "meta")
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
class CheckpointError(RuntimeError):
  """The workdir holds checkpoints but none of them can be restored."""


class WorkdirError(FileNotFoundError):
  """The workdir, or the checkpoint step asked for, does not exist."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_state: Any
  meta: dict
  config: dict   # the config the checkpoint was saved with


def make_manager(workdir: str, max_to_keep: int, save_interval_steps: int,
                 async_save: bool = True, keep_every_steps: int = 0) -> ocp.CheckpointManager:
  """The run's manager: the latest `max_to_keep` steps kept and, with `keep_every_steps` = K,
  every step divisible by K (a sparse trail from before a blow-up); temp dirs cleaned up."""
  preservation = ocp.checkpoint_managers.LatestN(max_to_keep)
  if keep_every_steps > 0:
    preservation = ocp.checkpoint_managers.AnyPreservationPolicy(
        [preservation, ocp.checkpoint_managers.EveryNSteps(keep_every_steps)])
  options = ocp.CheckpointManagerOptions(
      preservation_policy=preservation, save_interval_steps=max(1, save_interval_steps),
      enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
  return ocp.CheckpointManager(_directory(workdir), options=options, item_names=ITEMS)


def open_read_only(workdir: str) -> ocp.CheckpointManager:
  """A manager that creates, deletes and cleans up nothing (a clean-up would destroy the step a
  running job writes), for reading another run. WorkdirError when there is no such folder."""
  directory = _directory(workdir)
  if not directory.exists():
    raise WorkdirError(f"{directory} does not exist: is {workdir!r} the --workdir of a "
                       "training run?")
  # Every value given: Orbax warns about each default it changes.
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


def _bits_u32(x: jax.Array) -> jax.Array:
  """The bits of each element as uint32 (64-bit elements: their two halves added)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  itemsize = jnp.dtype(x.dtype).itemsize
  if itemsize == 8:
    return jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint32), axis=-1)
  unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def fingerprint(tree) -> jax.Array:
  """uint32 hash of all leaves: sum over elements of bits * (2 * flat_index + 1), mixed;
  integer arithmetic wraps exactly, so neither sharding nor reduction order changes it."""
  total = jnp.uint32(0)
  for leaf in map(jnp.asarray, jax.tree.leaves(tree)):
    index = jnp.arange(leaf.size, dtype=jnp.uint32).reshape(leaf.shape)
    leaf_hash = jnp.sum(_bits_u32(leaf) * (2 * index + 1), dtype=jnp.uint32)
    total = total * jnp.uint32(1_000_003) + leaf_hash + jnp.uint32(leaf.size)
  return total


def data_digest(data_state) -> int:
  """crc32 of the data-iterator state as sorted JSON: the same before saving and after its
  JSON round trip (numpy scalars count as their Python values)."""
  text = json.dumps(data_state or {}, sort_keys=True,
                    default=lambda o: o.item() if hasattr(o, "item") else str(o))
  return zlib.crc32(text.encode()) & 0xFFFFFFFF


def save(manager: ocp.CheckpointManager, step: int, state, data_state, config_dict: dict,
         meta: dict) -> bool:
  """Starts saving `step` (asynchronously, forced); `meta` gets the state's fingerprint and the
  data state's digest, checked on restore."""
  meta = dict(meta, step=int(step), fingerprint=int(jax.device_get(fingerprint(state))),
              data_digest=data_digest(data_state))
  finish(manager)   # the previous save (Orbax waits for it anyway), then its file digest
  with retries.gave_up("saving checkpoints under", manager.directory):   # Orbax's layers
    saved = manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {}),
        config=ocp.args.JsonSave(config_dict), meta=ocp.args.JsonSave(meta)))
  if saved:
    _undigested.setdefault(manager, []).append(int(step))
  return saved


# Steps saved (asynchronously) whose digest.json is not written yet, per manager.
_undigested: "weakref.WeakKeyDictionary[ocp.CheckpointManager, list[int]]" = (
    weakref.WeakKeyDictionary())


def finish(manager: ocp.CheckpointManager) -> None:
  """Waits for the save in flight, then (process 0) writes the file digest of every step
  saved since, last. An object store that failed the save for the whole retry budget
  (tensorstore's, inside Orbax) is one StoreUnavailableError line."""
  with retries.gave_up("saving checkpoints under", manager.directory):
    manager.wait_until_finished()
    for step in _undigested.pop(manager, []):
      step_dir = epath.Path(manager.directory) / str(step)
      if jax.process_index() == 0 and storage.exists(step_dir):   # not already cleaned up
        checkpoint_digest.write(step_dir)


def restore_latest(manager: ocp.CheckpointManager, target_state, new_config: dict,
                   workdir: str, read_only: bool = False,
                   step: int | None = None) -> Restored | None:
  """The newest restorable checkpoint (only `step`, when given) in `target_state`'s shapes,
  dtypes and shardings; None when there is none, CheckpointError when none is good (never a
  silent restart over unreadable ones). `read_only` moves nothing."""
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  if step is not None and step not in steps:
    raise WorkdirError(f"No checkpoint step {step} under {manager.directory}; it holds "
                       f"steps {sorted(steps)}.")
  bad: dict[int, str] = {}
  for s in steps if step is None else [step]:
    why, restored = _try_restore(manager, s, target_state, new_config)
    if why is None:
      if not read_only:
        stamp = int(time.time())
        set_aside(manager, {b: epath.Path(workdir) / CORRUPT_DIR / f"{b}-{stamp}" for b in bad},
                  "truncated or corrupt")
      logging.info("Restored checkpoint %s/%d.", manager.directory, s)
      return restored
    logging.error("Checkpoint %s/%d is truncated or corrupt: %s. Trying the previous one.",
                  manager.directory, s, why)
    bad[s] = why
  if bad:
    raise CheckpointError(
        f"No checkpoint under {manager.directory} can be restored: "
        + "; ".join(f"step {s}: {w}" for s, w in bad.items())
        + ". Nothing was moved; fix the storage or start a new --workdir.")
  return None


def _try_restore(manager, step, target_state, new_config):
  """(None, Restored) for a good step, else (why it is bad, None)."""
  try:
    why = checkpoint_digest.mismatch(epath.Path(manager.directory) / str(step))
  except Exception as e:  # pylint: disable=broad-except
    _raise_if_store_down(e, manager, step)
    raise
  if why is not None:
    return why, None
  try:
    head = manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
  except Exception as e:  # pylint: disable=broad-except
    _raise_if_store_down(e, manager, step)
    return f"its config/meta cannot be read ({e!r:.300})", None
  compatibility.check_compatible(head["config"], new_config,
                               f"{manager.directory}/{step}")
  try:
    body = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target_state), data=ocp.args.JsonRestore()))
    got = int(jax.device_get(fingerprint(body["state"])))
  except Exception as e:  # pylint: disable=broad-except
    _raise_if_store_down(e, manager, step)
    return f"its state cannot be read ({e!r:.300})", None
  if got != head["meta"]["fingerprint"]:
    return (f"its state fingerprint {got} does not match the saved "
            f"{head['meta']['fingerprint']}"), None
  saved_digest = head["meta"].get("data_digest")   # None: saved before the digest existed
  if saved_digest is not None and data_digest(body["data"]) != saved_digest:
    return (f"its data state digest {data_digest(body['data'])} does not match the saved "
            f"{saved_digest}"), None
  return None, Restored(step, body["state"], body["data"], head["meta"], head["config"])


def _raise_if_store_down(error: Exception, manager, step: int) -> None:
  """A step the store would not serve is not corrupt: StoreUnavailableError, nothing moved."""
  status = retries.transient_status(error)
  if status is not None and storage.is_remote(manager.directory):
    raise retries.unavailable("restoring checkpoint", epath.Path(manager.directory) / str(step),
                              status, retries.budget_s()) from error


def set_aside(manager: ocp.CheckpointManager, destinations: dict[int, epath.Path],
              why: str) -> None:
  """Moves each checkpoint step of `destinations` to its folder there, never deleting (corrupt
  steps, the steps a rewind goes back past): process 0 moves, all wait, the manager rereads."""
  if not destinations:
    return
  logging.warning("Setting aside checkpoints %s (%s): %s", sorted(destinations), why,
                  ", ".join(str(d) for d in destinations.values()))
  if jax.process_index() == 0:
    for step, dest in destinations.items():
      storage.move_folder(epath.Path(manager.directory) / str(step), dest)
  multihost_utils.sync_global_devices(f"set_aside_{'_'.join(map(str, destinations))}")
  manager.reload()


class StopRequest:
  """Whether a stop was asked: SIGTERM (handled in a single-process run's main thread until
  `close`) or the manager's preemption sync point (a TPU preemption notice, or SIGTERM on any
  host), which `requested(step)` must reach at every step on every host."""

  def __init__(self, manager: ocp.CheckpointManager):
    self._manager = manager
    self._flag = threading.Event()
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())

  def requested(self, step: int) -> bool:
    return self._manager.reached_preemption(step) or self._flag.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
