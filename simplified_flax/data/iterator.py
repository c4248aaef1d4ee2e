"""A batch iterator whose position is checkpointed, with background prefetch.

It needs only `open_stream(k)`, the batches from batch k on (computed directly: no earlier
data is read). Its state, `{"batches_drawn": 1200, "epoch": 2, "position": 34, "seed": 0,
"data": {...}}`, is the same on every process (the primary saves it, all restore it). `data`
describes what made the stream; restoring checks it (another corpus, tokenizer, batch size or
seed would silently continue another stream) and names what changed. Prefetched batches past
a restore point are dropped, so prefetch never changes what a consumer sees.
"""
import json
from typing import Any, Callable, Iterator

from simplified_flax.data.errors import DataError
from simplified_flax.data.prefetch import Prefetcher


class CheckpointableIterator:
  """Batches of a deterministic stream; `get_state` / `set_state` resume it exactly."""

  def __init__(self, open_stream: Callable[[int], Iterator[dict[str, Any]]], description: dict,
               *, prefetch: int = 2, batches_per_epoch: int | None = None):
    self._open_stream = open_stream
    self._description = json.loads(json.dumps(description))  # as a checkpoint holds it
    self._prefetch = prefetch
    self._batches_per_epoch = batches_per_epoch
    self._drawn = 0
    self._stream = None

  def __iter__(self) -> "CheckpointableIterator":
    return self

  def __next__(self) -> dict[str, Any]:
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
    return {"batches_drawn": self._drawn, "epoch": epoch, "position": position,
            "seed": self._description.get("seed"), "data": self._description}

  def set_state(self, state: dict) -> None:
    """Continues at batch `state["batches_drawn"]` of the same stream, at once."""
    if not isinstance(state, dict) or "batches_drawn" not in state or "data" not in state:
      raise DataError(f"Not a data-iterator state: {state!r:.200}. Restore the dict that "
                      "get_state() returned.")
    saved, now = state["data"], self._description
    changed = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}"
                        for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k))
    if changed:
      raise DataError(f"The data pipeline differs from the one whose state was saved ({changed}). "
                      "Resume with the same data settings, or start a new workdir.")
    self.close()
    self._drawn = int(state["batches_drawn"])

  def close(self) -> None:
    """Stops the prefetch thread; the next `next()` restarts at the current position."""
    if self._stream is not None:
      self._stream.close()
    self._stream = None
