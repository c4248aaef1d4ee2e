"""One training run per workdir: `lock.json` names the holder (host, pid, start time) and a
thread keeps `lock.heartbeat` fresh. A second run is refused naming the holder before it
touches anything; a dead holder's lock (same host: pid gone; any host: heartbeat older than
`stale_after_s`) is taken over with a warning. Through `etils.epath`, so gs:// workdirs lock
too; in a multi-host run process 0 holds the lock. Readers (evaluate, sample) take none.
"""
import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np

from simplified_flax import retries
from simplified_flax import storage
from simplified_flax.storage import is_remote, write_atomically

LOCK_FILE = "lock.json"
HEARTBEAT_FILE = "lock.heartbeat"
HEARTBEAT_EVERY_S = 10.0
STALE_AFTER_S = 60.0   # a holder on another host is dead after this long without a heartbeat


class WorkdirLockedError(RuntimeError):
  """The workdir is held by another live run."""


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  started: float      # time.time() when the lock was taken
  token: str          # unique per acquisition

  def describe(self) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
    return f"host {self.host}, pid {self.pid}, started {when}"


def _read_holder(path: epath.Path) -> Holder | None:
  try:
    return Holder(**json.loads(storage.read_text(path)))
  except FileNotFoundError:
    return None
  except (ValueError, TypeError):
    return Holder(host="?", pid=-1, started=0.0, token="unreadable")   # half-written


def why_dead(workdir: epath.Path, holder: Holder, stale_after_s: float) -> str | None:
  """Why `holder` is dead, or None when it may be alive."""
  if holder.host == socket.gethostname() and holder.pid > 0:
    try:
      os.kill(holder.pid, 0)
    except ProcessLookupError:
      return f"its pid {holder.pid} is gone"
    except PermissionError:
      pass   # someone else's live process
  try:
    last = float(json.loads(storage.read_text(workdir / HEARTBEAT_FILE))["time"])
  except FileNotFoundError:
    last = holder.started
  except (ValueError, KeyError, TypeError):
    last = time.time()   # caught mid-write: the holder is beating right now
  if time.time() - last > stale_after_s:
    return f"its heartbeat is {time.time() - last:.0f} s old (timeout {stale_after_s:.0f} s)"
  return None


def _create(path: epath.Path, text: str) -> bool:
  """Creates `path` holding `text` unless it exists (remote: the last writer wins); True when
  this call created it."""
  if not is_remote(path):
    try:
      fd = os.open(os.fspath(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    return True
  if not storage.exists(path):
    retries.call("write", path, lambda: path.write_text(text))
    time.sleep(1.0)          # let a racing writer's object land, then see who won
  return storage.exists(path) and storage.read_text(path) == text


_held: set["WorkdirLock"] = set()   # the locks this process holds now


def release_held() -> None:
  """Releases every lock this process holds (for an exit that skips the `hold` context)."""
  for lock in list(_held):
    lock.release()


class WorkdirLock:
  """Holds `<workdir>/lock.json` from `acquire()` to `release()`, with a heartbeat thread."""

  def __init__(self, workdir, heartbeat_every_s: float = HEARTBEAT_EVERY_S,
               stale_after_s: float = STALE_AFTER_S):
    self.workdir = epath.Path(workdir)
    self.heartbeat_every_s, self.stale_after_s = heartbeat_every_s, stale_after_s
    self.holder = Holder(socket.gethostname(), os.getpid(), time.time(), uuid.uuid4().hex)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat_loop, daemon=True,
                                    name="workdir-lock-heartbeat")

  def acquire(self) -> None:
    """Takes the lock (over a dead holder, with a warning) or raises WorkdirLockedError."""
    lock = self.workdir / LOCK_FILE
    for _ in range(3):   # a takeover can race with another starter: look again
      if _create(lock, json.dumps(dataclasses.asdict(self.holder))):
        self._beat()
        self._thread.start()
        _held.add(self)
        return
      current = _read_holder(lock)
      dead = current and why_dead(self.workdir, current, self.stale_after_s)
      if current and not dead:
        raise WorkdirLockedError(
            f"{self.workdir} is in use by another training run ({current.describe()}); "
            f"nothing was changed. Wait for it to finish, stop it, or use another --workdir "
            f"(a dead holder's lock is taken over automatically).")
      if dead:   # on the console: the takeover is the user's business
        print(f"Warning: taking over {lock} from a dead run ({current.describe()}): {dead}.",
              flush=True)
        try:   # the renamed file proves that this process, not a racer, set it aside
          dead_copy = self.workdir / f"{LOCK_FILE}.dead-{self.holder.token}"
          retries.call("rename", lock, lambda: lock.rename(dead_copy))
          storage.unlink(dead_copy)
        except FileNotFoundError:
          pass
    raise WorkdirLockedError(f"Could not lock {self.workdir}: other runs keep starting on it.")

  def _beat(self) -> None:
    beat = json.dumps({"time": time.time(), "token": self.holder.token}).encode()
    write_atomically(self.workdir / HEARTBEAT_FILE, lambda f: f.write(beat))

  def _beat_loop(self) -> None:
    failing = False
    while not self._stop.wait(self.heartbeat_every_s):
      try:
        self._beat()
        failing = False
      except (OSError, retries.StoreUnavailableError) as e:   # the next beat tries again
        if not failing:      # once per outage: a full disk would repeat it every beat
          logging.warning("Could not update %s: %s", self.workdir / HEARTBEAT_FILE, e)
        failing = True

  def release(self) -> None:
    """Stops the heartbeat and removes the lock if this process still holds it."""
    _held.discard(self)
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
    try:
      current = _read_holder(self.workdir / LOCK_FILE)
      if current is not None and current.token == self.holder.token:
        storage.unlink(self.workdir / HEARTBEAT_FILE)
        storage.unlink(self.workdir / LOCK_FILE)
    except (OSError, retries.StoreUnavailableError) as e:   # the next run takes it over
      logging.warning("Could not release %s: %s", self.workdir / LOCK_FILE, e)


@contextlib.contextmanager
def hold(workdir, **kwargs):
  """Holds the workdir lock for the body; in a multi-host run process 0 holds it and every
  process raises WorkdirLockedError when process 0 could not take it."""
  lock, error = None, None
  if jax.process_index() == 0:
    lock = WorkdirLock(workdir, **kwargs)
    try:
      lock.acquire()
    except WorkdirLockedError as e:
      lock, error = None, e
  if jax.process_count() > 1:
    failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
    if int(failed) and error is None:
      error = WorkdirLockedError(f"Process 0 could not lock {workdir}; see its message.")
  if error is not None:
    raise error
  try:
    yield lock
  finally:
    if lock is not None:
      lock.release()
