"""A stop asked of a running loop: SIGTERM in a single-process run (the handler is installed in
the main thread and the previous one put back on `close`), or JAX's multi-host preemption sync
point (a TPU preemption notice, or SIGTERM on any host, seen through the checkpoint manager's
`reached_preemption`), makes the loop save at its next step and return (README, "Resuming").
"""
import signal
import threading

import jax
import orbax.checkpoint as ocp


class StopRequest:
  """Whether a stop was asked; `requested(step)` is called at every step on every host, as the
  multi-host sync protocol requires."""

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
