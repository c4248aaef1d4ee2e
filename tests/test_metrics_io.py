"""What a run reports: TensorBoard tags grouped under train/ and eval/ with the config as text,
tokens/s and ETA without compilation, and a resume that changes the learning-rate schedule
saying so in one line."""
import json

import pytest

from simplified_flax.runs import metrics_io
from simplified_flax.runs import resume
from simplified_flax.train import train_and_evaluate
from test_loop import TINY, make_config, train_rows, write_corpus


def test_tensorboard_groups_the_loops_tags_and_shows_the_config_as_text(tmp_path):
  # pylint: disable-next=g-import-not-at-top
  from tensorboard.backend.event_processing import event_accumulator
  config_dict = {"seed": 3, "model": {"n_layer": 2, "kind": "decoder"}}
  writer = metrics_io.MetricsWriter(str(tmp_path), start_step=4, config_dict=config_dict)
  writer.write_scalars(5, {"loss": 2.5, "learning_rate": 1e-3, "eval_loss": 2.0,
                           "eval_perplexity": 7.4, "kurtosis/layer_0": 0.5})
  writer.close()
  events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"),
                                              size_guidance={"tensors": 0})
  events.Reload()   # TensorBoard's own reader, as its Scalars and Text tabs use it
  assert sorted(events.Tags()["scalars"] + events.Tags()["tensors"]) == [
      "config/text_summary", "eval/loss", "eval/perplexity", "kurtosis/layer_0",
      "train/learning_rate", "train/loss"]
  (config,) = events.Tensors("config/text_summary")
  assert config.step == 5                         # the first step the run trains
  text = config.tensor_proto.string_val[0].decode()
  assert text.splitlines() == ["    model.kind = 'decoder'", "    model.n_layer = 2",
                               "    seed = 3"]
  assert events.SummaryMetadata("config/text_summary").plugin_data.plugin_name == "text"
  assert events.Scalars("train/loss")[0].value == 2.5


def test_tokens_per_second_and_eta_leave_out_the_compiling_first_call(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(metrics_io.time, "time", lambda: now[0])
  progress = metrics_io.Progress(total_steps=30, start_step=0, tokens_per_step=1000)
  now[0] += 60.0                # the first call: compilation
  progress.restart_clock()
  now[0] += 10.0                # steps 1..10 at 1 step/s
  rates = progress.update(10)
  assert rates["tokens_per_s"] == pytest.approx(1000.0)
  assert rates["eta_s"] == pytest.approx(20.0)
  assert rates["elapsed_s"] == pytest.approx(70.0)   # wall-clock time includes it
  assert "1,000 tok/s | ETA 0m20s" in progress.line(10, 2.0, 1e-3, rates)


def _saved(**changes):
  config = {"num_train_steps": 40, "optimizer": {"learning_rate": 1e-3, "schedule": "linear",
                                                  "warmup_fraction": 0.05,
                                                  "warmup_steps": None, "b2": 0.95}}
  for key, value in changes.items():
    section, _, field = key.rpartition("__")
    (config[section] if section else config)[field] = value
  return config


def test_a_schedule_change_is_one_line_with_both_learning_rates():
  saved = _saved()
  assert resume.schedule_change(saved, _saved(), 20) is None
  assert resume.schedule_change(saved, _saved(optimizer__b2=0.98), 20) is None
  line = resume.schedule_change(saved, _saved(num_train_steps=80), 20)
  # linear: warm-up 2 steps of 40 (4 of 80), then decay to 0 at the last step
  before, after = 1e-3 * (1 - 18 / 38), 1e-3 * (1 - 16 / 76)
  assert line == (f"Learning-rate schedule changed on resume (num_train_steps 40 -> 80): step "
                  f"21 trains at lr {after:.3e} (the saved schedule: {before:.3e}) and the new "
                  f"schedule runs from there; set these fields back to keep the saved one.")
  line = resume.schedule_change(saved, _saved(optimizer__schedule="cosine",
                                                      optimizer__warmup_steps=0), 20)
  assert "optimizer.schedule 'linear' -> 'cosine', optimizer.warmup_steps None -> 0" in line


@pytest.mark.slow
def test_resuming_with_more_steps_prints_the_learning_rate_it_trains_at(tmp_path, capsys):
  base = {**TINY, **write_corpus(tmp_path), "checkpoint_every_steps": 4}
  workdir = str(tmp_path / "run")
  train_and_evaluate(make_config({**base, "num_train_steps": 4}), workdir, tensorboard=False)
  capsys.readouterr()
  train_and_evaluate(make_config({**base, "num_train_steps": 8}), workdir, tensorboard=False)
  out = capsys.readouterr().out
  (line,) = [l for l in out.splitlines() if l.startswith("Learning-rate schedule changed")]
  saved = json.load(open(f"{workdir}/config.json"))
  logged = train_rows(workdir)[5]["learning_rate"]     # the first update after the resume
  assert f"step 5 trains at lr {logged:.3e}" in line
  before = resume.learning_rate(dict(saved, num_train_steps=4), 4)
  assert f"(the saved schedule: {before:.3e})" in line
