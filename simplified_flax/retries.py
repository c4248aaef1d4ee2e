"""One retry policy for every request to an object store (gs://, s3://), whoever makes it.

Transient failures (HTTP 408, 429 and 5xx, a timed-out or stalled request, a connection reset
or refused) are retried with exponential backoff and jitter until the operation has spent
`budget_s` seconds (config field `storage_retry_budget_s`); anything else (403, 404, a bad
request) fails at once. Each retry is logged once, naming its operation. When the budget is
spent the operation raises `StoreUnavailableError`: one line naming the store, the operation
and the last status.

The policy reaches three layers, each through its own settings (`configure`):
  * this project's own reads and writes (config.json, tokenizer, metrics, the workdir lock,
    shards and manifest, the set-aside of checkpoints): `call(operation, path, fn)`;
  * gcsfs (epath's gs:// backend, also Orbax's metadata files): its per-request retry is the
    same backoff (its fixed 6 attempts replaced), its `requests_timeout` the stall timeout;
  * tensorstore (Orbax's arrays): the context resource `gcs_request_retries` (attempts whose
    doubling delays fit the budget) and curl's low-speed timeout (TENSORSTORE_CURL_LOW_SPEED_*).
A request is declared stalled after `request_timeout_s(budget_s)`: a quarter of the budget,
between 1 s and 60 s, so that a stall still leaves time to retry within the budget.
"""
import asyncio
import contextlib
import functools
import os
import random
import re
import time
from typing import Callable, TypeVar

from absl import logging

DEFAULT_BUDGET_S = 120.0
FIRST_DELAY_S = 0.25     # the first retry waits about this long; each next one twice as long
MAX_DELAY_S = 8.0        # ... up to this
_TRANSIENT_HTTP = frozenset([408, 429]) | frozenset(range(500, 600))
# tensorstore's errors carry the status in their text: "... [http_response_code=503] ..."
_TENSORSTORE_STATUS = re.compile(
    r"http_response_code=(\d{3})|HTTP (?:response code|status):? (\d{3})")
_TENSORSTORE_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "Timeout was reached",
                          "Connection reset", "Connection refused", "Operation timed out")

T = TypeVar("T")
_budget_s = DEFAULT_BUDGET_S
# Set once an operation spent the whole budget, until a request succeeds: the clean-up on
# the way out (closing files, releasing the lock) then tries once each, so the run ends
# within about one budget.
_store_down = False


class StoreUnavailableError(RuntimeError):
  """A remote operation kept failing transiently for the whole retry budget."""


def is_remote(path) -> bool:
  """True for a URI path (gs://, s3://, ...), which lives in an object store."""
  return "://" in os.fspath(path)


def budget_s() -> float:
  return _budget_s


def request_timeout_s(budget: float) -> float:
  """How long one request may wait for bytes before it counts as stalled (and is retried)."""
  return min(60.0, max(1.0, budget / 4))


def delay_s(attempt: int) -> float:
  """The wait before retry `attempt` (1, 2, ...): 0.25 s doubling to 8 s, the upper half
  jittered (`equal jitter`: never near zero, and clients that failed together spread out)."""
  ceiling = min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (attempt - 1))
  return ceiling / 2 + random.uniform(0, ceiling / 2)


def attempts_within(budget: float) -> int:
  """How many attempts fit in `budget` seconds of waiting at the largest delays (>= 1): the
  retry count given to layers that count attempts rather than seconds (tensorstore)."""
  waited, attempt = 0.0, 1
  while waited + min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (attempt - 1)) <= budget:
    waited += min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (attempt - 1))
    attempt += 1
  return attempt


