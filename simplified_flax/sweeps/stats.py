"""The sweep report's statistics: mean and spread over seeds, the paired t-interval against a
reference variant, and each variant at its own best value of a field.

A paired interval compares two variants seed by seed (the same seed gives both the same data
order and initial key stream), so the seed-to-seed variation they share cancels: with
per-seed differences d_1..d_n (variant minus reference), the 95% interval is
mean(d) ± t_{0.975, n-1} · sd(d) / sqrt(n). It excludes 0 when the two are separated at this
budget; it needs n >= 2.
"""
import dataclasses
import math
import statistics
from typing import Mapping, Sequence

from scipy import stats as scipy_stats


@dataclasses.dataclass(frozen=True)
class Paired:
  """Variant minus reference over `n` shared seeds: the mean difference and its interval."""
  n: int
  mean: float
  low: float | None      # None where n < 2 (no spread to estimate)
  high: float | None

  @property
  def excludes_zero(self) -> bool | None:
    return None if self.low is None else (self.low > 0 or self.high < 0)

  def verdict(self) -> str:
    """'lower' / 'higher' (the variant's loss, separated from the reference's) or 'not
    separated' (also with one seed, which has no spread to separate by)."""
    if not self.excludes_zero:
      return "not separated"
    return "lower" if self.high < 0 else "higher"


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
  """(mean, sample standard deviation) of the values; std None for fewer than two."""
  values = [v for v in values if v is not None]
  if not values:
    return None, None
  return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def paired_interval(reference: Mapping[int, float], variant: Mapping[int, float],
                    level: float = 0.95) -> Paired | None:
  """The t-interval of variant - reference over the seeds both have ({seed: final loss});
  None when they share no seed."""
  seeds = sorted(set(reference) & set(variant))
  diffs = [variant[s] - reference[s] for s in seeds]
  if not diffs:
    return None
  mean = statistics.mean(diffs)
  if len(diffs) < 2:
    return Paired(len(diffs), mean, None, None)
  half = (scipy_stats.t.ppf(0.5 + level / 2, len(diffs) - 1) * statistics.stdev(diffs)
          / math.sqrt(len(diffs)))
  return Paired(len(diffs), mean, mean - half, mean + half)


def best_value(losses_by_value: Mapping[object, Sequence[float | None]]):
  """The value whose mean final loss over seeds is lowest. A value with a failed or
  non-finite run (a diverged learning rate) never wins; None if every value has one."""
  def score(losses):
    if not losses or any(l is None or not math.isfinite(l) for l in losses):
      return math.inf
    return statistics.mean(losses)
  scored = {value: score(losses) for value, losses in losses_by_value.items()}
  finite = {v: s for v, s in scored.items() if math.isfinite(s)}
  return min(finite, key=finite.get) if finite else None
