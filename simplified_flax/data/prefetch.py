"""One background thread that runs an iterator ahead of its consumer:
`Prefetcher(source, transform=place_on_devices, depth=2)` iterates `transform(x)` for x of
`source`, in order, errors and the end included; `close()` is safe at any time, more than
once. The thread runs `next(source)` and `transform`, so host work overlaps the training step
(pass device placement as `transform` rather than stacking a second thread). depth=0 starts
no thread, with the same items, errors and end.
"""
import collections
import concurrent.futures
import threading
from typing import Any, Callable, Iterator


class Prefetcher:
  """Iterates `transform(x)` for `x` of `source`, up to `depth` items ahead."""

  def __init__(self, source: Iterator[Any], transform: Callable[[Any], Any] | None = None,
               depth: int = 2):
    if depth < 0:
      raise ValueError(f"Prefetch depth is {depth}; use 0 (no thread) or more.")
    self._source, self._transform, self._depth = iter(source), transform or (lambda x: x), depth
    self._thread = concurrent.futures.ThreadPoolExecutor(
        1, initializer=lambda: setattr(threading.current_thread(), "name", "data-prefetch"))
    self._ahead = collections.deque(  # futures of the next items, in order; made from now on
        self._thread.submit(self._make) for _ in range(depth))
    self._closed = False

  def _make(self):
    return self._transform(next(self._source))

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self):
    if self._closed:
      raise StopIteration
    try:
      if not self._depth:
        return self._make()
      while len(self._ahead) <= self._depth:
        self._ahead.append(self._thread.submit(self._make))
      return self._ahead.popleft().result()
    except BaseException:  # StopIteration included: nothing follows the end or an error
      self.close()
      raise

  def close(self) -> None:
    """Stops the thread; items made ahead are dropped, and no more follow. Idempotent."""
    self._closed = True
    self._thread.shutdown(wait=True, cancel_futures=True)
