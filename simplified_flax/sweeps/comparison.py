"""The sweep's numbers, from the runs' workdirs: each run collected (its summary or its error),
per grid point the final eval loss over seeds, against the reference variant the paired
95% t-interval (stats.paired_interval), and with `best_of` each variant at its own best value
of a field (the lowest mean over seeds). report.py renders them.
"""
import collections
import dataclasses
from typing import Sequence

from simplified_flax.sweeps import plan
from simplified_flax.sweeps import results
from simplified_flax.sweeps import stats


@dataclasses.dataclass
class Collected:
  """Each run of the plan with its summary (finished), its error line (failed), or neither."""
  run: plan.Run
  summary: dict | None = None
  error: str | None = None

  @property
  def loss(self) -> float | None:
    return self.summary["final_eval_loss"] if self.summary else None


def collect(runs: Sequence[plan.Run], failed: dict[str, str] | None = None,
            quantize: str | None = None) -> list[Collected]:
  """Reads every finished run's workdir (local or gs://): its summary, its peak activation
  kurtosis (when its diagnostics logged one) and, with `quantize`, its quantized loss increase."""
  out = []
  for run in runs:
    summary = None
    if results.is_finished(run.workdir, run.steps):
      summary = results.summarise(run.workdir)
      summary["peak_kurtosis"] = results.peak_kurtosis(summary["history"])
      quantized = results.quantized_eval(run.workdir, quantize) if quantize else None
      summary["quantized_loss_increase"] = (quantized or {}).get("quantized_loss_increase")
    out.append(Collected(run, summary, (failed or {}).get(run.name)))
  return out


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
    paired = stats.paired_interval(losses_by_seed(groups[(reference, point)]),
                                   losses_by_seed(group))
    rows.append(_paired_row(variant, dict(point), paired))
  return rows


def _paired_row(variant, point, paired) -> dict:
  """A variant against the reference at the same point (of the grid, or of its other fields)."""
  return {"variant": variant, "point": point, "reference_point": point,
          "n": paired.n if paired else 0, "mean_difference": paired.mean if paired else None,
          "low": paired.low if paired else None, "high": paired.high if paired else None,
          "verdict": paired.verdict() if paired else "no shared seed"}


def best_of_rows(groups, reference: str, field: str) -> list[dict]:
  """Each variant at its own best `field` value (for each value of the other grid fields),
  against the reference at its own best, paired by seed."""
  by_rest = collections.OrderedDict()
  for (variant, point), group in groups.items():
    rest = _without(point, field)
    by_rest.setdefault((variant, rest), {})[_value_of(point, field)] = group
  best = {}
  for key, by_value in by_rest.items():
    value = stats.best_value({v: [c.loss for c in g] for v, g in by_value.items()})
    best[key] = (value, by_value.get(value))
  rows = []
  for (variant, rest), (value, group) in best.items():
    ref_value, ref_group = best.get((reference, rest), (None, None))
    paired = None
    if variant != reference and group and ref_group:
      paired = stats.paired_interval(losses_by_seed(ref_group), losses_by_seed(group))
    losses = [c.loss for c in group] if group else []
    mean, sd = stats.mean_std(losses)
    row = _paired_row(variant, dict(rest), paired)
    values = sorted(by_rest[(variant, rest)])
    row.update({"best": value, "reference_best": ref_value, "final_eval_loss_mean": mean,
                "final_eval_loss_sd": sd, "is_reference": variant == reference,
                "best_at_grid_edge": value is not None and len(values) > 2
                                     and value in (values[0], values[-1])})
    rows.append(row)
  return rows


def tables(groups, reference: str, best_of: str | None) -> dict[str, list[dict]]:
  """The report's three tables, as results.json stores them: per grid point, paired against
  `reference`, and (with `best_of`, else empty) each variant at its own best."""
  return {"points": summary_rows(groups), "paired": paired_rows(groups, reference),
          "best_of_rows": best_of_rows(groups, reference, best_of) if best_of else []}
