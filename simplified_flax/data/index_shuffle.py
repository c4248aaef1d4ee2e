"""A seeded bijection of [0, n) evaluated one index at a time: a shuffle never materialised.
A balanced Feistel network on the smallest even number of bits covering n permutes
[0, 2^bits); cycle walking (reapply while >= n) restricts it to [0, n), under 4 walks per
index expected. m lookups cost O(m) whatever n is: `IndexShuffle(n, (seed, epoch))(ids)`.
"""
from typing import Sequence

import numpy as np

_ROUNDS = 4


def mix64(x_U64: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser, a fast well-mixing map of uint64 arrays (arithmetic wraps)."""
  x_U64 = (x_U64 ^ (x_U64 >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x_U64 = (x_U64 ^ (x_U64 >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x_U64 ^ (x_U64 >> np.uint64(31))


class IndexShuffle:
  """A bijection of [0, n) seeded by `key` (a sequence of non-negative ints)."""

  def __init__(self, n: int, key: Sequence[int]):
    if n < 1:
      raise ValueError(f"IndexShuffle needs n >= 1, got {n}.")
    self.n = int(n)
    half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
    self._half_bits = np.uint64(half_bits)
    self._half_mask = np.uint64((1 << half_bits) - 1)
    self._round_keys = np.random.SeedSequence(list(key)).generate_state(_ROUNDS, np.uint64)

  def _feistel(self, x_U64: np.ndarray) -> np.ndarray:
    left, right = x_U64 >> self._half_bits, x_U64 & self._half_mask
    for round_key in self._round_keys:
      left, right = right, left ^ (mix64(right ^ round_key) & self._half_mask)
    return (left << self._half_bits) | right

  def __call__(self, positions: np.ndarray) -> np.ndarray:
    """int64 images of `positions` (each in [0, n)), same shape."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= self.n):
      raise IndexError(f"IndexShuffle positions must lie in [0, {self.n}).")
    x_U64 = self._feistel(positions.astype(np.uint64))
    outside = x_U64 >= np.uint64(self.n)
    while outside.any():  # terminates: the cycle through x holds values < n
      x_U64[outside] = self._feistel(x_U64[outside])
      outside = x_U64 >= np.uint64(self.n)
    return x_U64.astype(np.int64)
