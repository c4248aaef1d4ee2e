"""Checkpoint helpers: the state fingerprint, config comparison, and the metrics history (its
cut on resume, TensorBoard's view of a resumed run)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, load_config
from simplified_flax.runs import checkpoints
from simplified_flax.runs import compatibility
from simplified_flax.runs import metrics_io


# ------------------------------------------------------------------------------------------
# Fingerprint.
# ------------------------------------------------------------------------------------------
def _tree():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(4, 3)).astype(np.float32), "step": np.int32(7),
          "h": rng.normal(size=(5,)).astype(jnp.bfloat16), "flag": np.array([True, False])}


def test_fingerprint_is_deterministic_and_input_type_independent():
  tree = _tree()
  a = int(checkpoints.fingerprint(tree))
  assert a == int(checkpoints.fingerprint(jax.tree.map(jnp.asarray, tree)))
  assert a == int(checkpoints.fingerprint(_tree()))


@pytest.mark.parametrize("change", ["flip_bit", "swap", "bf16", "int"])
def test_fingerprint_sees_any_change(change):
  tree = _tree()
  before = int(checkpoints.fingerprint(tree))
  if change == "flip_bit":
    bits = tree["w"].view(np.uint32)
    bits[2, 1] ^= 1                     # the last mantissa bit of one weight
  elif change == "swap":
    tree["w"][[0, 1]] = tree["w"][[1, 0]]
  elif change == "bf16":
    tree["h"][3] = tree["h"][3] + 1
  else:
    tree["step"] = np.int32(8)
  assert int(checkpoints.fingerprint(tree)) != before


# ------------------------------------------------------------------------------------------
# Config comparison.
# ------------------------------------------------------------------------------------------
def _config_dict(**model):
  config = load_config("preln")
  config.model.update(dict(TINY_MODEL, **model))
  return config.to_dict()


def test_config_differences_are_dotted():
  saved, new = _config_dict(), _config_dict(n_layer=3)
  new["optimizer"]["learning_rate"] = 5e-4
  assert compatibility.config_differences(saved, new) == {
      "model.n_layer": (2, 3), "optimizer.learning_rate": (1e-3, 5e-4)}


def test_only_fields_that_change_parameter_shapes_are_named():
  new = _config_dict(n_embd=48, dropout_rate=0.1, vocab_size=70)
  new["optimizer"]["learning_rate"] = 5e-4
  with pytest.raises(compatibility.IncompatibleCheckpointError,
                     match=r"through model.n_embd \(saved 32, now 48\), model.vocab_size "
                           r"\(saved \d+, now 70\) \(e.g."):
    compatibility.check_compatible(_config_dict(), new, "ckpt")


def test_check_compatible_raises_naming_fields_and_values():
  with pytest.raises(compatibility.IncompatibleCheckpointError,
                     match=r"model.n_layer \(saved 2, now 3\)"):
    compatibility.check_compatible(_config_dict(), _config_dict(n_layer=3), "ckpt")
  compatibility.check_compatible(_config_dict(), _config_dict(dropout_rate=0.1),
                               "ckpt")                     # shapes agree: only a warning


# ------------------------------------------------------------------------------------------
# Metrics history.
# ------------------------------------------------------------------------------------------
def test_cut_history_drops_later_and_torn_rows_and_moves_them_aside(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
  assert len(metrics_io.read_history(str(path))) == 5
  events = tmp_path / "tensorboard" / "events.out.tfevents.1.host"
  events.parent.mkdir()
  events.write_bytes(b"events")
  metrics_io.cut_history(str(tmp_path), 3, tmp_path / "aside")
  assert metrics_io.read_history(str(path)) == rows[:3]
  assert path.read_text().endswith("}\n")                       # the torn line is gone
  assert metrics_io.read_history(str(tmp_path / "aside" / "metrics.jsonl")) == rows[3:]
  assert (tmp_path / "aside" / "tensorboard" / events.name).read_bytes() == b"events"
  assert events.exists() and list(tmp_path.glob("**/*.tmp*")) == []


def test_tensorboard_shows_a_resumed_run_once_without_the_killed_runs_tail(tmp_path):
  # pylint: disable-next=g-import-not-at-top
  from tensorboard.backend.event_processing import event_accumulator
  killed = metrics_io.MetricsWriter(str(tmp_path))
  for step in range(1, 6):
    killed.write_scalars(step, {"loss": step})
  killed.flush()                     # never closed: the process is killed after this
  resumed = metrics_io.MetricsWriter(str(tmp_path), start_step=3)
  for step in range(4, 7):
    resumed.write_scalars(step, {"loss": 10 * step})
  resumed.close()
  assert len(list(tmp_path.glob("tensorboard/events.out.tfevents.*"))) == 2   # none rewritten
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()   # TensorBoard's own reader
  assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
      (1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (6, 60)]


def test_metrics_jsonl_gets_one_row_per_call_flushed_at_once(tmp_path):
  writer = metrics_io.MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write_scalars(10, {"loss": np.float32(2.5), "learning_rate": 1e-3})
  writer.write_scalars(10, {"eval_loss": 2.0})
  assert metrics_io.read_history(str(tmp_path / "metrics.jsonl")) == [    # before any close
      {"step": 10, "loss": 2.5, "learning_rate": 1e-3}, {"step": 10, "eval_loss": 2.0}]
  writer.close()
  assert not (tmp_path / "tensorboard").exists()


def test_format_duration():
  assert metrics_io.format_duration(4000) == "1h06m40s"
  assert metrics_io.format_duration(59) == "0m59s"
  assert metrics_io.format_duration(float("inf")) == "?"


# ------------------------------------------------------------------------------------------
# Data-state digest.
# ------------------------------------------------------------------------------------------
def _saved_steps(tmp_path, steps=(1, 2)):
  workdir = str(tmp_path / "w")
  manager = checkpoints.make_manager(workdir, max_to_keep=5, save_interval_steps=1,
                                     async_save=False)
  state = {"w": jnp.arange(6.0).reshape(2, 3)}
  for step in steps:
    checkpoints.save(manager, step, state, {"batches_drawn": step, "data": {"seed": 0}},
                     {}, {})
  checkpoints.finish(manager)   # as the loop does: the save, then each step's file digest
  manager.close()
  return workdir, state


def _rewrite(path, change):
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(change(saved), f)


@pytest.mark.parametrize("old_checkpoint", [False, True])
def test_a_changed_data_state_sets_the_step_aside_unless_it_predates_the_digest(
    tmp_path, old_checkpoint):
  workdir, state = _saved_steps(tmp_path)
  step_dir = tmp_path / "w" / checkpoints.CHECKPOINT_DIR / "2"
  _rewrite(step_dir / "data" / "metadata", lambda d: dict(d, batches_drawn=99))
  if old_checkpoint:   # saved before either digest existed
    (step_dir / "digest.json").unlink()
    _rewrite(step_dir / "meta" / "metadata",
             lambda m: {k: v for k, v in m.items() if k != "data_digest"})
  manager = checkpoints.make_manager(workdir, max_to_keep=5, save_interval_steps=1)
  restored = checkpoints.restore_latest(manager, jax.eval_shape(lambda: state), {}, workdir)
  manager.close()
  assert restored.step == (2 if old_checkpoint else 1)
  assert restored.data_state["batches_drawn"] == (99 if old_checkpoint else 1)
  aside = list((tmp_path / "w" / checkpoints.CORRUPT_DIR).glob("2-*"))
  assert len(aside) == (0 if old_checkpoint else 1)


def test_the_data_digest_survives_the_json_round_trip():
  assert checkpoints.data_digest({"a": np.int64(3), "b": (1, 2)}) == checkpoints.data_digest(
      json.loads(json.dumps({"b": [1, 2], "a": 3})))
  assert checkpoints.data_digest(None) == checkpoints.data_digest({})


def test_one_changed_byte_in_an_array_file_sets_the_step_aside_before_training(tmp_path,
                                                                                 caplog):
  """The step's file digest (written last) catches a byte that changed after the save, before
  Orbax decodes anything: the step is set aside with one line, the previous one restored."""
  workdir, state = _saved_steps(tmp_path)
  step_dir = tmp_path / "w" / checkpoints.CHECKPOINT_DIR / "2"
  data_files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  victim = max(data_files, key=lambda p: p.stat().st_size)
  raw = bytearray(victim.read_bytes())
  raw[len(raw) // 2] ^= 0x01
  victim.write_bytes(bytes(raw))
  caplog.set_level("ERROR")
  manager = checkpoints.make_manager(workdir, max_to_keep=5, save_interval_steps=1)
  restored = checkpoints.restore_latest(manager, jax.eval_shape(lambda: state), {}, workdir)
  manager.close()
  assert restored.step == 1
  np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(state["w"]))
  reports = [r.getMessage() for r in caplog.records if "truncated or corrupt" in r.getMessage()]
  assert len(reports) == 1 and "/2 " in reports[0] and victim.name in reports[0], reports
  assert len(list((tmp_path / "w" / checkpoints.CORRUPT_DIR).glob("2-*"))) == 1


def test_a_digest_left_half_written_by_a_kill_does_not_condemn_the_step(tmp_path):
  workdir, state = _saved_steps(tmp_path, steps=(1,))
  step_dir = tmp_path / "w" / checkpoints.CHECKPOINT_DIR / "1"
  (step_dir / "digest.json.tmp-123").write_text('{"fi')     # killed while writing a digest
  manager = checkpoints.make_manager(workdir, max_to_keep=5, save_interval_steps=1)
  restored = checkpoints.restore_latest(manager, jax.eval_shape(lambda: state), {}, workdir)
  manager.close()
  assert restored.step == 1
