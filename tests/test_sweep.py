"""`python -m simplified_flax.sweep`: the grid, the runs, a kill and a rerun, the report."""
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from simplified_flax.sweeps import comparison
from simplified_flax.sweeps import driver
from simplified_flax.sweeps import execute
from simplified_flax.sweeps import plan
from simplified_flax.sweeps import report
from simplified_flax.sweeps import stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Four steps of a one-layer model, a checkpoint at step 2: a run is a few seconds, mostly
# start-up; the two seeds of a grid point share their compiled programs (the cache).
TINY = ("--config.num_train_steps=4", "--config.model.n_layer=1", "--config.model.n_embd=16",
        "--config.model.n_head=2", "--config.model.context_length=16", "--config.batch_size=2",
        "--config.log_every_steps=1", "--config.eval_every_steps=4", "--config.eval_steps=1",
        "--config.checkpoint_every_steps=2")
SWEEP = ("--config=sas_p:cpu", "--variants=preln,sas_p",
         "--grid=optimizer.learning_rate=1e-3,3e-3", "--seeds=2", *TINY)
RATES = (0.001, 0.003)


def _sweep_command(root, *extra):
  return [sys.executable, "-m", "simplified_flax.sweep", *SWEEP, f"--workdir_root={root}",
          *extra]


def _final_eval_loss(workdir) -> float:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
          if line.strip()]
  return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


def _finished(root) -> list[str]:
  names = []
  for name in os.listdir(root):
    metrics = os.path.join(root, name, "metrics.jsonl")
    if "__s" in name and os.path.exists(metrics) and '"eval_loss"' in open(metrics).read():
      names.append(name)
  return names


def _plan(root, *extra):
  return plan.build("sas_p:cpu", [*TINY, *extra], ["preln", "sas_p"],
                    ["optimizer.learning_rate=1e-3,3e-3"], 2, str(root))


