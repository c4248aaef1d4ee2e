"""The experiment scripts: their plans, configs and reports (fast), and tiny end-to-end runs of
the training experiments (slow): each run a train command of the sweep package, a rerun
skipping finished runs, `--report_only` listing unfinished ones."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from test_loop import REPO, subprocess_env, write_corpus

sys.path.insert(0, str(REPO))
from experiments import baseline_comparison, depth_scaling, report_lib, throughput  # pylint: disable=wrong-import-position
from experiments import compile_depth  # pylint: disable=wrong-import-position
from experiments import outlier_features, outlier_report  # pylint: disable=wrong-import-position
from simplified_flax.sweeps import execute  # pylint: disable=wrong-import-position


# ------------------------------------------------------------------------------- report_lib

def test_parse_overrides_reads_literals_and_keeps_other_text():
  assert report_lib.parse_overrides(["model.n_layer=2", "data.name=text_files",
                                     "optimizer.learning_rate=3e-4", "data.paths=/a/*.txt"]) == {
      "model.n_layer": 2, "data.name": "text_files", "optimizer.learning_rate": 3e-4,
      "data.paths": "/a/*.txt"}
  with pytest.raises(ValueError, match="KEY=VALUE"):
    report_lib.parse_overrides(["model.n_layer"])


def test_mean_spread_and_markdown_table():
  assert report_lib.mean_spread([2.0]) == "2.000"
  assert report_lib.mean_spread([2.0, 2.1]) == "2.050 ± 0.071 (n=2)"   # the sample sd
  assert report_lib.mean_spread([]) == "-"
  assert report_lib.markdown_table(["a", "b"], [[1, 2]]) == ["| a | b |", "| --- | ---: |",
                                                             "| 1 | 2 |"]


# ---------------------------------------------------------------------------- the scripts

def test_baseline_plan_runs_every_variant_first_then_seeds_then_longer_budgets():
  runs = baseline_comparison.plan("cpu", baseline_comparison.VARIANTS, (1, 4))
  assert runs[:8] == [(v, 1, 0) for v in baseline_comparison.VARIANTS]
  assert runs[8:10] == [("preln", 1, 1), ("sas_p", 1, 1)]
  assert runs[10:] == [("preln", 4, 0), ("sas_p", 4, 0), ("sas", 4, 0), ("parallel", 4, 0),
                       ("op", 4, 0), ("value_skipinit", 4, 0), ("sas_p_nonorm", 4, 0)]
  config = baseline_comparison.make_config("cpu", "sas_p", 4, 1, 200)
  assert (config.num_train_steps, config.seed, config.model.n_layer) == (800, 1, 4)
  overrides = baseline_comparison.run_overrides("cpu", 4, 1, 200)
  assert (overrides["num_train_steps"], overrides["seed"], overrides["model.n_layer"]) == (
      800, 1, 4)


def _fake_run(variant, budget, seed, loss):
  history = [{"step": s, "loss": loss + 1 / s, "elapsed_s": float(s), "tokens_per_s": 1000.0,
              "learning_rate": 1e-3, "grad_norm": 1.0} for s in (10, 20, 30)]
  history.append({"step": 30, "eval_loss": loss})
  return {"variant": variant, "budget": budget, "seed": seed, "steps": 30 * budget,
          "params": 900 if variant == "preln" else 800, "final_eval_loss": loss,
          "final_train_loss": loss, "tokens_per_s": 1000.0, "train_s": 60.0,
          "history": history, "base_steps": 30, "batch_size": 4, "learning_rate": 1e-3,
          "eval_steps": 2, "model": {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                     "context_length": 16}}


def test_baseline_report_states_the_gap_and_its_trend(tmp_path):
  results = [_fake_run("preln", 1, 0, 2.0), _fake_run("preln", 1, 1, 2.1),
             _fake_run("sas_p", 1, 0, 2.3), _fake_run("sas_p", 1, 1, 2.35),
             _fake_run("preln", 4, 0, 1.5), _fake_run("sas_p", 4, 0, 1.6)]
  text = baseline_comparison.report(results, "cpu", (1, 4), "cmd", ["sas_x4_s0"], str(tmp_path),
                                    {"op_x1_s0": "simplified_flax.train: error: Non-finite"})
  assert "2.050 ± 0.071 (n=2)" in text
  assert "| `sas_p` | +0.275 | +0.100 | narrows |" in text
  # SAS-P minus Pre-LN per seed: +0.30, +0.25; the paired 95% t-interval (1 dof).
  assert "`sas_p` trails Pre-LN by 0.275 nats (paired over 2 seeds: 95% interval [-0.043, " \
         "+0.593], not separated)" in text
  assert "`sas_x4_s0`" in text
  assert "## Failed runs" in text and "- `op_x1_s0`: simplified_flax.train: error: Non-finite" \
      in text
  assert {p.name for p in tmp_path.iterdir()} == {
      "loss_vs_step_x1.png", "loss_vs_time_x1.png", "loss_vs_step_x4.png",
      "loss_vs_time_x4.png", "gap_to_preln.png"}


def test_depth_scaling_scales_the_mlp_gain_of_shaped_attention_only():
  deep = depth_scaling.make_config("cpu", "sas", 72)
  assert deep.model.mlp_block_resid_gain == pytest.approx(0.05)
  assert depth_scaling.make_config("cpu", "sas", 72, scale_mlp_gain=False
                                   ).model.mlp_block_resid_gain == pytest.approx(0.1)
  assert depth_scaling.make_config("cpu", "preln", 72).model.mlp_block_resid_gain == 1.0
  assert depth_scaling.run_overrides("cpu", "sas", 72)["model.mlp_block_resid_gain"] == \
      deep.model.mlp_block_resid_gain          # the train command gets the same float
  assert "model.mlp_block_resid_gain" not in depth_scaling.run_overrides("cpu", "preln", 72)


def test_throughput_report_from_benchmark_json(tmp_path):
  def bench(tokens_per_sec, params, speedup_paired):
    return {"tokens_per_sec": tokens_per_sec, "params_trainable": params, "step_time_s": 0.1,
            "speedup_paired": speedup_paired,
            "mfu": 0.2, "memory_bytes": 2**20, "batch_size": 8, "seq_len": 128, "n_layer": 6,
            "n_embd": 768, "vocab_size": 256, "dtype": "float32",
            "attention_impl": "explicit", "matmul_peak_flops_per_s": 1e11}
  text = throughput.report({"preln": bench(1000.0, 100, 1.0), "sas_p": bench(1200.0, 88, 1.25)},
                           "cpu", "cmd", str(tmp_path))
  # The speed column is the within-round (paired) ratio, not the ratio of median tokens/s.
  assert "| `sas_p` | 88 | 0.880 | 100 ms | 1,200 | 1.25 | 1.16 |" in text
  assert (tmp_path / "throughput.png").exists()
  command = throughput.benchmark_command("paper", ["preln", "sas"], "fused", {})
  assert "--configs=preln,sas" in command and "--config.model.n_layer=18" in command
  assert "--config.model.attention_impl=fused" in command


def _outlier_run(variant, optimizer, lr, loss, peak, increase):
  history = [{"step": s, "kurtosis/layer_0": peak * s / 20, "kurtosis/layer_1": peak * s / 40,
              "max_median_ratio/layer_0": 3.0, "max_median_ratio/layer_1": 4.0}
             for s in (10, 20)]
  return {"variant": variant, "optimizer": optimizer, "learning_rate": lr, "steps": 20,
          "final_eval_loss": loss, "fp_eval_loss": loss, "w8a8_eval_loss": loss + increase,
          "w8a8_increase": increase, "train_s": 60.0, "history": history, "batch_size": 4,
          "eval_steps": 2, "model": {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                     "context_length": 16},
          **outlier_features.kurtosis_summary(history)}


def test_outlier_features_picks_the_most_kurtotic_rate_that_still_trains():
  sweep = [_outlier_run("preln", "adamw", 1e-3, 2.0, 1.0, 0.01),
           _outlier_run("preln", "adamw", 1e-2, 2.2, 4.0, 0.05),
           _outlier_run("preln", "adamw", 3e-2, 2.9, 9.0, 0.30),     # trains too badly
           _outlier_run("op", "adamw", 1e-2, 2.1, 0.1, 0.01)]
  assert outlier_features.pick_lr(sweep, trains_within=0.25) == 1e-2
  assert outlier_features.pick_lr(sweep, trains_within=1.0) == 3e-2
  assert outlier_features.pick_lr(sweep[3:], trains_within=1.0) is None
  summary = sweep[1]
  assert (summary["peak_kurtosis"], summary["final_kurtosis"]) == (4.0, 4.0)
  assert summary["kurtosis_max_layer"] == [2.0, 4.0] and summary["peak_max_median"] == 4.0


def test_outlier_report_checks_the_papers_ratios_and_plots_each_run(tmp_path):
  runs = [_outlier_run("preln", "adamw", 1e-2, 2.2, 4.0, 0.06),
          _outlier_run("op", "adamw", 1e-2, 2.3, 0.5, 0.01),
          _outlier_run("preln", "muon", 1e-2, 2.25, 1.0, 0.02),
          {"variant": "op", "optimizer": "muon", "learning_rate": 1e-2, "diverged": True,
           "final_eval_loss": None}]
  sweep = runs[:2] + [_outlier_run("preln", "adamw", 1e-3, 2.4, 1.0, 0.01),
                      _outlier_run("preln", "adamw", 3e-2, 2.9, 9.0, 0.3)]
  text = outlier_report.report(runs, sweep, 1e-2, "cpu", "cmd", ["sas_p_adamw_lr0.01"],
                               str(tmp_path), 0.25)
  assert "Peak kurtosis, Pre-LN / OP (AdamW): **8.0x** (meets the 5x target)" in text
  assert "**6.0x** (meets the 3x target" in text
  assert "| OP + Muon | diverged |" in text
  assert "Pre-LN: Muon's peak kurtosis 1.00 vs AdamW's 4.00 (lower, as" in text
  assert "1.00 at 0.001, 4.00 at 0.01, 9.00 at 0.03: it grows with every step up" in text
  assert "Pre-LN + AdamW does not train at 0.03 (eval loss 2.900)" in text
  assert "| 0.01 | 8.0 | 6.0 | yes | yes |" in text
  assert "Agrees with the paper: peak kurtosis Pre-LN / OP is 8.0x (target 5x)" in text
  assert "Does not agree: Pre-LN + AdamW's kurtosis rises over training (2.00 -> 4.00) and OP's " \
         "rises (0.25 -> 0.50)" in text       # the made-up histories all rise
  assert "int8 is nearly free" not in text
  assert "Muon lowers the peak kurtosis of 1 of 1 blocks" in text
  assert "Both targets are met, with both blocks training, at 0.01." in text
  assert "`sas_p_adamw_lr0.01`" in text
  assert {p.name for p in tmp_path.iterdir()} == {
      "kurtosis_all.png", "kurtosis_preln_adamw.png", "kurtosis_op_adamw.png",
      "kurtosis_preln_muon.png", "lr_sweep.png"}


# ---------------------------------------------------------------------------- end to end

TINY_SETS = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.context_length=16",
             "batch_size=4", "eval_steps=1"]


def _script(name, args, tmp_path, data):
  sets = [f"--set={s}" for s in TINY_SETS] + [f"--set={k}={v}" for k, v in data.items()]
  return subprocess.run(
      [sys.executable, f"experiments/{name}.py", f"--output={tmp_path / 'out'}",
       f"--workdir_root={tmp_path / 'work'}", *args, *sets], cwd=REPO,
      env=subprocess_env(), capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_baseline_comparison_end_to_end_then_resumes_without_training(tmp_path):
  data = write_corpus(tmp_path / "corpus")
  args = ["--variants=preln,sas_p", "--budgets=1", "--base_steps=2", "--jobs=2"]
  first = _script("baseline_comparison", args, tmp_path, data)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "4 run(s) in" in first.stdout and "[4/4]" in first.stdout   # two variants x two seeds
  logs = {p.name: p.read_text() for p in (tmp_path / "work" / "logs").iterdir()}
  assert sorted(logs) == ["preln_x1_s0.log", "preln_x1_s1.log", "sas_p_x1_s0.log",
                          "sas_p_x1_s1.log"]
  result = json.loads((tmp_path / "out" / "results.json").read_text())
  assert [(r["variant"], r["seed"]) for r in result["runs"]] == [
      ("preln", 0), ("sas_p", 0), ("preln", 1), ("sas_p", 1)]
  assert all(r["steps"] == 2 and r["final_eval_loss"] > 0 for r in result["runs"])
  assert result["failed"] == {} and result["missing"] == []
  report = (tmp_path / "out" / "report.md").read_text()
  assert "## Budget 1x: 2 steps" in report and "(n=2)" in report
  assert "paired over 2 seeds" in report
  assert os.path.exists(tmp_path / "out" / "loss_vs_time_x1.png")

  again = _script("baseline_comparison", args, tmp_path, data)
  assert again.returncode == 0, again.stderr[-3000:]
  # Every run was finished: nothing trains (no log grows).
  assert "4 of 4 runs finished already (skipped); 0 to train" in again.stdout
  assert {p.name: p.read_text() for p in (tmp_path / "work" / "logs").iterdir()} == logs


@pytest.mark.slow
def test_depth_scaling_report_only_lists_unfinished_runs(tmp_path):
  data = write_corpus(tmp_path / "corpus")
  done = _script("depth_scaling", ["--variants=sas_p", "--depths=1", "--num_train_steps=2"],
                 tmp_path, data)
  assert done.returncode == 0, done.stderr[-3000:]
  partial = _script("depth_scaling", ["--variants=sas_p", "--depths=1,2",
                                      "--num_train_steps=2", "--report_only"], tmp_path, data)
  assert partial.returncode == 0, partial.stderr[-3000:]
  report = pathlib.Path(tmp_path / "out" / "report.md").read_text()
  assert "| `sas_p` | 1 |" in report and "`sas_p_L2`" in report


def test_compile_depth_times_each_depth_and_reports_the_ratio():
  tiny = {"model.n_embd": 32, "model.n_head": 2, "model.context_length": 16, "batch_size": 2,
          "model.scan_layers": True}
  seconds = compile_depth.compile_seconds("sas_p", tiny, (3,))
  assert list(seconds) == [3] and seconds[3] > 0
  text = compile_depth.report([{"variant": "sas_p", "scan_layers": True,
                                "seconds": {18: 2.0, 72: 3.0}}], "cmd")
  assert "| sas_p | True | 2.0 s | 3.0 s | 1.50x |" in text


def test_throughput_reuses_stored_results_only_for_the_same_settings(tmp_path):
  raw = tmp_path / "benchmark.json"
  explicit = throughput.benchmark_command("cpu", ["preln", "sas"], "explicit", {})
  raw.write_text(json.dumps({"settings": throughput.benchmark_settings(explicit),
                             "preln": {"mfu": 0.5}, "sas": {"mfu": 0.4}}))
  assert throughput.reusable_results(str(raw), explicit, ["sas"]) == {
      "preln": {"mfu": 0.5}, "sas": {"mfu": 0.4}}
  assert throughput.reusable_results(str(raw), explicit, ["sas_p"]) is None   # not measured
  fused = throughput.benchmark_command("cpu", ["preln", "sas"], "fused", {})
  assert throughput.reusable_results(str(raw), fused, ["sas"]) is None        # other settings
  deeper = throughput.benchmark_command("cpu", ["preln"], "explicit", {"model.n_layer": 2})
  assert throughput.reusable_results(str(raw), deeper, ["preln"]) is None
  assert throughput.reusable_results(str(tmp_path / "absent.json"), explicit, ["sas"]) is None


def test_depth_scaling_findings_state_gaps_and_trends_as_measured():
  loss = {("preln", 2): 2.0, ("preln", 8): 1.8, ("sas", 2): 2.4, ("sas", 8): 2.0,
          ("op", 2): 2.1, ("op", 8): 2.2}
  text = "\n".join(depth_scaling.findings(loss, (2, 8)))
  assert "`sas`: 0.400 behind Pre-LN at 2 layers, 0.200 behind at 8: the gap narrows" in text
  assert "8 layers improve its eval loss by 0.400 over 2" in text
  assert "`op`: 0.100 behind Pre-LN at 2 layers, 0.400 behind at 8: the gap widens" in text
  assert "8 layers worsen its eval loss by 0.100" in text
  assert "`preln`: 8 layers improve its eval loss by 0.200 over 2." in text


def _plan(tmp_path, names=("sas_p_L1",)):
  overrides = depth_scaling.run_overrides("cpu", "sas_p", 1, steps=3)
  return [(name, "sas_p:cpu", overrides, {"variant": "sas_p", "depth": 1}) for name in names]


def test_an_interrupted_sweep_stops_the_script_with_how_to_resume(tmp_path, monkeypatch, capsys):
  """SIGTERM stops the runs with their checkpoints; the experiment must not report those
  half-trained runs: it exits 0 saying how to resume."""
  calls = []
  monkeypatch.setattr(execute, "run_all", lambda runs, **kw: calls.append((runs, kw)) or
                      execute.Outcome(interrupted=True))
  with pytest.raises(report_lib.RunInterrupted) as stopped:
    report_lib.train_planned(_plan(tmp_path), str(tmp_path), report_only=False, jobs=1)
  assert stopped.value.code == 0
  assert "rerun the same command to resume" in capsys.readouterr().err
  (run,), kw = calls[0]
  assert run.workdir == f"{tmp_path}/sas_p_L1" and kw["log_dir"] == str(tmp_path / "logs")
  assert run.steps == 3 and "--config.num_train_steps=3" in run.command()


def test_failed_runs_are_reported_with_their_error_line(tmp_path, monkeypatch):
  error = "simplified_flax.train: error: Non-finite loss at step 2 (loss nan, grad norm nan)."
  monkeypatch.setattr(execute, "run_all", lambda runs, **kw: execute.Outcome(
      failed={"sas_p_L1": error}))
  trained = report_lib.train_planned(_plan(tmp_path, ("sas_p_L1", "sas_p_L2")), str(tmp_path),
                                     report_only=False, jobs=2)
  assert (trained.results, trained.missing, trained.failed) == ([], ["sas_p_L2"],
                                                                {"sas_p_L1": error})
  assert report_lib.failed_lines(trained.failed)[-2] == f"- `sas_p_L1`: {error}"
  with pytest.raises(SystemExit, match="sas_p_L1 failed: simplified_flax.train: error: Non"):
    report_lib.require_results(trained)
  with pytest.raises(SystemExit, match="1 run.s. failed: sas_p_L1"):
    report_lib.exit_if_failed(trained.failed)
  # outlier_features keeps a non-finite run as diverged, marked so that a rerun skips it.
  monkeypatch.setattr(report_lib, "train_planned", lambda planned, *a: report_lib.Trained(
      [], [], {p[0]: error for p in planned}))
  planned = [(name, "preln:cpu", {"num_train_steps": 3}, {"variant": "preln", "name": name})
             for name in ("preln_adamw_lr0.1_s3",)]
  measured, failed = outlier_features.train_and_measure(planned, str(tmp_path), False)
  assert failed == {} and measured["preln_adamw_lr0.1_s3"]["diverged"]
  assert (tmp_path / "preln_adamw_lr0.1_s3" / outlier_features.DIVERGED_FILE).exists()
  monkeypatch.setattr(report_lib, "train_planned", lambda planned, *a: report_lib.Trained(
      [], [], {}) if not planned else pytest.fail(f"trains {planned} again"))
  assert outlier_features.train_and_measure(planned, str(tmp_path), False)[0] == measured


def test_a_bad_override_or_jobs_is_one_line_before_anything_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(execute, "run_all", lambda runs, **kw: pytest.fail("ran"))
  bad = [("x", "sas_p:cpu", {"model.n_layers": 2}, {})]
  with pytest.raises(SystemExit, match="error: run x: .*n_layers"):
    report_lib.train_planned(bad, str(tmp_path), report_only=False)
  with pytest.raises(SystemExit, match="--jobs=0"):
    report_lib.train_planned(_plan(tmp_path), str(tmp_path), report_only=False, jobs=0)


@pytest.mark.slow
def test_outlier_features_end_to_end_then_reports_without_training(tmp_path):
  data = write_corpus(tmp_path / "corpus")
  args = ["--variants=preln,op", "--optimizers=adamw", "--sweep_lrs=1e-3",
          "--num_train_steps=4", "--jobs=2"]
  first = _script("outlier_features", args, tmp_path, data)
  assert first.returncode == 0, first.stderr[-3000:]
  result = json.loads((tmp_path / "out" / "results.json").read_text())
  assert result["learning_rate"] == 1e-3 and result["missing"] == []
  assert [(r["variant"], r["optimizer"]) for r in result["runs"]] == [("preln", "adamw"),
                                                                      ("op", "adamw")]
  for r in result["runs"]:
    assert r["peak_kurtosis"] >= r["final_kurtosis"] > 0 and len(r["kurtosis_steps"]) == 4
    assert abs(r["w8a8_eval_loss"] - r["fp_eval_loss"] - r["w8a8_increase"]) < 1e-9
    assert abs(r["fp_eval_loss"] - r["final_eval_loss"]) < 1e-4   # the loop's own last eval
  report = (tmp_path / "out" / "report.md").read_text()
  assert "| Pre-LN + AdamW |" in report and "Peak kurtosis, Pre-LN / OP (AdamW)" in report
  assert (tmp_path / "out" / "kurtosis_op_adamw.png").exists()

  again = _script("outlier_features", args + ["--report_only"], tmp_path, data)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "run(s) in" not in again.stdout and "full precision" not in again.stdout
