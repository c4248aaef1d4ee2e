"""A lost process of a multi-host run ends every other one within seconds, with one line
(instead of a wait in a collective and a C++ abort): each process keeps a heartbeat in JAX's
coordination key-value store, and a watchdog thread that sees a peer silent for
`LOST_AFTER_S`, or the coordinator gone, prints the line and exits 1 at once. A failed
collective is explained the same way (`explain`); a finished process marks itself done.
"""
import os
import sys
import threading
import time

HEARTBEAT_EVERY_S = 2.0
LOST_AFTER_S = 12.0
_KEY = "simplified_flax/heartbeat/{}"
_DONE_KEY = "simplified_flax/done/{}"
# What a collective or the coordination client says when a peer is gone.
PEER_LOSS_TEXT = ("Connection closed by peer", "Connection reset by peer", "heartbeat timeout",
                  "Gloo", "UNAVAILABLE", "coordination service")

_exiting = threading.Lock()
_started = None          # when the watchdog started (None: single-process, or not started)
_me = (0, 1)             # (this process's index, process count) once the watchdog started
_done = threading.Event()


class PeerLostError(RuntimeError):
  """Another process of the multi-host run stopped; this one stops too."""


def _client():
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


def start_watchdog() -> None:
  """Starts this process's heartbeat and watchdog thread (after jax.distributed.initialize)."""
  global _started, _me
  import jax  # pylint: disable=import-outside-toplevel  (cli imports this module before JAX)
  if jax.process_count() > 1 and _started is None:
    _started, _me = time.time(), (jax.process_index(), jax.process_count())
    threading.Thread(target=_watch, args=_me, daemon=True, name="multihost-watchdog").start()


def mark_done() -> None:
  """Tells the other processes that this one finished and is not lost; stops the watchdog
  (the coordinator going away after the final barrier is no failure)."""
  _done.set()
  if _started is not None:
    try:
      _client().key_value_set(_DONE_KEY.format(_me[0]), "1", allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass   # the coordinator is already gone: nobody is left to tell


def _try_get(client, key: str):
  try:
    return client.key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except
    return e   # not set yet, or the coordinator is unreachable


def lost_processes(index: int, count: int) -> list[str]:
  """The peers that look lost now: silent too long, or the coordinator when it is gone."""
  client, now = _client(), time.time()
  lost = []
  for peer in (p for p in range(count) if p != index):
    if not isinstance(_try_get(client, _DONE_KEY.format(peer)), Exception):
      continue   # done
    last = _try_get(client, _KEY.format(peer))
    if isinstance(last, Exception):
      if any(text in str(last) for text in ("UNAVAILABLE", "Connection", "CANCELLED")):
        address = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
        return [f"process 0 (the coordinator{', ' + address if address else ''})"]
      last = _started   # no heartbeat yet: count from when this process started watching
    if now - float(last) > LOST_AFTER_S:
      lost.append(f"process {peer} (silent for {now - float(last):.0f} s)")
  return lost


def _watch(index: int, count: int) -> None:
  client = _client()
  while not _done.is_set():
    try:
      client.key_value_set(_KEY.format(index), repr(time.time()), allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass   # the coordinator is gone: lost_processes names it
    lost = lost_processes(index, count)
    if lost and not _done.is_set():
      stop(PeerLostError(message(index, count, lost)))
    _done.wait(HEARTBEAT_EVERY_S)


def message(index: int, count: int, lost: list[str]) -> str:
  return (f"Lost {', '.join(lost)} of the {count}-process run; process {index} stops too. "
          f"Restart every process with the same command: the run resumes from the last "
          f"complete checkpoint.")


def explain(errors) -> PeerLostError | None:
  """For an error that a lost peer caused (`errors`: it, its causes and contexts), the
  PeerLostError naming the peer (waiting up to LOST_AFTER_S for its silence to show); else
  None, at once in a single-process run."""
  if _started is None or not any(text in str(e) for e in errors for text in PEER_LOSS_TEXT):
    return None
  deadline = time.time() + LOST_AFTER_S + HEARTBEAT_EVERY_S
  while time.time() < deadline:
    lost = lost_processes(*_me)
    if lost:
      return PeerLostError(message(*_me, lost))
    time.sleep(0.5)
  return PeerLostError(message(*_me, ["another process (a collective failed)"]))


def stop(error: PeerLostError, program: str = "simplified_flax") -> None:
  """Prints `error` as one line and ends this process with status 1 at once."""
  with _exiting:
    print(f"{program}: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)   # pylint: disable=protected-access  (JAX's shutdown barrier would abort)
