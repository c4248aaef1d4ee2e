"""One background thread that runs an iterator ahead of its consumer.

    feeder = Prefetcher(source, transform=place_on_devices, depth=2)
    for item in feeder: ...        # transform(x) for every x of source, in order
    feeder.close()                 # safe at any time, more than once, from the consumer

The thread calls `next(source)` and `transform` (so host work such as gathering rows or
copying to devices overlaps the training step); errors, StopIteration included, are handed
to the consumer in order and end the thread. The training loop should stack no second thread
on top: pass its device placement as `transform` here instead.
"""
import queue
import threading
from typing import Any, Callable, Iterator

_END = object()


class Prefetcher:
  """Iterates `transform(x)` for `x` of `source`, up to `depth` items ahead (see module doc)."""

  def __init__(self, source: Iterator[Any], transform: Callable[[Any], Any] | None = None,
               depth: int = 2):
    if depth < 1:
      raise ValueError(f"Prefetch depth is {depth}; use 1 or more (or iterate the source "
                       "directly for no prefetch).")
    self._items: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._finished = False
    self._thread = threading.Thread(target=self._run, args=(source, transform), daemon=True,
                                    name="data-prefetch")
    self._thread.start()

  def _put(self, item) -> bool:
    """Blocks until there is room or close() was called (then gives up)."""
    while not self._stop.is_set():
      try:
        self._items.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self, source, transform) -> None:
    try:
      for x in source:
        if not self._put(transform(x) if transform is not None else x):
          return
      self._put(_END)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the consumer)
      self._put(e)

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self):
    if self._finished:
      raise StopIteration
    item = self._items.get()
    if item is _END:
      self._finished = True
      raise StopIteration
    if isinstance(item, BaseException):
      self._finished = True
      raise item
    return item

  def close(self) -> None:
    """Stops the thread; items made ahead are dropped. Idempotent."""
    self._stop.set()
    self._thread.join(timeout=10)
