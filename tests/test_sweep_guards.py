"""The sweep's guards against reporting an artifact as a finding: the data's unigram loss (what
a run must beat to have learned), "did not learn" for a run that did not beat it (or failed,
or diverged), and a best value at the edge of the grid bracketed by running the next value
beyond it, "unbracketed" where it still is an edge.

The sweeps here run through `driver.sweep` with `execute.run_all` replaced by a writer of each
run's workdir (its real config.json, and a metrics.jsonl whose final eval loss is a known
function of the learning rate): the guards read only those files, so the tests see exactly
which runs a round asks for, in a fraction of a second each. tests/test_sweep.py runs real
sweeps end to end (their tiny runs do not learn, and are reported so).
"""
import json
import math
import os

import numpy as np
import pytest

import configs
from simplified_flax import config_files
from simplified_flax.data import build_pipeline
from simplified_flax.sweeps import baseline
from simplified_flax.sweeps import comparison
from simplified_flax.sweeps import driver
from simplified_flax.sweeps import execute
from simplified_flax.sweeps import extension
from simplified_flax.sweeps import plan
from simplified_flax.sweeps import report
from simplified_flax.training import losses

TINY = ("--config.num_train_steps=4", "--config.model.n_layer=1", "--config.model.n_embd=16",
        "--config.model.n_head=2", "--config.model.context_length=16", "--config.batch_size=2",
        "--config.eval_every_steps=4", "--config.eval_steps=1")
UNIGRAM = 3.0   # the stand-in unigram loss these sweeps are held to


class FakeRuns:
  """`execute.run_all` writing each run's workdir: its config as the train command would save
  it, and a final eval loss of `loss(variant, learning rate, seed)`; records each round."""

  def __init__(self, loss):
    self.loss, self.rounds = loss, []   # each call: the names it trained

  def __call__(self, runs, *, jobs, log_dir, quantize=None):
    del jobs, log_dir, quantize
    self.rounds.append([])
    outcome = execute.Outcome()
    for run in runs:
      if os.path.exists(os.path.join(run.workdir, "metrics.jsonl")):
        continue   # finished before: skipped, as run_all skips it
      self.rounds[-1].append(run.name)
      config = plan._parse_config(run.config_spec, [*run.overrides])   # pylint: disable=protected-access
      config.model.vocab_size = 259   # as training saves it: the byte tokenizer's
      os.makedirs(run.workdir)
      with open(os.path.join(run.workdir, config_files.CONFIG_FILE), "w") as f:
        json.dump(config.to_dict(), f)
      loss = self.loss(run.variant, dict(run.point)["optimizer.learning_rate"], run.seed)
      with open(os.path.join(run.workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 4, "loss": loss, "tokens_per_s": 1.0, "elapsed_s": 1.0})
                + "\n" + json.dumps({"step": 4, "eval_loss": loss}) + "\n")
      outcome.finished.append(run.name)
    return outcome


def _bowl(best_rate: float, depth: float = 2.0):
  """A loss with its minimum at `best_rate`, rising by 0.1 per factor 2 away from it."""
  return lambda rate: depth + 0.1 * abs(math.log2(rate / best_rate))


def _sweep(tmp_path, fake, *, grid="1e-3,2e-3,4e-3", variants=("preln", "sas_p"), **kwargs):
  kwargs.setdefault("best_of", "optimizer.learning_rate")
  return driver.sweep(config_spec="preln:cpu", shared=list(TINY), variants=list(variants),
                      grid=[f"optimizer.learning_rate={grid}"], seeds=2,
                      workdir_root=str(tmp_path / "root"), output=str(tmp_path / "report"),
                      baselines=baseline.Baselines(lambda config: UNIGRAM), **kwargs)


def _results(tmp_path) -> dict:
  return json.load(open(tmp_path / "report" / "results.json"))


def _row(rows, variant):
  (row,) = [r for r in rows if r["variant"] == variant]
  return row


@pytest.fixture
def fake_runs(monkeypatch):
  """Installs a FakeRuns; the report's plots are left out (they read nothing the guards do)."""
  def install(loss):
    fake = FakeRuns(loss)
    monkeypatch.setattr(execute, "run_all", fake)
    monkeypatch.setattr(report, "plot", lambda groups, output: [])
    return fake
  return install


