"""A stop asked of a running loop: SIGTERM in a single-process run, or JAX's multi-host
preemption sync point (a TPU preemption notice, or SIGTERM on any host, seen through the
checkpoint manager's `reached_preemption`), makes the loop save at its next step and return
(README, "Resuming"). The SIGTERM handler is installed only in the main thread of a
single-process run and the previous one is put back on `close`.
"""
import signal
import threading

import jax
import orbax.checkpoint as ocp


class StopRequest:
  """SIGTERM in a single-process run, or JAX's multi-host preemption sync point (TPU notices,
  SIGTERM on any host), asks the loop to save at the next step and return."""

  def __init__(self, manager: ocp.CheckpointManager):
    self._manager = manager
    self._flag = threading.Event()
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())

  def requested(self, step: int) -> bool:
    # Called at every step on every host, as the multi-host sync protocol requires.
    return self._manager.reached_preemption(step) or self._flag.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
