"""Bracketing each variant's best value before it is compared (`--best_of=FIELD --extend=N`).

Where a variant's best value of a numeric grid field (comparison.best_by_rest: the lowest mean
final loss among the values where every seed learned) is the smallest or largest value its
runs tried, a value beyond that edge may be better still, and a verdict at the edge would
compare a point of the grid, not an optimum. So the sweep adds the next value beyond it, one
grid step further, for that variant (and that point of the other grid fields) alone, runs its
seeds, and looks again, until the best is inside the values tried or N values have been added.
A step is the grid's own: its ratio for a geometric grid (1e-3, 2e-3, 4e-3 -> 8e-3, or 5e-4),
its difference for an arithmetic one; for any other grid the outermost step on that side.
"""
import math
from typing import Sequence

from simplified_flax.sweeps import comparison


def _close(a: float, b: float) -> bool:
  return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _clean(value: float, like) -> float | int:
  """`value` at 12 significant digits (so 0.004 * 2 reads as 0.008), an int for an int grid."""
  if isinstance(like, int):
    return int(round(value))
  return float(f"{value:.12g}")


def next_value(grid: Sequence, tried: Sequence, side: str):
  """The value one grid step beyond the `side` ("low" or "high") edge of the values `tried`;
  None where the grid has no step (one value) or the step leaves the field's domain (a
  geometric grid stays positive; an int grid must move)."""
  grid = sorted(grid)
  if len(grid) < 2 or not comparison.numeric(grid):
    return None
  ratios = [b / a for a, b in zip(grid, grid[1:])] if grid[0] > 0 else []
  differences = [b - a for a, b in zip(grid, grid[1:])]
  geometric = bool(ratios) and all(_close(r, ratios[0]) for r in ratios)
  arithmetic = all(_close(d, differences[0]) for d in differences)
  if geometric or not arithmetic and ratios:   # irregular positive grid: the outer ratio
    ratio = ratios[0] if geometric else (ratios[0] if side == "low" else ratios[-1])
    edge = min(tried) if side == "low" else max(tried)
    value = edge / ratio if side == "low" else edge * ratio
  else:
    step = differences[0] if arithmetic else (differences[0] if side == "low" else
                                              differences[-1])
    edge = min(tried) if side == "low" else max(tried)
    value = edge - step if side == "low" else edge + step
  value = _clean(value, grid[0])
  if value in tried:   # an int grid whose step rounds to nothing
    return None
  return value


def needed(groups, field: str, grid_values: Sequence, limit: int) -> list[tuple]:
  """[(variant, other fields' point, value)]: for each variant whose best `field` value is at
  the edge of the values its runs tried, the next value beyond that edge, while fewer than
  `limit` values outside the grid have been tried for it. Groups not run yet give none (their
  results decide)."""
  out = []
  for (variant, rest), (best, by_value) in comparison.best_by_rest(groups, field).items():
    if best is None or not comparison.at_edge(best, by_value):
      continue
    if any(c.status == "not run" for group in by_value.values() for c in group):
      continue
    added = [v for v in by_value if not any(_close(v, g) for g in grid_values)]
    if len(added) >= limit:
      continue
    side = "low" if best == min(by_value) else "high"
    value = next_value(grid_values, list(by_value), side)
    if value is not None:
      out.append((variant, rest, value))
  return out
