"""The sweep's numbers, from the runs' workdirs: each run collected (its summary or its error)
and held to the data's unigram loss (baseline.py), per grid point the final eval loss over
seeds, against the reference variant the paired 95% t-interval (stats.paired_interval), and
with `best_of` each variant at its own best value of a field (the lowest mean over seeds of the
values where every seed learned). report.py renders them.

A verdict is one of `VERDICTS`, and never "lower" or "higher" where it would report an
artifact: "did not learn" where a run of either side failed, diverged or ended within
`baseline.LEARNED_MARGIN` of the unigram loss; "unbracketed" where either side's best value is
the smallest or largest value of a numeric field its runs tried (a value beyond it may be
better still: the sweep extends the grid there first, extension.py).
"""
import collections
import dataclasses
from typing import Sequence

import ml_collections

from simplified_flax.sweeps import baseline
from simplified_flax.sweeps import plan
from simplified_flax.sweeps import results
from simplified_flax.sweeps import stats

VERDICTS = ("lower", "higher", "not separated", "did not learn", "unbracketed")
STATUSES = ("learned", "did not learn", "diverged", "failed", "not run")


@dataclasses.dataclass
class Collected:
  """Each run of the plan with its summary (finished), its error line (failed), or neither;
  `unigram`: its data's unigram loss (None: not known, and the run is held to nothing)."""
  run: plan.Run
  summary: dict | None = None
  error: str | None = None
  unigram: float | None = None

  @property
  def loss(self) -> float | None:
    return self.summary["final_eval_loss"] if self.summary else None

  @property
  def status(self) -> str:
    """One of `STATUSES`: "diverged" is a finished run whose final loss is not finite."""
    if self.error is not None:
      return "failed"
    if self.summary is None:
      return "not run"
    if not baseline.learned(self.loss, None):
      return "diverged"
    return "learned" if baseline.learned(self.loss, self.unigram) else "did not learn"


def collect(runs: Sequence[plan.Run], failed: dict[str, str] | None = None,
            quantize: str | None = None,
            baselines: baseline.Baselines | None = None) -> list[Collected]:
  """Reads every finished run's workdir (local or gs://): its summary, its peak activation
  kurtosis (when its diagnostics logged one), with `quantize` its quantized loss increase,
  and with `baselines` its data's unigram loss (from the config it trained)."""
  out = []
  for run in runs:
    summary, unigram = None, None
    if results.is_finished(run.workdir, run.steps):
      summary = results.summarise(run.workdir)
      summary["peak_kurtosis"] = results.peak_kurtosis(summary["history"])
      quantized = results.quantized_eval(run.workdir, quantize) if quantize else None
      summary["quantized_loss_increase"] = (quantized or {}).get("quantized_loss_increase")
      if baselines is not None:
        unigram = baselines.of(ml_collections.ConfigDict(summary["config"]))
    out.append(Collected(run, summary, (failed or {}).get(run.name), unigram))
  return out


def all_learned(group) -> bool:
  """Whether no run of a grid point's seeds failed, diverged or did not learn (runs not run
  yet aside) and at least one finished."""
  ran = [c for c in group if c.status != "not run"]
  return bool(ran) and all(c.status == "learned" for c in ran)


def groups(collected: Sequence[Collected]):
  """{(variant, point): [Collected of each seed]} in plan order."""
  groups = collections.OrderedDict()
  for c in sorted(collected, key=lambda c: c.run.seed):
    groups.setdefault((c.run.variant, c.run.point), []).append(c)
  variants = list(dict.fromkeys(c.run.variant for c in collected))
  return collections.OrderedDict(sorted(groups.items(), key=lambda kv: variants.index(kv[0][0])))


def losses_by_seed(group) -> dict[int, float]:
  return {c.run.seed: c.loss for c in group if c.loss is not None}


def _without(point, field):
  return tuple((f, v) for f, v in point if f != field)


def _value_of(point, field):
  return dict(point)[field]