@pytest.mark.slow
def test_a_sweep_killed_midway_reruns_to_the_same_results_and_reports_paired_intervals(
    tmp_path):
  """2 variants x 2 learning rates x 2 seeds, 2 at a time. Killed (SIGKILL, the whole process
  group) once two runs have finished, the same command finishes the sweep without retraining
  them; a run the kill cut short ends as its printed train command ends uninterrupted."""
  root = tmp_path / "sweep"
  first = subprocess.Popen(_sweep_command(root, "--jobs=2"), cwd=REPO, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 300
  while len(_finished(root) if root.exists() else []) < 2:
    assert first.poll() is None and time.monotonic() < deadline, "the sweep ended early"
    time.sleep(0.2)
  os.killpg(first.pid, signal.SIGKILL)
  first.wait()
  done_before = {n: open(root / n / "metrics.jsonl").read() for n in _finished(root)}
  assert 2 <= len(done_before) < 8
  started = {n for n in os.listdir(root) if "__s" in n}
  # The runs the kill cut short first (their workdirs exist), then those it kept from starting.
  cut_short = sorted(set(r.name for r in _plan(root)) - set(done_before),
                     key=lambda n: (n not in started, n))

  second = subprocess.run(_sweep_command(root, "--jobs=2", "--best_of=optimizer.learning_rate"),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stderr[-3000:]
  assert f"{len(done_before)} of 8 runs finished already (skipped)" in second.stdout
  progress = [line for line in second.stdout.splitlines() if line.startswith("[")]
  assert len(progress) == 8 - len(done_before) and progress[-1].startswith("[8/8] ")
  for name, text in done_before.items():   # not retrained: not one row added or rewritten
    assert open(root / name / "metrics.jsonl").read() == text

  # Each run trained the config its name says.
  runs = {r.name: r for r in _plan(root)}
  assert sorted(runs) == sorted(n for n in os.listdir(root) if "__s" in n)
  for name, run in runs.items():
    saved = json.load(open(root / name / "config.json"))
    assert (saved["model"]["kind"], saved["optimizer"]["learning_rate"], saved["seed"]) == (
        "decoder", dict(run.point)["optimizer.learning_rate"], run.seed)
    assert saved["model"]["centre_attn"] == (run.variant == "sas_p")

  # A run the kill cut short (or never started) equals its printed command run alone.
  alone = tmp_path / "alone"
  printed = subprocess.run(_sweep_command(root, "--print"), cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
  command = next(c for c in printed if c.endswith(f"/{cut_short[0]}"))
  args = [a for a in shlex.split(command)[3:] if not a.startswith("--workdir=")]
  subprocess.run([sys.executable, "-m", "simplified_flax.train", *args, f"--workdir={alone}"],
                 cwd=REPO, check=True, capture_output=True)
  assert _final_eval_loss(alone) == _final_eval_loss(root / cut_short[0])

  results = json.load(open(root / "report" / "results.json"))
  # Four steps learn nothing: every run ends above the data's unigram loss, so no comparison
  # gets a verdict other than "did not learn" (tests/test_sweep_guards.py: the guards).
  (unigram,) = results["unigram_cross_entropy"]
  assert all(r["final_eval_loss"] > unigram - 0.05 for r in results["runs"])
  assert [r["status"] for r in results["runs"]] == ["did not learn"] * 8
  assert {r["verdict"] for r in results["paired"] + results["best_of_rows"]} == {"did not learn"}
  assert results["reference"] == "preln" and len(results["paired"]) == 2
  for row in results["paired"]:
    rate = row["point"]["optimizer.learning_rate"]
    diffs = [_final_eval_loss(root / f"sas_p__learning_rate={rate:g}__s{s}")
             - _final_eval_loss(root / f"preln__learning_rate={rate:g}__s{s}") for s in (0, 1)]
    mean = sum(diffs) / 2
    half = 12.706204736 * abs(diffs[0] - diffs[1]) / 2   # t_{0.975,1} * sd / sqrt(2)
    assert row["n"] == 2 and row["mean_difference"] == pytest.approx(mean, abs=1e-12)
    assert (row["low"], row["high"]) == pytest.approx((mean - half, mean + half), abs=1e-9)
  assert [r["variant"] for r in results["best_of_rows"]] == ["preln", "sas_p"]
  text = (root / "report" / "report.md").read_text()
  assert "## Against `preln`, paired by seed" in text and "95% interval" in text
  assert text.count("![loss vs") == 4 and (root / "report" / "loss_vs_time_1.png").exists()


def test_print_gives_exactly_the_train_command_of_each_run(tmp_path, capsys):
  status = driver.sweep(config_spec="sas_p:cpu", shared=list(TINY), variants=["preln", "sas_p"],
                        grid=["optimizer.learning_rate=1e-3,3e-3"], seeds=2,
                        workdir_root=str(tmp_path / "root"), print_only=True)
  lines = capsys.readouterr().out.splitlines()
  assert status == 0 and len(lines) == 8 and not (tmp_path / "root").exists()
  seen = set()
  for line in lines:
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "simplified_flax.train"]
    flags = dict(w.split("=", 1) for w in words[3:])
    assert set(TINY) <= {f"{k}={v}" for k, v in flags.items()}
    seen.add((flags["--config"], float(flags["--config.optimizer.learning_rate"]),
              int(flags["--config.seed"]), flags["--workdir"].rsplit("/", 1)[1]))
  assert {(spec, rate, seed) for spec, rate, seed, _ in seen} == {
      (f"{v}:cpu", r, s) for v in ("preln", "sas_p") for r in RATES for s in (0, 1)}
  assert len({name for *_, name in seen}) == 8


@pytest.mark.parametrize("grid, seeds, shared, message", [
    (["optimizer.lerning_rate=1e-3"], 1, [], "no field 'optimizer.lerning_rate'; did you mean "
     "optimizer.learning_rate?"),
    (["optimizer.learning_rate=fast"], 1, [], "could not convert string to float: 'fast'"),
    (["optimizer.learning_rate=-1e-3"], 1, [], "optimizer.learning_rate=-0.001 must be a number "
     "> 0"),
    (["optimizer.learning_rate=1e-3,0.001"], 1, [], "would share the workdir"),
    (["optimizer.learning_rate=1e-3"], 0, [], "--seeds=0: the sweep would have no runs"),
    (["optimizer.learning_rate=1e-3,"], 1, [], "an empty value"),
    (["seed=0,1"], 1, [], "the seed is swept by --seeds=N"),
    (["optimizer.learning_rate=1e-3"], 1, ["--config.optimizer.learning_rate=1e-3"],
     "both set optimizer.learning_rate"),
])
def test_each_bad_grid_is_one_line_before_any_run(tmp_path, grid, seeds, shared, message):
  with pytest.raises(plan.SweepError) as raised:
    driver.sweep(config_spec="sas_p:cpu", shared=shared, variants=["preln", "sas_p"], grid=grid,
                 seeds=seeds, workdir_root=str(tmp_path / "root"))
  assert message in str(raised.value) and "\n" not in str(raised.value)
  assert not (tmp_path / "root").exists()


def test_a_bad_sweep_on_the_command_line_exits_2_with_one_line_and_starts_nothing(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "simplified_flax.sweep", "--config=sas_p:cpu",
       "--variants=preln,sas_p", "--grid=optimizer.learning_rate=1e-3,0.001",
       f"--workdir_root={tmp_path / 'root'}"], cwd=REPO, capture_output=True, text=True)
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.strip().startswith("simplified_flax.sweep: error: runs ")
  assert len(result.stderr.strip().splitlines()) == 1
  assert not (tmp_path / "root").exists()


def test_a_workdir_holding_another_config_is_refused_before_any_run(tmp_path):
  root = tmp_path / "root"
  name = _plan(root)[0].name
  (root / name).mkdir(parents=True)
  (root / name / "config.json").write_text(json.dumps({"optimizer": {"learning_rate": 0.5},
                                                        "num_train_steps": 4}))
  with pytest.raises(plan.SweepError, match=r"holds a run with optimizer.learning_rate=0.5, "
                     r"this sweep asks for 0.001: give another --workdir_root"):
    _plan(root)


def test_a_failed_run_is_reported_with_its_error_and_the_sweep_exits_1(tmp_path):
  root = tmp_path / "root"
  result = subprocess.run(
      [sys.executable, "-m", "simplified_flax.sweep", "--config=sas_p:cpu", *TINY,
       f"--grid=data.roots={tmp_path / 'no_such_folder'}", f"--workdir_root={root}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-2000:]
  assert "[1/1] " in result.stdout and "FAILED: simplified_flax.train: error: " in result.stdout
  results = json.load(open(root / "report" / "results.json"))
  assert results["runs"][0]["status"] == "failed"
  assert "no_such_folder" in results["runs"][0]["error"]
  assert "## Failed runs" in (root / "report" / "report.md").read_text()


def test_the_paired_interval_is_the_t_interval_of_the_per_seed_differences():
  reference = {0: 2.00, 1: 2.10, 2: 1.95, 3: 2.05}
  variant = {0: 2.03, 1: 2.11, 2: 1.99, 3: 2.09, 7: 9.0}   # seed 7: no partner, left out
  diffs = [0.03, 0.01, 0.04, 0.04]
  mean = 0.03
  sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)   # 0.014142...
  half = 3.182446305 * sd / 2                              # t_{0.975,3} * sd / sqrt(4)
  paired = stats.paired_interval(reference, variant)
  assert paired.n == 4 and paired.mean == pytest.approx(mean)
  assert (paired.low, paired.high) == pytest.approx((mean - half, mean + half))
  assert paired.low > 0 and paired.verdict() == "higher"
  assert stats.paired_interval({0: 1.0, 1: 1.2}, {0: 1.1, 1: 1.0}).verdict() == "not separated"
  assert stats.paired_interval({0: 1.0}, {0: 1.1}).verdict() == "not separated"   # one seed
  assert stats.paired_interval({0: 1.0}, {1: 1.1}) is None


def _collected(variant, rate, seed, loss):
  run = plan.Run(name=f"{variant}_{rate}_{seed}", variant=variant,
                 point=(("optimizer.learning_rate", rate),), seed=seed, config_spec=variant,
                 overrides=(), workdir="", steps=4)
  return comparison.Collected(run, None if loss is None else {"final_eval_loss": loss})


def test_best_of_compares_each_variant_at_its_own_best_value_and_a_diverged_value_never_wins():
  losses = {("preln", 1e-4): (3.1, 3.3), ("preln", 1e-3): (3.0, 3.2), ("preln", 3e-3): (2.8, 3.0),
            ("preln", 1e-2): (2.9, 3.1),
            ("sas_p", 1e-4): (3.5, 3.6), ("sas_p", 1e-3): (2.9, 3.1), ("sas_p", 3e-3): (1.0, math.nan),
            ("sas_p", 1e-2): (3.3, 3.4)}   # nan: diverged
  collected = [_collected(v, r, s, loss) for (v, r), pair in losses.items()
               for s, loss in enumerate(pair)]
  rows = comparison.best_of_rows(comparison.groups(collected), "preln", "optimizer.learning_rate")
  preln, sas_p = rows
  assert (preln["best"], sas_p["best"]) == (3e-3, 1e-3)
  assert sas_p["mean_difference"] == pytest.approx(0.1)   # (2.9-2.8 + 3.1-3.0) / 2
  assert (sas_p["low"], sas_p["high"]) == pytest.approx((0.1, 0.1))   # the same difference twice
  assert sas_p["verdict"] == "higher"


def test_jobs_split_a_hosts_gpus_or_tpu_chips_and_refuse_an_uneven_split():
  assert execute.device_slots(2, environ={}, gpus=["0", "1", "2", "3"], tpu_chips=0) == [
      {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
  tpu = execute.device_slots(4, environ={}, gpus=[], tpu_chips=4)
  assert [s["TPU_VISIBLE_CHIPS"] for s in tpu] == ["0", "1", "2", "3"]
  assert {s["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in tpu} == {"1,1,1"}
  assert len({s["TPU_PROCESS_PORT"] for s in tpu}) == 4
  assert execute.device_slots(2, environ={}, gpus=[], tpu_chips=0) == [{}, {}]
  with pytest.raises(plan.SweepError, match="--jobs=3 does not divide this host's 4 GPUs"):
    execute.device_slots(3, environ={}, gpus=["0", "1", "2", "3"], tpu_chips=0)
  with pytest.raises(plan.SweepError, match="--jobs=3 on this host's 4 TPU chips"):
    execute.device_slots(3, environ={}, gpus=[], tpu_chips=4)


def test_a_quantized_evaluation_and_the_peak_kurtosis_reach_the_report(tmp_path):
  """--quantize=w8a8 evaluates each finished run once more (beside it, in eval_w8a8.json), a
  rerun evaluates a finished run that lacks it; runs that log diagnostics get a peak-kurtosis
  column: the largest `kurtosis/layer_i` of any logged step."""
  root = tmp_path / "root"
  command = [sys.executable, "-m", "simplified_flax.sweep", "--config=preln:cpu", *TINY,
             "--config.diagnostics_every=2", "--quantize=w8a8", f"--workdir_root={root}"]
  first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-2000:]
  (name,) = [n for n in os.listdir(root) if "__s" in n]
  evaluated = json.load(open(root / name / "eval_w8a8.json"))
  assert evaluated["quantize"] == "w8a8" and evaluated["step"] == 4
  os.remove(root / name / "eval_w8a8.json")
  again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-2000:]
  assert "0 to train, 1 at a time; 1 to evaluate (w8a8)." in again.stdout
  assert json.load(open(root / name / "eval_w8a8.json")) == evaluated
  rows = [json.loads(line) for line in open(root / name / "metrics.jsonl")]
  peak = max(v for r in rows for k, v in r.items() if k.startswith("kurtosis/"))
  (run,) = json.load(open(root / "report" / "results.json"))["runs"]
  assert run["peak_kurtosis"] == peak
  assert run["quantized_loss_increase"] == evaluated["quantized_loss_increase"]
  text = (root / "report" / "report.md").read_text()
  assert "| peak kurtosis | w8a8 loss increase |" in text
