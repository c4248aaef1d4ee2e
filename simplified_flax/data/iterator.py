"""A batch iterator whose position can be checkpointed, with background prefetch.

The iterator only needs `open_stream(k)`: the batches of the global stream from batch k on.
Its state is the number of batches drawn plus a description of the data that produced them:

    {"batches_drawn": 1200, "fingerprint": "3f9a...", "data": {"dataset": ..., "seed": 0, ...}}

which is the same on every process, so the primary host alone can save it and every host can
restore it. Restoring checks that the description still matches (a changed corpus, tokenizer,
batch size or seed would silently continue a different stream) and names what changed.

A daemon thread runs `prefetch` batches ahead so the host never waits for data; the batches it
made past a restore point are thrown away, so prefetch never changes what a consumer sees.
"""
import hashlib
import json
import queue
import threading
from typing import Any, Callable, Iterator

from simplified_flax.data.errors import DataError

Batch = dict[str, Any]
StreamFactory = Callable[[int], Iterator[Batch]]
STATE_FORMAT = 1


def fingerprint(description: dict) -> str:
  return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


class _Producer(threading.Thread):
  """Fills a bounded queue with (batch, error) from a stream until stopped."""

  def __init__(self, stream: Iterator[Batch], depth: int):
    super().__init__(daemon=True)
    self.items: queue.Queue = queue.Queue(maxsize=depth)
    self._stream = stream
    self._stopped = threading.Event()

  def run(self) -> None:
    while not self._stopped.is_set():
      try:
        item = (next(self._stream), None)
      except BaseException as e:  # handed to the consumer, StopIteration included
        item = (None, e)
      while not self._stopped.is_set():
        try:
          self.items.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[1] is not None:
        return

  def stop(self) -> None:
    self._stopped.set()
    self.join()


class CheckpointableIterator:
  """Batches of a deterministic stream; `get_state` / `set_state` resume it exactly."""

  def __init__(self, open_stream: StreamFactory, description: dict, *, prefetch: int = 2):
    self._open_stream = open_stream
    self._description = json.loads(json.dumps(description))  # what a checkpoint will hold
    self._prefetch = prefetch
    self._drawn = 0
    self._producer: _Producer | None = None
    self._stream: Iterator[Batch] | None = None

  def __iter__(self) -> "CheckpointableIterator":
    return self

  def __next__(self) -> Batch:
    if self._prefetch <= 0:
      if self._stream is None:
        self._stream = self._open_stream(self._drawn)
      batch = next(self._stream)
    else:
      if self._producer is None:
        self._producer = _Producer(self._open_stream(self._drawn), self._prefetch)
        self._producer.start()
      batch, error = self._producer.items.get()
      if error is not None:
        self._producer = None
        raise error
    self._drawn += 1
    return batch

  def get_state(self) -> dict:
    return {"format": STATE_FORMAT, "batches_drawn": self._drawn,
            "fingerprint": fingerprint(self._description), "data": self._description}

  def set_state(self, state: dict) -> None:
    """Continues at batch `state["batches_drawn"]` of the same stream."""
    if not isinstance(state, dict) or "batches_drawn" not in state or "data" not in state:
      raise DataError(f"Not a data-iterator state: {state!r:.200}. Restore the dict that "
                      "get_state() returned.")
    saved = state["data"]
    if saved != self._description:
      changed = sorted(k for k in set(saved) | set(self._description)
                       if saved.get(k) != self._description.get(k))
      details = "; ".join(f"{k}: {saved.get(k)!r} -> {self._description.get(k)!r}"
                          for k in changed)
      raise DataError(f"The data pipeline differs from the one whose state was saved ({details}). "
                      "Resume with the same data settings, or start a new workdir.")
    self.close()
    self._drawn = int(state["batches_drawn"])

  def close(self) -> None:
    """Stops the prefetch thread; the next `next()` restarts at the current position."""
    if self._producer is not None:
      self._producer.stop()
      self._producer = None
    self._stream = None