def summary_rows(groups) -> list[dict]:
  rows = []
  for (variant, point), group in groups.items():
    finished = [c for c in group if c.summary]
    losses = [c.loss for c in finished]
    mean, sd = stats.mean_std(losses)
    speeds = [c.summary["tokens_per_s"] for c in finished if c.summary["tokens_per_s"]]
    kurtosis = [c.summary.get("peak_kurtosis") for c in finished]
    increase = [c.summary.get("quantized_loss_increase") for c in finished]
    times = [c.summary["train_s"] for c in finished if c.summary["train_s"]]
    rows.append({"variant": variant, "point": dict(point), "seeds": len(group),
                 "finished": len(finished), "failed": sum(c.error is not None for c in group),
                 "learned": sum(c.status == "learned" for c in group),
                 "final_eval_loss_mean": mean, "final_eval_loss_sd": sd,
                 "final_eval_losses": {c.run.seed: c.loss for c in finished},
                 "params": finished[0].summary["params"] if finished else None,
                 "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
                 "train_s": sum(times) / len(times) if times else None,
                 "peak_kurtosis": stats.mean_std(kurtosis)[0],
                 "quantized_loss_increase": stats.mean_std(increase)[0]})
  return rows


def paired_rows(groups, reference: str) -> list[dict]:
  """Each non-reference variant against the reference at the same grid point."""
  rows = []
  for (variant, point), group in groups.items():
    if variant == reference or (reference, point) not in groups:
      continue
    ref_group = groups[(reference, point)]
    paired = stats.paired_interval(losses_by_seed(ref_group), losses_by_seed(group))
    verdict = None if all_learned(group) and all_learned(ref_group) else "did not learn"
    rows.append(_paired_row(variant, dict(point), paired, verdict))
  return rows


def _paired_row(variant, point, paired, verdict: str | None = None) -> dict:
  """A variant against the reference at the same point (of the grid, or of its other fields):
  `verdict` where a guard gives one, else the interval's; None where no seed is shared yet."""
  if verdict is None and paired is not None:
    verdict = paired.verdict()
  return {"variant": variant, "point": point, "reference_point": point,
          "n": paired.n if paired else 0, "mean_difference": paired.mean if paired else None,
          "low": paired.low if paired else None, "high": paired.high if paired else None,
          "verdict": verdict}


def numeric(values) -> bool:
  """Whether every value of a grid field is a number (a field whose grid has edges)."""
  return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                              for v in values)


def best_by_rest(groups, field: str) -> dict:
  """{(variant, other fields' point): (best value or None, {value: group})}: the value with the
  lowest mean final loss among those where every seed learned (None: no value did)."""
  by_rest = collections.OrderedDict()
  for (variant, point), group in groups.items():
    rest = _without(point, field)
    by_rest.setdefault((variant, rest), {})[_value_of(point, field)] = group
  best = collections.OrderedDict()
  for key, by_value in by_rest.items():
    value = stats.best_value({v: [c.loss for c in g if c.status != "not run"]
                              for v, g in by_value.items() if all_learned(g)})
    best[key] = (value, by_value)
  return best


def at_edge(value, tried) -> bool:
  """Whether `value` is the smallest or largest of the numeric values `tried`."""
  values = sorted(tried)
  return value is not None and numeric(values) and value in (values[0], values[-1])


def best_of_rows(groups, reference: str, field: str) -> list[dict]:
  """Each variant at its own best `field` value (for each value of the other grid fields),
  against the reference at its own best, paired by seed: "did not learn" where either has no
  value at which every seed learned, "unbracketed" where either best is at the edge of the
  values its runs tried."""
  best = best_by_rest(groups, field)
  rows = []
  for (variant, rest), (value, by_value) in best.items():
    ref_value, ref_by_value = best.get((reference, rest), (None, {}))
    group, ref_group = by_value.get(value), ref_by_value.get(ref_value)
    edge = at_edge(value, by_value)
    paired, verdict = None, None
    if variant != reference and group and ref_group:
      paired = stats.paired_interval(losses_by_seed(ref_group), losses_by_seed(group))
    if value is None or ref_value is None:
      verdict = "did not learn"
    elif edge or at_edge(ref_value, ref_by_value):
      verdict = "unbracketed"
    losses = [c.loss for c in group] if group else []
    mean, sd = stats.mean_std(losses)
    row = _paired_row(variant, dict(rest), paired, verdict)
    row.update({"best": value, "reference_best": ref_value, "final_eval_loss_mean": mean,
                "final_eval_loss_sd": sd, "is_reference": variant == reference,
                "best_at_grid_edge": edge, "tried": sorted(by_value)})
    rows.append(row)
  return rows


def tables(groups, reference: str, best_of: str | None) -> dict[str, list[dict]]:
  """The report's three tables, as results.json stores them: per grid point, paired against
  `reference`, and (with `best_of`, else empty) each variant at its own best."""
  return {"points": summary_rows(groups), "paired": paired_rows(groups, reference),
          "best_of_rows": best_of_rows(groups, reference, best_of) if best_of else []}
