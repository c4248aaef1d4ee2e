"""The training loop in-process: outputs, evaluation, bad runs (NaN, corrupt and incompatible
checkpoints). Also home of the helpers the subprocess tests share (tiny config, corpus, CLI)."""
import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import conftest
import jax
import numpy as np
import pytest

import configs
from simplified_flax import evaluate
from simplified_flax.runs import checkpoints
from simplified_flax.runs import compatibility
from simplified_flax.runs import metrics_io
from simplified_flax.train import NonFiniteLossError, train_and_evaluate

# Orbax's failed reads of corrupt checkpoints leave closed-event-loop callbacks behind that
# surface later as unraisable-exception warnings: noise, not failures.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.context_length": 16,
        "batch_size": 8, "log_every_steps": 1, "eval_every_steps": 0, "eval_steps": 2}


# ------------------------------------------------------------------------------------------
# Helpers shared with test_resume.py and test_placement*.py and test_distributed*.py.
# ------------------------------------------------------------------------------------------
def write_corpus(root: pathlib.Path) -> dict:
  """A small deterministic text corpus; returns the data overrides that train on it."""
  rng = np.random.default_rng(0)
  words = ["def", "class", "return", "import", "self", "for", "in", "if", "else", "print",
           "value", "data", "(", ")", ":", "x", "y", "=", "+", "0", "1"]
  (root / "docs").mkdir(parents=True, exist_ok=True)
  for i in range(40):
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(60)]
    (root / "docs" / f"doc{i:02d}.txt").write_text("\n".join(lines))
  return {"data.name": "text_files", "data.paths": str(root / "docs" / "*.txt"),
          "data.tfds_data_dir": str(root / "tfds")}


def make_config(overrides: dict, variant: str = "preln"):
  return configs.load(f"{variant}:cpu", overrides)


def cli_args(overrides: dict, variant: str = "preln") -> list[str]:
  return [f"--config=configs/{variant}.py:cpu"] + [f"--config.{k}={v}"
                                                   for k, v in overrides.items()]


def subprocess_env(devices: int = 1, cache_dir: str | None = None) -> dict:
  """Environment of a child JAX process on `devices` simulated CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
             + conftest.FAST_COMPILE_XLA_FLAGS)
  if cache_dir:   # identical programs compile once across the test's processes
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def start_training(workdir, overrides: dict, env: dict, extra_args=(), variant="preln"):
  """`python -m simplified_flax.train ...` as a child process (stdout+stderr to a log file)."""
  log = open(os.path.join(str(workdir) + ".log"), "ab")
  return subprocess.Popen([sys.executable, "-m", "simplified_flax.train",
                           f"--workdir={workdir}", *cli_args(overrides, variant), *extra_args],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def log_tail(workdir, chars: int = 3000) -> str:
  path = str(workdir) + ".log"
  return open(path, errors="replace").read()[-chars:] if os.path.exists(path) else ""


def wait_for_rows(workdir, proc, count: int, timeout: float = 300) -> None:
  """Polls until `count` training rows are in metrics.jsonl (the child must still run)."""
  deadline = time.time() + timeout
  while len(train_rows(workdir)) < count:
    assert proc.poll() is None, f"finished before step {count}:\n{log_tail(workdir)}"
    assert time.time() < deadline, log_tail(workdir)
    time.sleep(0.005)


def kill_and_resume(workdir, overrides: dict, env: dict, after_rows: int, steps: int) -> None:
  """Trains, SIGKILLs the run once `after_rows` rows are logged (before step `steps`), and
  resumes it with the same command to the end; asserts it resumed from a checkpoint."""
  proc = start_training(workdir, overrides, env)
  wait_for_rows(workdir, proc, after_rows)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert len(train_rows(workdir)) < steps
  assert start_training(workdir, overrides, env).wait(timeout=600) == 0, log_tail(workdir)
  assert "Resuming from the checkpoint of step" in log_tail(workdir, 100_000)


def train_rows(workdir) -> dict[int, dict]:
  """{step: row} of the training rows of a workdir's metrics.jsonl."""
  rows = metrics_io.read_history(os.path.join(workdir, metrics_io.METRICS_FILE))
  return {r["step"]: r for r in rows if "loss" in r}


# ------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus"))