def transient_status(error: BaseException) -> str | None:
  """Why `error` (or what caused it) is worth retrying ("HTTP 503", "timed out", "connection
  reset"), or None when it is not (403, 404, a local error, a bug)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    status = _status_of(error)
    if status is not None:
      return status or None
    error = error.__cause__ or error.__context__
  return None


def _status_of(error: BaseException) -> str | None:
  """'' for an error that is certainly not transient, a status for one that is, None when
  unknown (look at its cause)."""
  if isinstance(error, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError)):
    return ""
  code = getattr(error, "code", None)
  code = getattr(error, "status", None) if not isinstance(code, int) else code
  if isinstance(code, int) and 100 <= code < 600:
    return f"HTTP {code}" if code in _TRANSIENT_HTTP else ""
  name = type(error).__name__
  if name == "ProxyError":   # gcsfs raises requests' ProxyError for an HTTP 502
    return "HTTP 502"
  if isinstance(error, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in name:
    return "timed out"
  if isinstance(error, ConnectionError) or name in (
      "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
      "ClientConnectorError", "ClientPayloadError", "ConnectionError", "ChunkedEncodingError"):
    return "connection reset" if "eset" in f"{name} {error}" else f"connection failed ({name})"
  text = str(error)
  match = _TENSORSTORE_STATUS.search(text)
  if match:
    code = int(match.group(1) or match.group(2))
    return f"HTTP {code}" if code in _TRANSIENT_HTTP else ""
  for marker in _TENSORSTORE_TRANSIENT:
    if marker in text:
      return marker.lower()
  return None


def store_of(path) -> str:
  """'gs://bucket' of 'gs://bucket/a/b'."""
  text = os.fspath(path)
  scheme, _, rest = text.partition("://")
  return f"{scheme}://{rest.split('/', 1)[0]}"


def unavailable(operation: str, path, status: str, waited_s: float) -> StoreUnavailableError:
  global _store_down
  _store_down = True
  return StoreUnavailableError(
      f"The object store {store_of(path)} kept failing {operation} {os.fspath(path)} ({status}) "
      f"for {waited_s:.0f} s, the retry budget (storage_retry_budget_s={_budget_s:g}); every "
      "completed checkpoint is kept: rerun the same command once the store answers.")


@contextlib.contextmanager
def gave_up(operation: str, path):
  """Re-raises a transient error that another layer (Orbax's tensorstore and gcsfs, each
  retrying within the budget already) gave up on as a one-line StoreUnavailableError."""
  start = time.monotonic()
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except
    status = transient_status(error)
    if status is None or not is_remote(path) or isinstance(error, StoreUnavailableError):
      raise
    raise unavailable(operation, path, status,
                      max(time.monotonic() - start, _budget_s)) from error


def call(operation: str, path, fn: Callable[[], T]) -> T:
  """`fn()`, retried on transient errors within the budget when `path` is remote (a local path:
  called once). `operation` ("write", "read", "move") names it in the log and the error."""
  if not is_remote(path):
    return fn()
  global _store_down
  start, attempt = time.monotonic(), 0
  while True:
    try:
      result = fn()
      _store_down = False
      return result
    except Exception as error:  # pylint: disable=broad-except
      status = transient_status(error)
      if status is None or isinstance(error, StoreUnavailableError):
        raise
      attempt += 1
      waited, wait = time.monotonic() - start, delay_s(attempt)
      if waited + wait > _budget_s or _store_down:
        raise unavailable(operation, path, status, waited) from error
      logging.warning("Retrying %s %s in %.1f s (%s; %.0f of %g s of retry budget spent).",
                      operation, os.fspath(path), wait, status, waited, _budget_s)
      time.sleep(wait)


def _retrying_coroutine(method, describe):
  """gcsfs's async request `method` under this policy (its own retry decorator unwrapped)."""
  @functools.wraps(method)
  async def wrapper(*args, **kwargs):
    start, attempt = time.monotonic(), 0
    while True:
      try:
        return await method(*args, **kwargs)
      except Exception as error:  # pylint: disable=broad-except
        status = transient_status(error)
        attempt += 1
        waited, wait = time.monotonic() - start, delay_s(attempt)
        if status is None or waited + wait > _budget_s or _store_down:
          raise
        logging.warning("Retrying %s in %.1f s (%s; %.0f of %g s of retry budget spent).",
                        describe(args), wait, status, waited, _budget_s)
        await asyncio.sleep(wait)
  wrapper.retries_policy = True
  return wrapper


def _configure_gcsfs(budget: float) -> None:
  try:
    import aiohttp  # pylint: disable=import-outside-toplevel
    import fsspec.config  # pylint: disable=import-outside-toplevel
    from gcsfs import core  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  timeout = request_timeout_s(budget)
  for protocol in ("gs", "gcs"):   # what fsspec.filesystem("gcs") passes to GCSFileSystem
    fsspec.config.conf.setdefault(protocol, {})["requests_timeout"] = aiohttp.ClientTimeout(
        sock_connect=timeout, sock_read=timeout)
  def describe_request(args):     # _request(self, method, path, *format_args, ...)
    path = args[2] if len(args) > 2 else "?"
    try:
      path = args[0]._format_path(path, args[3:])  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      pass
    return f"{args[1]} {path}"
  for name, describe in (("_request", describe_request),
                         ("_get_file_request", lambda a: f"GET {a[1]}"),
                         ("_get_file_concurrent", lambda a: f"GET {a[1]}")):
    method = getattr(core.GCSFileSystem, name, None)
    if method is None or getattr(method, "retries_policy", False):
      continue
    setattr(core.GCSFileSystem, name,
            _retrying_coroutine(getattr(method, "__wrapped__", method), describe))


def _configure_tensorstore(budget: float) -> None:
  timeout = request_timeout_s(budget)
  # Read by tensorstore's curl transport when it first starts: set before any checkpoint I/O.
  os.environ["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] = str(int(round(timeout)))
  os.environ["TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"] = "1"
  os.environ["TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS"] = str(int(round(timeout)))
  try:
    # pylint: disable-next=import-outside-toplevel
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  except ImportError:
    return
  make = getattr(ts_utils.get_ts_context, "__wrapped__", ts_utils.get_ts_context)
  retries = {"max_retries": attempts_within(budget), "initial_delay": f"{FIRST_DELAY_S}s",
             "max_delay": f"{MAX_DELAY_S}s"}

  @functools.wraps(make)
  def get_ts_context(**kwargs):   # Orbax builds every tensorstore context here
    import tensorstore as ts  # pylint: disable=import-outside-toplevel
    return ts.Context(ts.Context.Spec({"gcs_request_retries": retries}), parent=make(**kwargs))
  ts_utils.get_ts_context = get_ts_context


def configure_from(config, *paths) -> None:
  """`configure` with the config's `storage_retry_budget_s` (absent in older saved configs:
  the default), reaching into gcsfs and tensorstore when one of `paths` is remote."""
  configure(config.get("storage_retry_budget_s", DEFAULT_BUDGET_S),
            remote=any(p and is_remote(p) for p in paths))


def configure(budget: float, remote: bool = True) -> None:
  """Makes `budget` seconds the retry budget of this project's calls and, with `remote`, of
  gcsfs's and tensorstore's (importing them: a local run skips that); call once a run's config
  is known, before its first remote request (idempotent). A new budget is a fresh start."""
  global _budget_s, _store_down
  _budget_s, _store_down = float(budget), False
  if remote:
    _configure_gcsfs(_budget_s)
    _configure_tensorstore(_budget_s)
