"""One background thread that runs an iterator ahead of its consumer.

    feeder = Prefetcher(source, transform=place_on_devices, depth=2)
    for item in feeder: ...        # transform(x) for every x of source, in order
    feeder.close()                 # safe at any time, more than once

The thread runs `next(source)` and `transform` (so host work overlaps the training step: pass
device placement as `transform` rather than stacking a second thread); errors and the end
reach the consumer in order. depth=0 starts no thread, with the same items, errors and end.
"""
import queue
import threading
from typing import Any, Callable, Iterator

_END = object()


class Prefetcher:
  """Iterates `transform(x)` for `x` of `source`, up to `depth` items ahead."""

  def __init__(self, source: Iterator[Any], transform: Callable[[Any], Any] | None = None,
               depth: int = 2):
    if depth < 0:
      raise ValueError(f"Prefetch depth is {depth}; use 0 (no thread) or more.")
    self._source, self._transform = iter(source), transform or (lambda x: x)
    self._items: queue.Queue = queue.Queue(maxsize=depth)   # depth 0: unbounded, holds one
    self._stop = threading.Event()
    self._finished = False
    self._thread = None
    if depth > 0:
      self._thread = threading.Thread(target=self._run, daemon=True, name="data-prefetch")
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

  def _step(self) -> bool:
    """Queues the next item, or the end or the error (then returns False: nothing follows)."""
    try:
      return self._put(self._transform(next(self._source)))
    except StopIteration:
      self._put(_END)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the consumer)
      self._put(e)
    return False

  def _run(self) -> None:
    while self._step():
      pass

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self):
    if self._finished:
      raise StopIteration
    if self._thread is None:
      self._step()
    item = self._items.get()
    if item is _END or isinstance(item, BaseException):
      self._finished = True
      raise StopIteration if item is _END else item
    return item

  def close(self) -> None:
    """Stops the thread; items made ahead are dropped, and no more follow. Idempotent."""
    self._stop.set()
    self._finished = True   # else a later `next` would wait for an item never made
    if self._thread is not None:
      self._thread.join(timeout=10)
