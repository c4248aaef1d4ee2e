"""Checks of one config value, each with a `description` for the line that names a refused
value: what the speed package verified (fast/plan.py) and what the authors' code expresses
(authors/expressible.py) are tables of these."""
import math
from typing import Any, Callable, Optional


def one_of(*values, has: Optional[str] = None) -> Callable[[Any], bool]:
  """A check that the value is one of `values` (of the same types: True is not 1); `has`:
  what the table's owner has, in words, where the values alone do not say it."""
  check = lambda v: v in values and type(v) in {type(x) for x in values}
  check.description = " or ".join(map(repr, values))
  check.values, check.has = values, has
  return check


def number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def number_or_none(v) -> bool:
  return v is None or number(v)


def positive_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v > 0


def rate(v) -> bool:
  return number(v) and 0 <= v < 1


number.description = "a finite number"
number_or_none.description = "None or a finite number"
positive_int.description = "a positive integer"
rate.description = "a number in [0, 1)"
BOOL = one_of(False, True)
