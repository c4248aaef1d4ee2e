"""Masked-language-model batches as in BERT (Devlin et al. 2019, §3.1): each regular token
(never padding, eod or another special id) is selected with probability `rate`, then becomes
[MASK] 80% of the time, a random regular token 10%, itself 10%; the loss is scored exactly at
the selected positions. The draws are made for the whole global batch and sliced per process.
"""
from typing import NamedTuple

import numpy as np

MASK_FRACTION = 0.8     # of selected tokens, replaced by [MASK]
RANDOM_FRACTION = 0.1   # of selected tokens, replaced by a random regular token (rest: kept)


class MaskNoise(NamedTuple):
  """The random draws behind one batch's masks."""
  select_BxT: np.ndarray       # float in [0, 1): selected where < rate
  replace_BxT: np.ndarray      # float in [0, 1): which of the 80/10/10 replacements
  random_ids_BxT: np.ndarray   # int32 regular ids for the 10% random replacement


def draw_noise(rng: np.random.Generator, shape: tuple[int, int], first_regular_id: int,
               vocab_size: int, rows: slice = slice(None)) -> MaskNoise:
  """The draws for a whole batch of `shape`, then only its `rows` (this process's part)."""
  return MaskNoise(rng.random(shape, dtype=np.float32)[rows],
                   rng.random(shape, dtype=np.float32)[rows],
                   rng.integers(first_regular_id, vocab_size, shape, dtype=np.int32)[rows])


def apply_mask(tokens_BxT: np.ndarray, noise: MaskNoise, *, rate: float, mask_id: int,
               first_regular_id: int) -> dict[str, np.ndarray]:
  """{"inputs": masked int32[B,T], "targets": int32[B,T], "weights": float32[B,T]}; special
  ids (padding included) are never selected, so never masked or scored."""
  selected_BxT = (noise.select_BxT < rate) & (tokens_BxT >= first_regular_id)
  to_mask_BxT = selected_BxT & (noise.replace_BxT < MASK_FRACTION)
  to_random_BxT = selected_BxT & (noise.replace_BxT >= MASK_FRACTION) & (
      noise.replace_BxT < MASK_FRACTION + RANDOM_FRACTION)
  inputs_BxT = np.where(to_mask_BxT, mask_id, tokens_BxT)
  inputs_BxT = np.where(to_random_BxT, noise.random_ids_BxT, inputs_BxT)
  return {"inputs": inputs_BxT.astype(np.int32), "targets": tokens_BxT.astype(np.int32),
          "weights": selected_BxT.astype(np.float32)}
