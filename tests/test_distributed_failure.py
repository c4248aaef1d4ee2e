"""A lost process of a two-process run ends the survivor within 30 s, with one line naming
it (docs/errors.md)."""
import signal
import time

import pytest

from test_distributed import _start_two_processes
from test_loop import TINY, log_tail, subprocess_env, wait_for_rows, write_corpus

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("killed", [1, 0])
def test_sigkill_of_one_process_ends_the_other_within_30_s_naming_it(tmp_path, killed):
  """Process 0 also hosts JAX's coordination service: losing it is the case JAX itself
  detects first (its client would abort with a multi-line C++ report)."""
  overrides = {**TINY, **write_corpus(tmp_path), "num_train_steps": 100_000,
               "checkpoint_every_steps": 0}
  workdir = tmp_path / "multi"
  procs = _start_two_processes(workdir, overrides, subprocess_env(devices=1))
  survivor = procs[1 - killed]
  try:
    wait_for_rows(workdir, procs[0], 3)
    killed_at = time.time()
    procs[killed].send_signal(signal.SIGKILL)
    status = survivor.wait(timeout=60)
    took = time.time() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  log = log_tail(workdir, 20_000)
  assert status == 1, log
  assert took < 30, took
  lines = [l for l in log.splitlines() if l.strip()]
  errors = [l for l in lines if "error:" in l]
  assert len(errors) == 1, log
  assert f"Lost process {killed}" in errors[0] and "of the 2-process run" in errors[0], log
  assert f"process {1 - killed} stops too" in errors[0], log
  assert "Traceback" not in log and "Check failure" not in log, log
  assert not any("Terminating process" in l or ".cc:" in l for l in lines), log


def test_the_supervisor_joins_only_multihost_runs_and_names_whom_jax_blames():
  from simplified_flax.runs import distributed  # pylint: disable=import-outside-toplevel
  assert not distributed.joins_multihost_run(["--config=c.py", "--workdir=w"], {})
  assert distributed.joins_multihost_run(["--coordinator_address=h:1", "--process_id=1"], {})
  assert distributed.joins_multihost_run(["--distributed"], {})
  assert distributed.joins_multihost_run([], {"JAX_COORDINATOR_ADDRESS": "h:1"})
  unreachable = b"F1201 ... absl::Status: UNAVAILABLE: Failed to send RPC to coordination service"
  line = distributed._lost_message(unreachable, ["--process_id=1", "--num_processes=2"], {})
  assert line.startswith("Lost process 0 (the coordinator) of the 2-process run; process 1 "
                         "stops too."), line
  timeout = b"F1201 ... Task /job:jax_worker/replica:0/task:2 heartbeat timeout"
  line = distributed._lost_message(timeout, [], {"JAX_PROCESS_ID": "0", "JAX_NUM_PROCESSES": "4"})
  assert line.startswith("Lost process 2 of the 4-process run; process 0 stops too."), line
