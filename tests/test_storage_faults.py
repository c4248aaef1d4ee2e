"""Object-store faults during a gs:// run, injected by `fault_proxy.FaultProxy` between the
clients and the GCS emulator (as tests/test_storage_gcs.py starts it), on a fixed schedule.

One story, told once per module (each run is a subprocess; the fault-free reference runs
once, in a local workdir):
  A  train with transient faults everywhere (every 30th request a 503; bursts of 429/503 on
     the metrics rewrite, the lock heartbeat and checkpoint arrays; a stall on the manifest;
     a shard upload reset halfway), SIGKILLed while an array of step 8 is being uploaded;
  B  the same command: resumes from step 4, then the store goes down for good at the save of
     step 8: it must end with one line, non-zero, within the retry budget;
  C  the same command once the store is back (transient faults again): resumes from step 4
     and completes.
The test then checks what a user relies on: the losses and final parameters equal the
reference's bit for bit, every step is in metrics.jsonl once, every kept checkpoint restores.
"""
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import jax

from fault_proxy import FaultProxy, Rule
from test_loop import REPO, cli_args, subprocess_env, write_corpus
from test_storage_gcs import BUCKET, RUN, USE_GCSFS, _start_emulator

pytestmark = pytest.mark.slow

BUDGET_S = 5          # storage_retry_budget_s of the faulted runs
WORKDIR = f"gs://{BUCKET}/run"


def transient_rules() -> list[Rule]:
  """Faults a healthy run must ride through (each within the budget)."""
  return [Rule("503", every=30),
          Rule("429", match=r"run/metrics\.jsonl", count=3, skip=1),    # the metrics rewrite
          Rule("503", match=r"run/lock\.heartbeat", count=3),           # the lock's heartbeat
          Rule("stall", match=r"manifest\.json", count=1, skip=1),      # the manifest read
          Rule("reset", match=r"POST /upload.*tokens-", count=1),       # a shard upload
          Rule("503", match=r"checkpoints/\d+/state/.*ocdbt", count=3, skip=2)]   # arrays


def _train(args, env, log: str, errors: str) -> subprocess.Popen:
  """The train command as a child: stdout appended to `log`, stderr to the file `errors`."""
  return subprocess.Popen([sys.executable, "-m", "simplified_flax.train", *args], cwd=REPO,
                          env=env, stdout=open(log, "ab"), stderr=open(errors, "w"))


def _restore_all(workdir: str) -> dict:
  """{step: state arrays (as saved, without a target: a tree of dicts)} of every kept
  checkpoint of `workdir`."""
  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp
  from simplified_flax.runs import checkpoints
  manager = checkpoints.open_read_only(workdir)
  states = {}
  for step in manager.all_steps():
    got = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    states[step] = jax.tree.map(np.asarray, got["state"])
  manager.close()
  return states


def _restore_all_in_bucket(url: str) -> dict:
  """`_restore_all(WORKDIR)` in this process, straight from the emulator at `url`: epath and
  tensorstore pointed there, epath through the plain gcsfs client (no bucket-type probe over
  gRPC); afterwards epath forgets that filesystem (it caches one, with its listings)."""
  # pylint: disable=import-outside-toplevel,protected-access
  import etils.epath.gpath as gpath
  from etils.epath import backend as epath_backend
  import gcsfs.core
  os.environ.update(TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",
                    STORAGE_EMULATOR_HOST=url, NO_GCE_CHECK="true")
  fsspec_registry = importlib.import_module("fsspec.registry")   # fsspec.registry: a dict
  real_is_tf, registry = gpath._is_tf_installed, dict(fsspec_registry._registry)
  def forget_filesystems():
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
  gpath._is_tf_installed = lambda: False
  for protocol in ("gs", "gcs"):
    fsspec_registry.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
  forget_filesystems()
  try:
    return _restore_all(WORKDIR)
  finally:
    gpath._is_tf_installed = real_is_tf
    forget_filesystems()
    fsspec_registry._registry.clear()
    fsspec_registry._registry.update(registry)


