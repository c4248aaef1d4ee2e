"""The retry policy for remote storage (simplified_flax/retries.py), without a store: what is
transient, what the budget bounds, and what each layer is given."""
import logging
import time

import ml_collections
import pytest
from gcsfs.retry import HttpError

from simplified_flax import retries
from simplified_flax.runs import config_checks
from test_loop import make_config


@pytest.fixture(autouse=True)
def fresh_policy():
  retries.configure(1.0, remote=False)
  yield
  retries.configure(retries.DEFAULT_BUDGET_S)   # also resets what gcsfs was given


@pytest.mark.parametrize("error, status", [
    (HttpError({"code": 503, "message": "backend"}), "HTTP 503"),
    (HttpError({"code": 429, "message": "slow down"}), "HTTP 429"),
    (ConnectionResetError(104, "Connection reset by peer"), "connection reset"),
    (TimeoutError("read"), "timed out"),
    (ValueError("UNAVAILABLE: error writing [http_response_code=503]"), "HTTP 503"),
    (HttpError({"code": 403, "message": "forbidden"}), None),
    (FileNotFoundError("gs://b/x"), None),
    (ValueError("FAILED_PRECONDITION: [http_response_code=412]"), None),
    (KeyError("a bug"), None),
])
def test_only_429_5xx_timeouts_and_resets_are_transient(error, status):
  assert retries.transient_status(error) == status


def _failing(times: int, error: Exception):
  calls = []
  def fn():
    calls.append(time.monotonic())
    if len(calls) <= times:
      raise error
    return "done"
  return fn, calls


def test_transient_errors_are_retried_with_growing_delays_each_logged_once(caplog):
  fn, calls = _failing(2, HttpError({"code": 503, "message": "x"}))
  caplog.set_level(logging.WARNING)
  assert retries.call("write", "gs://bucket/run/metrics.jsonl", fn) == "done"
  assert len(calls) == 3 and calls[2] - calls[1] > calls[1] - calls[0] > 0.1
  logged = [r.getMessage() for r in caplog.records if "Retrying" in r.getMessage()]
  assert len(logged) == 2 and all("write gs://bucket/run/metrics.jsonl" in m and "HTTP 503" in m
                                  for m in logged)


def test_other_errors_and_local_paths_are_not_retried():
  for path, error in (("gs://bucket/x", FileNotFoundError("gs://bucket/x")),
                      ("gs://bucket/x", HttpError({"code": 403, "message": "no"})),
                      ("/tmp/x", ConnectionResetError())):
    fn, calls = _failing(1, error)
    with pytest.raises(type(error)):
      retries.call("read", path, fn)
    assert len(calls) == 1


def test_a_persistent_failure_ends_within_the_budget_in_one_line():
  fn, calls = _failing(10**6, HttpError({"code": 503, "message": "down"}))
  start = time.monotonic()
  with pytest.raises(retries.StoreUnavailableError) as error:
    retries.call("read", "gs://bucket/run/config.json", fn)
  assert time.monotonic() - start <= 1.0 and len(calls) >= 3
  message = str(error.value)
  assert "\n" not in message and message.startswith(
      "The object store gs://bucket kept failing read gs://bucket/run/config.json (HTTP 503)")
  fn, calls = _failing(10**6, HttpError({"code": 503, "message": "down"}))
  with pytest.raises(retries.StoreUnavailableError):   # the store is known down: one try
    retries.call("delete", "gs://bucket/run/lock.json", fn)
  assert len(calls) == 1


def test_gcsfs_and_tensorstore_get_the_same_budget():
  # pylint: disable=import-outside-toplevel
  import fsspec.config
  from gcsfs import core
  from orbax.checkpoint._src.serialization import tensorstore_utils
  retries.configure(8.0)
  timeout = fsspec.config.conf["gcs"]["requests_timeout"]
  assert timeout.sock_read == timeout.sock_connect == retries.request_timeout_s(8.0) == 2.0
  assert core.GCSFileSystem._request.retries_policy   # pylint: disable=protected-access
  context = tensorstore_utils.get_ts_context(use_ocdbt=True)
  assert context["gcs_request_retries"].to_json()["max_retries"] == retries.attempts_within(8.0)
  assert context["file_io_concurrency"].to_json() == {"limit": 128}   # Orbax's own, kept
  waits = [min(retries.MAX_DELAY_S, retries.FIRST_DELAY_S * 2 ** a)
           for a in range(retries.attempts_within(8.0) - 1)]
  assert sum(waits) <= 8.0 < sum(waits) + min(retries.MAX_DELAY_S,
                                              retries.FIRST_DELAY_S * 2 ** len(waits))


@pytest.mark.parametrize("budget", [0, -1, 1e6, "60", True])
def test_a_bad_budget_is_one_config_error_line(budget):
  config = make_config({}).to_dict()   # rebuilt: a ConfigDict refuses a value of another type
  config["storage_retry_budget_s"] = budget
  with pytest.raises(config_checks.ConfigError, match=r"^storage_retry_budget_s=.* must be a "
                     r"number in \(0, 86400\]: the seconds one remote read or write may spend "
                     r"retrying\.$"):
    config_checks.validate_run_config(ml_collections.ConfigDict(config))


def test_the_store_counts_as_back_after_one_success():
  down, _ = _failing(10**6, HttpError({"code": 503, "message": "down"}))
  with pytest.raises(retries.StoreUnavailableError):
    retries.call("write", "gs://bucket/run/lock.heartbeat", down)   # e.g. the heartbeat
  assert retries.call("read", "gs://bucket/run/config.json", lambda: "ok") == "ok"
  flaky, calls = _failing(1, HttpError({"code": 503, "message": "blip"}))
  assert retries.call("write", "gs://bucket/run/metrics.jsonl", flaky) == "done"
  assert len(calls) == 2                                            # retried again