def _train(workdir, data, **overrides):
  return train_and_evaluate(make_config({**TINY, **data, **overrides}), str(workdir),
                            tensorboard=False)


def data_of(workdir) -> dict:
  """The data overrides a finished run used (from its config.json)."""
  d = json.load(open(os.path.join(workdir, "config.json")))["data"]
  return {"data.name": d["name"], "data.paths": d["paths"],
          "data.tfds_data_dir": d["tfds_data_dir"]}


TRAINED_RUN = {"num_train_steps": 6, "checkpoint_every_steps": 3, "eval_every_steps": 3,
               "log_every_steps": 2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
  """A finished 6-step run: checkpoints at 3 and 6, eval at 3 and 6, TensorBoard on."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  train_and_evaluate(make_config({**TINY, **data, **TRAINED_RUN}), str(workdir),
                     tensorboard=True)
  return workdir


def _copy(workdir, tmp_path) -> pathlib.Path:
  """A copy of a finished run to break (the module's runs stay intact)."""
  shutil.copytree(workdir, tmp_path / "run")
  return tmp_path / "run"


def test_run_writes_metrics_config_checkpoints_and_events(trained):
  rows = metrics_io.read_history(os.path.join(trained, metrics_io.METRICS_FILE))
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train] == [2, 4, 6]
  assert set(train[0]) == {"step", "loss", "learning_rate", "grad_norm", "tokens_per_s",
                           "elapsed_s"}
  assert [r["step"] for r in evals] == [3, 6]
  assert all(np.isclose(r["eval_perplexity"], np.exp(r["eval_loss"])) for r in evals)
  saved = json.load(open(os.path.join(trained, "config.json")))
  assert saved["model"]["vocab_size"] == 259 and saved["num_train_steps"] == 6
  assert sorted(os.listdir(os.path.join(trained, "checkpoints"))) == ["3", "6"]
  assert glob.glob(os.path.join(trained, "tensorboard", "events.out.tfevents.*"))


def test_evaluate_restores_the_latest_checkpoint(trained):
  result = evaluate.evaluate(str(trained))
  last_eval = [r for r in metrics_io.read_history(os.path.join(trained, "metrics.jsonl"))
               if "eval_loss" in r][-1]
  assert result["step"] == 6
  np.testing.assert_allclose(result["eval_loss"], last_eval["eval_loss"], rtol=1e-6)


def test_evaluate_w8a8_prints_the_quantised_loss_beside_the_full_precision_one(trained):
  result = evaluate.evaluate(str(trained), quantize_scheme="w8a8")
  full = evaluate.evaluate(str(trained))
  # The quantised evaluation scores the full logits (the head is quantised too); its
  # full-precision pass equals the chunked loss of a plain evaluation to float32 round-off.
  assert result["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-5)
  assert result["quantize"] == "w8a8" and "quantize" not in full
  assert result["quantized_eval_loss"] != result["eval_loss"]        # int8 changed the logits
  assert abs(result["quantized_loss_increase"]) < 0.05                 # ... but only a little
  assert result["quantized_loss_increase"] == pytest.approx(
      result["quantized_eval_loss"] - result["eval_loss"])
  with pytest.raises(ValueError, match="--quantize='int4' is unknown"):
    evaluate.evaluate(str(trained), quantize_scheme="int4")


@pytest.mark.slow
def test_evaluate_cli_prints_the_final_eval_loss(trained):
  out = subprocess.run([sys.executable, "-m", "simplified_flax.evaluate", f"--workdir={trained}"],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                       timeout=600, check=True)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  last_eval = [r for r in metrics_io.read_history(os.path.join(trained, "metrics.jsonl"))
               if "eval_loss" in r][-1]
  assert result["step"] == 6
  np.testing.assert_allclose(result["eval_loss"], last_eval["eval_loss"], rtol=1e-6)


def test_muon_run_resumes_exactly(tmp_path, data):
  """Rewound to its step-2 checkpoint and trained on, a Muon run ends bit for bit where it
  did straight: parameters, Muon momentum and Adam moments (the AdamW run's resume is
  test_resume.py's)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  run = {"optimizer.name": "muon", "num_train_steps": 4, "checkpoint_every_steps": 2}
  final = lambda: ocp.StandardCheckpointer().restore(
      os.path.join(tmp_path, "run", "checkpoints", "4", "state"))
  _train(tmp_path / "run", data, **run)
  straight = final()
  _train(tmp_path / "run", data, **run, restore_step=2)
  leaves_a = jax.tree_util.tree_leaves_with_path(straight)
  leaves_b = jax.tree_util.tree_leaves_with_path(final())
  assert len(leaves_a) == len(leaves_b) > 2 * len(jax.tree.leaves(straight["params"]))
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


def test_incompatible_config_refuses_to_resume_naming_the_field(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  with pytest.raises(compatibility.IncompatibleCheckpointError) as err:
    _train(workdir, data_of(trained), **TRAINED_RUN, **{
        "model.n_embd": 48, "model.dropout_rate": 0.1, "optimizer.learning_rate": 5e-4})
  message = str(err.value)
  assert "model.n_embd (saved 32, now 48)" in message
  assert "dropout_rate" not in message and "learning_rate" not in message
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]    # untouched
  assert not (workdir / checkpoints.CORRUPT_DIR).exists()


def test_interrupted_save_is_ignored(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  partial = workdir / "checkpoints" / "9.orbax-checkpoint-tmp-123"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "junk").write_bytes(b"\0" * 100)
  manager = checkpoints.make_manager(str(workdir), 3, 3)
  assert manager.latest_step() == 6
  manager.close()


def _truncate(step_dir: pathlib.Path) -> None:
  """Cuts every array data file of a checkpoint step in half (a torn copy or a full disk)."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files, f"no data files under {step_dir}"
  for p in files:
    with open(p, "r+b") as f:
      f.truncate(p.stat().st_size // 2)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(trained, tmp_path, caplog):
  workdir = _copy(trained, tmp_path)
  _truncate(workdir / "checkpoints" / "6")
  caplog.set_level("ERROR")
  _train(workdir, data_of(trained), **TRAINED_RUN)
  reports = [r.getMessage() for r in caplog.records if "truncated or corrupt" in r.getMessage()]
  assert len(reports) == 1 and "/6 " in reports[0] and "differs from the digest" in reports[0]
  assert [p.split("-")[0] for p in os.listdir(workdir / checkpoints.CORRUPT_DIR)] == ["6"]
  after, before = train_rows(workdir), train_rows(trained)   # resumed from 3: 4.. retrained
  assert sorted(after) == sorted(before) == [2, 4, 6]
  for step in before:
    assert [after[step][k] for k in ("loss", "learning_rate", "grad_norm")] == [
        before[step][k] for k in ("loss", "learning_rate", "grad_norm")]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]


def test_no_restorable_checkpoint_is_an_error_and_moves_nothing(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  # Step 3 silently holds other, perfectly readable arrays (step 6's); step 6 is torn. Both
  # without their file digest (as saved before it existed): the decoded arrays are checked.
  for step in (3, 6):
    (workdir / "checkpoints" / str(step) / "digest.json").unlink()
  shutil.rmtree(workdir / "checkpoints" / "3" / "state")
  shutil.copytree(workdir / "checkpoints" / "6" / "state", workdir / "checkpoints" / "3" / "state")
  _truncate(workdir / "checkpoints" / "6")
  with pytest.raises(checkpoints.CheckpointError) as err:
    _train(workdir, data_of(trained), **TRAINED_RUN)
  message = str(err.value)
  assert "step 6: its state cannot be read" in message
  assert "step 3: its state fingerprint" in message and "Nothing was moved" in message
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  with pytest.raises(NonFiniteLossError, match=r"Non-finite loss at step 8 "):
    # Step 7 trains from the good step-6 weights with an absurd learning rate; step 8 blows up.
    _train(workdir, data_of(trained), **{**TRAINED_RUN, "num_train_steps": 12,
                                         "optimizer.learning_rate": 1e30,
                                         "optimizer.warmup_steps": 0,
                                         "optimizer.schedule": "constant"})
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
  assert max(train_rows(workdir)) == 6
  manager = checkpoints.make_manager(str(workdir), 3, 3)
  state = manager.restore(6, args=checkpoints.ocp.args.Composite(
      state=checkpoints.ocp.args.StandardRestore()))["state"]
  manager.close()
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
