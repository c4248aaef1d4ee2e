"""One training run per workdir: `<workdir>/lock.json` names the holder, a thread keeps
`<workdir>/lock.heartbeat` fresh.

A second run on a workdir that a live run holds raises `WorkdirLockedError` naming the holder
(host, pid, start time) before it reads or writes anything else there. A lock whose holder is
dead is taken over with a warning: on the same host when its pid is gone, on any host when
its heartbeat is older than `stale_after_s`. All file access goes through `etils.epath`, so
the lock works on the remote filesystems (`gs://...`) a workdir may live on; local paths are
created with O_EXCL, remote ones are written and read back (the last writer wins the race,
and the loser sees the winner's lock). In a multi-host run process 0 holds the lock for the
run and tells the others whether it got it.

Evaluating, sampling and fine-tuning only read a workdir and take no lock.
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
    return Holder(**json.loads(path.read_text()))
  except FileNotFoundError:
    return None
  except (ValueError, TypeError):
    return Holder(host="?", pid=-1, started=0.0, token="unreadable")   # half-written


def _last_heartbeat(workdir: epath.Path, holder: Holder) -> float:
  try:
    return float(json.loads((workdir / HEARTBEAT_FILE).read_text())["time"])
  except FileNotFoundError:
    return holder.started
  except (ValueError, KeyError, TypeError):
    return time.time()   # caught mid-write: the holder is beating right now


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True    # someone else's live process
  return True


def why_dead(workdir: epath.Path, holder: Holder, stale_after_s: float) -> str | None:
  """Why `holder` is dead, or None when it may be alive."""
  if holder.host == socket.gethostname() and holder.pid > 0 and not _pid_alive(holder.pid):
    return f"its pid {holder.pid} is gone"
  silent_s = time.time() - _last_heartbeat(workdir, holder)
  if silent_s > stale_after_s:
    return f"its heartbeat is {silent_s:.0f} s old (timeout {stale_after_s:.0f} s)"
  return None


def _create(path: epath.Path, text: str) -> bool:
  """Creates `path` holding `text` unless it exists; True when this call created it."""
  if not is_remote(path):
    try:
      fd = os.open(os.fspath(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    return True
  if path.exists():
    return False
  path.write_text(text)
  time.sleep(1.0)          # let a racing writer's object land, then see who won
  return path.exists() and path.read_text() == text


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
    self._thread: threading.Thread | None = None

  def acquire(self) -> None:
    """Takes the lock (over a dead holder, with a warning) or raises WorkdirLockedError."""
    lock = self.workdir / LOCK_FILE
    for _ in range(3):   # a takeover can race with another starter: look again
      if _create(lock, json.dumps(dataclasses.asdict(self.holder))):
        self._beat()
        self._thread = threading.Thread(target=self._beat_loop, daemon=True,
                                        name="workdir-lock-heartbeat")
        self._thread.start()
        _held.add(self)
        return
      current = _read_holder(lock)
      if current is None:
        continue   # released in between
      dead = why_dead(self.workdir, current, self.stale_after_s)
      if dead is None:
        raise WorkdirLockedError(
            f"{self.workdir} is in use by another training run ({current.describe()}); "
            f"nothing was changed. Wait for it to finish, stop it, or use another --workdir "
            f"(a dead holder's lock is taken over automatically).")
      logging.warning("Taking over the lock of %s from a dead run (%s: %s).", self.workdir,
                      current.describe(), dead)
      print(f"Warning: taking over {lock} from a dead run ({current.describe()}): {dead}.",
            flush=True)
      try:   # the renamed file is the proof that this process, not a racer, set it aside
        lock.rename(self.workdir / f"{LOCK_FILE}.dead-{self.holder.token}")
        (self.workdir / f"{LOCK_FILE}.dead-{self.holder.token}").unlink(missing_ok=True)
      except FileNotFoundError:
        continue
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
      except OSError as e:   # a storage hiccup must not kill the run; the next beat retries
        if not failing:      # once per outage: a full disk would repeat it every beat
          logging.warning("Could not update %s: %s", self.workdir / HEARTBEAT_FILE, e)
        failing = True

  def release(self) -> None:
    """Stops the heartbeat and removes the lock if this process still holds it."""
    _held.discard(self)
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    lock = self.workdir / LOCK_FILE
    current = _read_holder(lock)
    if current is not None and current.token == self.holder.token:
      (self.workdir / HEARTBEAT_FILE).unlink(missing_ok=True)
      lock.unlink(missing_ok=True)


@contextlib.contextmanager
def hold(workdir, **kwargs):
  """Holds the workdir lock for the body; in a multi-host run process 0 holds it and every
  process raises WorkdirLockedError when process 0 could not take it."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  lock, error = None, None
  if jax.process_index() == 0:
    lock = WorkdirLock(workdir, **kwargs)
    try:
      lock.acquire()
    except WorkdirLockedError as e:
      lock, error = None, e
  if jax.process_count() > 1:
    import numpy as np  # pylint: disable=import-outside-toplevel
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
