"""A batch iterator whose position can be checkpointed, with background prefetch.

The iterator only needs `open_stream(k)`: the batches of the global stream from batch k on
(for a prepared split, batch k is computed directly, so opening at k reads no earlier data).
Its state is a few integers plus a description of the data that produced them:

    {"batches_drawn": 1200, "epoch": 2, "position": 34, "seed": 0,
     "fingerprint": "3f9a...", "data": {"dataset": ..., "seed": 0, ...}}

which is the same on every process, so the primary host alone can save it and every host can
restore it. Restoring checks that the description still matches (a changed corpus, tokenizer,
batch size or seed would silently continue a different stream) and names what changed.

`prefetch` > 0 runs that many batches ahead on one background thread (`prefetch.py`; 0: none);
the batches made past a restore point are thrown away, so prefetch never changes what a
consumer sees. A consumer that runs its own `Prefetcher` (the training loop) passes prefetch=0.
"""
import hashlib
import json
from typing import Any, Callable, Iterator

from simplified_flax.data.errors import DataError
from simplified_flax.data.prefetch import Prefetcher

Batch = dict[str, Any]
StreamFactory = Callable[[int], Iterator[Batch]]
STATE_FORMAT = 2


def fingerprint(description: dict) -> str:
  return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


class CheckpointableIterator:
  """Batches of a deterministic stream; `get_state` / `set_state` resume it exactly."""

  def __init__(self, open_stream: StreamFactory, description: dict, *, prefetch: int = 2,
               batches_per_epoch: int | None = None):
    self._open_stream = open_stream
    self._description = json.loads(json.dumps(description))  # what a checkpoint will hold
    self._prefetch = prefetch
    self._batches_per_epoch = batches_per_epoch
    self._drawn = 0
    self._stream: Iterator[Batch] | None = None

  def __iter__(self) -> "CheckpointableIterator":
    return self

  def __next__(self) -> Batch:
    if self._stream is None:
      self._stream = Prefetcher(self._open_stream(self._drawn), depth=self._prefetch)
    try:
      batch = next(self._stream)
    except BaseException:
      self.close()  # the next call reopens at the same position
      raise
    self._drawn += 1
    return batch

  def get_state(self) -> dict:
    epoch, position = (divmod(self._drawn, self._batches_per_epoch)
                       if self._batches_per_epoch else (None, None))
    return {"format": STATE_FORMAT, "batches_drawn": self._drawn, "epoch": epoch,
            "position": position, "seed": self._description.get("seed"),
            "fingerprint": fingerprint(self._description), "data": self._description}

  def set_state(self, state: dict) -> None:
    """Continues at batch `state["batches_drawn"]` of the same stream, at once."""
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
    if self._stream is not None:
      self._stream.close()
    self._stream = None