def _losses(lines: str) -> list[tuple]:
  return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in map(json.loads,
                                                                      lines.splitlines())]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
  """Runs the reference and A, B, C (module doc); returns what the tests check."""
  tmp = tmp_path_factory.mktemp("faults")
  data = write_corpus(tmp)
  cache = str(tmp / "jax_cache")
  reference = tmp / "reference"
  done = subprocess.run([sys.executable, "-m", "simplified_flax.train",
                         f"--workdir={reference}",
                         *cli_args({**RUN, **data, "data.cache_dir": str(tmp / "shards")})],
                        cwd=REPO, env=subprocess_env(cache_dir=cache), capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]

  proxy = FaultProxy(upstream_port=0, stall_s=3.0)   # stall > the 1.25 s request timeout
  server, direct = _start_emulator(external_url=proxy.url)   # upload URLs via the proxy
  proxy.upstream_port = int(direct.rsplit(":", 1)[1])
  saved_env = dict(os.environ)
  try:
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(USE_GCSFS)
    emulator = dict(STORAGE_EMULATOR_HOST=proxy.url, TENSORSTORE_GCS_HTTP_URL=proxy.url,
                    GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator", NO_GCE_CHECK="true",
                    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    env = subprocess_env(cache_dir=cache)
    env.update(emulator, PYTHONPATH=os.pathsep.join([str(tmp / "site"), env["PYTHONPATH"]]))
    import gcsfs.core   # pylint: disable=import-outside-toplevel
    fs = gcsfs.core.GCSFileSystem(token="anon", endpoint_url=direct, use_listings_cache=False,
                                  skip_instance_cache=True)
    fs.mkdir(BUCKET)
    args = [f"--workdir={WORKDIR}", *cli_args({**RUN, **data, "storage_retry_budget_s": BUDGET_S,
                                               "data.cache_dir": f"gs://{BUCKET}/shards"})]
    log = str(tmp / "run.log")
    out = {"fs": fs, "log": log}

    # A: transient faults, then SIGKILL while an array of step 8 is on its way.
    rules_a = [Rule("hold", match=r"POST /upload.*checkpoints/8/state/", count=1),
               *transient_rules()]
    proxy.rules = rules_a
    run = _train(args, env, log, str(tmp / "a.err"))
    while not proxy.held.wait(0.1):
      assert run.poll() is None, (tmp / "a.err").read_text()[-3000:]
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=60)
    proxy.release()
    out["a_fired"] = {r.match: r.fired for r in rules_a}
    out["a_committed"] = {s: fs.exists(f"{BUCKET}/run/checkpoints/{s}/commit_success.txt")
                          for s in (4, 8)}

    # B: resumes, then the store goes down at the save of step 8.
    proxy.rules = [Rule("outage", match=r"POST /upload.*checkpoints/8/"), *transient_rules()]
    run = _train(args, env, log, str(tmp / "b.err"))
    run.wait(timeout=600)
    out["b_status"], out["b_down_s"] = run.returncode, time.monotonic() - proxy.outage_since
    out["b_stderr"] = (tmp / "b.err").read_text()
    out["b_committed_4"] = fs.exists(f"{BUCKET}/run/checkpoints/4/commit_success.txt")
    out["digest_4"] = json.loads(fs.cat(f"{BUCKET}/run/checkpoints/4/digest.json"))["files"]

    # C: the store is back.
    proxy.outage(None)
    rules_c = transient_rules()
    proxy.rules = rules_c
    run = _train(args, env, log, str(tmp / "c.err"))
    run.wait(timeout=600)
    out["c_status"], out["c_stderr"] = run.returncode, (tmp / "c.err").read_text()
    out["c_fired"] = {r.match: r.fired for r in rules_c}
    out["faults"] = len(proxy.faults())

    # What the user keeps, read straight from the emulator (no faults).
    proxy.rules = []
    out["history"] = fs.cat(f"{BUCKET}/run/metrics.jsonl").decode()
    out["reference_history"] = (reference / "metrics.jsonl").read_text()
    out["states"] = _restore_all_in_bucket(direct)
    out["reference_states"] = _restore_all(str(reference))
    yield out
  finally:
    os.environ.clear()
    os.environ.update(saved_env)
    proxy.close()
    server.terminate()
    server.wait(timeout=30)


def check_transient_faults_leave_the_run_bit_identical(story):
  assert story["c_status"] == 0, story["c_stderr"][-3000:]
  assert all(story["a_fired"].values()), story["a_fired"]     # every fault landed in A ...
  assert all(v for k, v in story["c_fired"].items() if "tokens" not in k), story["c_fired"]
  assert "Retrying" in story["c_stderr"]                      # ... and was retried, logged
  digest = story["digest_4"]             # written last, from the store's own checksums
  assert any(name.startswith("state/") for name in digest) and all(digest.values()), digest
  assert _losses(story["history"]) == _losses(story["reference_history"])   # bit for bit
  assert [s for s, loss, _ in _losses(story["history"]) if loss is not None] == \
      list(range(1, RUN["num_train_steps"] + 1))              # every step once
  assert sorted(story["states"]) == [4, 8, RUN["num_train_steps"]]   # every kept step ...
  for step, state in story["states"].items():              # ... restores, as the reference's
    want = story["reference_states"][step]
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
      assert got.dtype == expected.dtype and np.array_equal(got, expected), step


def check_a_persistent_outage_ends_in_one_line_within_the_budget_and_resumes(story):
  assert story["b_status"] == 1, story["b_stderr"][-3000:]
  assert "Traceback" not in story["b_stderr"]
  errors = [l for l in story["b_stderr"].splitlines() if l.startswith("simplified_flax.train:")]
  assert len(errors) == 1 and errors[0] == story["b_stderr"].strip().splitlines()[-1], errors
  last = errors[0]
  assert re.fullmatch(r"simplified_flax\.train: error: The object store gs://runs kept failing "
                      r"\S.* \(HTTP 503\) for \d+ s, the retry budget "
                      r"\(storage_retry_budget_s=5\).*", last), last
  assert story["b_down_s"] < 3 * BUDGET_S + 5, story["b_down_s"]   # bounded, not a hang
  assert story["b_committed_4"]                              # the last good step untouched
  assert "Resuming from the checkpoint of step 4" in open(story["log"]).read()
  assert story["c_status"] == 0


def check_a_kill_mid_upload_never_restores_the_half_written_step(story):
  assert story["a_committed"] == {4: True, 8: False}
  with open(story["log"]) as f:
    resumed = re.findall(r"Resuming from the checkpoint of step (\d+)", f.read())
  assert resumed == ["4", "4"]                               # B and C: step 4, never 8


# One test for the story's three checks: xdist spreads a module's tests over its workers, and
# each worker would tell the whole story again (the fixture is most of this file's time).
def test_a_faulty_store_loses_nothing_ends_in_one_line_and_resumes(story):
  check_transient_faults_leave_the_run_bit_identical(story)
  check_a_persistent_outage_ends_in_one_line_within_the_budget_and_resumes(story)
  check_a_kill_mid_upload_never_restores_the_half_written_step(story)