# ------------------------------------------------------------------------------------------
# Did not learn
# ------------------------------------------------------------------------------------------
def test_a_point_that_did_not_learn_gets_no_verdict_and_is_never_a_best_value(tmp_path,
                                                                            fake_runs):
  """sas_p at 1e-9 ends less than LEARNED_MARGIN below the unigram loss: that point's paired
  verdict is "did not learn", its grid point shows 0 of 2 learned, and its best is chosen
  among the values where it learned (preln at 1e-9 learned: it is held to the same rule)."""
  def loss(variant, rate, seed):
    if rate == 1e-9:   # sas_p below the unigram loss, but not clearly; preln clearly
      return (UNIGRAM - 0.01 - 0.001 * seed) if variant == "sas_p" else 2.5
    return _bowl(2e-3)(rate) + (0.05 if variant == "sas_p" else 0.0) + 0.002 * seed
  fake_runs(loss)
  assert _sweep(tmp_path, None, grid="1e-9,1e-3,2e-3,4e-3", extend=0) == 0
  results = _results(tmp_path)
  statuses = {r["name"]: r["status"] for r in results["runs"]}
  assert statuses["sas_p__learning_rate=1e-09__s0"] == "did not learn"
  assert statuses["preln__learning_rate=1e-09__s0"] == "learned"
  assert results["unigram_cross_entropy"] == [UNIGRAM]
  by_point = {(r["variant"], r["point"]["optimizer.learning_rate"]): r
              for r in results["paired"]}
  assert by_point[("sas_p", 1e-9)]["verdict"] == "did not learn"
  assert by_point[("sas_p", 2e-3)]["verdict"] == "higher"
  sas_p = _row(results["best_of_rows"], "sas_p")
  assert sas_p["best"] == 2e-3 and sas_p["verdict"] == "higher"
  points = {(r["variant"], r["point"]["optimizer.learning_rate"]): r for r in results["points"]}
  assert points[("sas_p", 1e-9)]["learned"] == 0 and points[("sas_p", 2e-3)]["learned"] == 2
  text = (tmp_path / "report" / "report.md").read_text()
  assert f"Unigram loss of the data: {UNIGRAM:.4f} nats per token" in text
  assert "| did not learn |" in text and "| 0 of 2 |" in text


def test_a_diverged_or_failed_run_does_not_learn_and_a_variant_with_no_learned_value_has_no_best():
  def collected(variant, rate, seed, loss, error=None):
    run = plan.Run(name=f"{variant}_{rate}_{seed}", variant=variant,
                   point=(("optimizer.learning_rate", rate),), seed=seed, config_spec=variant,
                   overrides=(), workdir="", steps=4)
    summary = None if error else {"final_eval_loss": loss}
    return comparison.Collected(run, summary, error, unigram=UNIGRAM)
  runs = [collected("preln", r, s, 2.0 + 0.1 * r + 0.01 * s) for r in (1.0, 2.0, 4.0) for s in (0, 1)]
  runs += [collected("dyt", r, s, UNIGRAM + 0.01) for r in (1.0, 2.0) for s in (0, 1)]
  runs += [collected("dyt", 4.0, 0, float("nan")), collected("dyt", 4.0, 1, None, "NaN loss")]
  assert [c.status for c in runs[-4:]] == ["did not learn"] * 2 + ["diverged", "failed"]
  groups = comparison.groups(runs)
  rows = comparison.best_of_rows(groups, "preln", "optimizer.learning_rate")
  dyt = _row(rows, "dyt")
  assert dyt["best"] is None and dyt["verdict"] == "did not learn"
  assert _row(rows, "preln")["verdict"] == "unbracketed"   # its best, 1.0, is the grid's edge
  assert {r["verdict"] for r in comparison.paired_rows(groups, "preln")} == {"did not learn"}


def test_the_unigram_loss_is_the_training_frequencies_scored_as_the_runs_score_their_eval(
    tmp_path):
  """On a corpus of a few local files: the counts are every training shard token's, and the
  loss equals the eval loss of a model whose logits are those log-frequencies at every
  position, computed by the training code's own loss (its targets and weights)."""
  for i in range(12):
    (tmp_path / f"doc{i}.txt").write_text(("abc" * (i + 3) + "xyz\n") * 40 + f"file {i}\n")
  config = configs.load("preln:cpu")
  config.data.name, config.data.paths = "text_files", str(tmp_path / "*.txt")
  config.data.cache_dir = str(tmp_path / "shards")
  config.model.context_length, config.batch_size, config.eval_steps = 16, 4, 3
  nats = baseline.unigram_cross_entropy(config)

  pipeline = build_pipeline(config.copy_and_resolve_references(), process_index=0,
                            process_count=1)
  prepared = pipeline.train.source.prepared
  tokens = np.concatenate([np.asarray(prepared.shard(i).tokens_N)
                           for i in range(prepared.num_shards)])
  counts = baseline.train_token_counts(prepared, pipeline.tokenizer.vocab_size)
  assert counts.sum() == len(tokens) == prepared.shard_num_tokens.sum()
  assert all(counts[t] == n for t, n in zip(*np.unique(tokens, return_counts=True)))
  log_probs_V = np.log(counts + 1.0) - np.log((counts + 1.0).sum())
  loss_sum = weight_sum = 0.0
  for batch in pipeline.eval_batches(config.eval_steps):
    logits_BTV = np.broadcast_to(log_probs_V, batch["inputs"].shape + log_probs_V.shape)
    sums = losses.loss_sums(logits_BTV, batch, "decoder")
    loss_sum, weight_sum = loss_sum + float(sums["loss_sum"]), weight_sum + float(
        sums["weight_sum"])
  assert nats == pytest.approx(loss_sum / weight_sum, rel=1e-5)
  assert 1.0 < nats < math.log(pipeline.tokenizer.vocab_size)


# ------------------------------------------------------------------------------------------
# Bracketing the best value
# ------------------------------------------------------------------------------------------
def test_next_value_takes_the_grids_own_step():
  assert extension.next_value([1e-3, 2e-3, 4e-3], [1e-3, 2e-3, 4e-3], "high") == 8e-3
  assert extension.next_value([1e-3, 2e-3, 4e-3], [1e-3, 2e-3, 4e-3, 8e-3], "high") == 1.6e-2
  assert extension.next_value([1e-3, 2e-3, 4e-3], [1e-3, 2e-3, 4e-3], "low") == 5e-4
  assert extension.next_value([0.1, 0.2, 0.3], [0.1, 0.2, 0.3], "high") == 0.4   # arithmetic
  assert extension.next_value([2, 4, 8], [2, 4, 8], "high") == 16
  assert extension.next_value([1e-3, 3e-3, 1e-2], [1e-3, 3e-3, 1e-2], "high") == pytest.approx(
      1e-2 * 10 / 3)   # an irregular grid: its outermost ratio on that side
  assert extension.next_value([1e-3], [1e-3], "high") is None   # one value: no step


def test_an_edge_best_extends_the_grid_runs_only_the_new_runs_and_is_bracketed(tmp_path,
                                                                             fake_runs):
  """preln's best is below the grid (5e-4), sas_p's above it (8e-3): the first extension
  round trains 5e-4 for preln and 8e-3 for sas_p (their seeds only), the second 2.5e-4 and
  1.6e-2, after which both bests are inside the values tried and get a verdict. A rerun of
  the same sweep trains nothing and writes the same report."""
  fake = fake_runs(lambda variant, rate, seed: _bowl(5e-4 if variant == "preln" else 8e-3)(
      rate) + (0.0 if variant == "preln" else -0.2) + 0.003 * seed)
  assert _sweep(tmp_path, fake) == 0
  assert len(fake.rounds) == 3 and len(fake.rounds[0]) == 12
  assert sorted(fake.rounds[1]) == ["preln__learning_rate=0.0005__s0",
                                    "preln__learning_rate=0.0005__s1",
                                    "sas_p__learning_rate=0.008__s0",
                                    "sas_p__learning_rate=0.008__s1"]
  assert sorted(fake.rounds[2]) == ["preln__learning_rate=0.00025__s0",
                                    "preln__learning_rate=0.00025__s1",
                                    "sas_p__learning_rate=0.016__s0",
                                    "sas_p__learning_rate=0.016__s1"]
  results = _results(tmp_path)
  preln, sas_p = (_row(results["best_of_rows"], v) for v in ("preln", "sas_p"))
  assert (preln["best"], sas_p["best"]) == (5e-4, 8e-3)
  assert preln["tried"] == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
  assert sas_p["tried"] == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
  assert not sas_p["best_at_grid_edge"] and sas_p["verdict"] == "lower"
  assert sas_p["mean_difference"] == pytest.approx(-0.2)
  assert preln["verdict"] is None   # the reference, bracketed: no guard applies
  report_text = (tmp_path / "report" / "report.md").read_text()

  fake.rounds.clear()
  assert _sweep(tmp_path, fake) == 0
  assert fake.rounds == [[], [], []]   # the same three rounds, each with nothing to train
  assert (tmp_path / "report" / "report.md").read_text() == report_text


def test_an_edge_best_that_stays_an_edge_is_unbracketed(tmp_path, fake_runs):
  """With --extend=0 nothing is added, and a best at the grid's edge is "unbracketed" (for
  the variant, and for every variant compared with a reference whose best is so); with
  --extend=1 one value is added and the best, still at the new edge, stays unbracketed."""
  fake = fake_runs(lambda variant, rate, seed: _bowl(1.0)(rate) - 0.1 * (variant == "sas_p")
                   + 0.003 * seed)
  assert _sweep(tmp_path, fake, extend=0) == 0
  assert len(fake.rounds) == 1
  rows = _results(tmp_path)["best_of_rows"]
  assert {r["verdict"] for r in rows} == {"unbracketed"}
  assert _row(rows, "sas_p")["best"] == 4e-3 and _row(rows, "sas_p")["best_at_grid_edge"]
  text = (tmp_path / "report" / "report.md").read_text()
  assert "| 0.004 (edge) |" in text and "| reference (unbracketed) |" in text

  assert _sweep(tmp_path, fake, extend=1) == 0
  assert sorted(fake.rounds[-1]) == [f"{v}__learning_rate=0.008__s{s}" for v in ("preln", "sas_p")
                                     for s in (0, 1)]
  rows = _results(tmp_path)["best_of_rows"]
  assert [(r["best"], r["verdict"]) for r in rows] == [(8e-3, "unbracketed")] * 2


def test_print_gives_the_first_round_and_says_extension_needs_its_results(tmp_path, capsys):
  assert _sweep(tmp_path, None, print_only=True) == 0
  out, err = capsys.readouterr()
  assert len(out.splitlines()) == 12 and all("simplified_flax.train" in l for l in out.splitlines())
  assert "--best_of=optimizer.learning_rate extends the grid" in err
  assert "needs the results of the runs above" in err
