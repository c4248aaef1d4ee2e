"""Windows, packing and MLM masking on small hand-made arrays."""
import numpy as np
import pytest

from simplified_flax.data import mlm
from simplified_flax.data import sequences

EOD, PAD, MASK, FIRST_REGULAR, VOCAB = 1, 0, 2, 3, 259


def _split(*lengths):
  docs = [np.arange(100 * (i + 1), 100 * (i + 1) + n) for i, n in enumerate(lengths)]
  return docs, sequences.join_documents(np.concatenate(docs), np.array(lengths), EOD, VOCAB)


def test_join_documents_layout():
  docs, split = _split(3, 0, 2)
  assert split.tokens_N.tolist() == [100, 101, 102, EOD, 300, 301, EOD]
  assert split.doc_starts_D1.tolist() == [0, 4, 7]


def test_windows_are_exactly_t_and_drop_each_documents_tail():
  docs, split = _split(9, 3, 8)
  starts = sequences.window_starts(split, 4)
  windows = sequences.gather_windows(split.tokens_N, starts, 4)
  expected = [docs[0][0:4], docs[0][4:8], docs[2][0:4], docs[2][4:8]]
  np.testing.assert_array_equal(windows, np.stack(expected))
  assert windows.dtype == np.int32 and EOD not in windows


def test_packed_rows_restart_segments_and_pad_the_last_row():
  _, split = _split(5, 2, 3)  # stream: 5+1, 2+1, 3+1 = 13 tokens -> rows of 4: 4 rows
  assert sequences.num_packed_rows(len(split.tokens_N), 4) == 4
  tokens, segments = sequences.gather_packed_rows(split, np.arange(4), 4, PAD)
  assert tokens.tolist() == [[100, 101, 102, 103], [104, EOD, 200, 201],
                             [EOD, 300, 301, 302], [EOD, PAD, PAD, PAD]]
  assert segments.tolist() == [[1, 1, 1, 1], [1, 1, 2, 2], [1, 2, 2, 2], [1, 0, 0, 0]]
  # Any subset of rows, in any order, gives the same rows.
  tokens_31, segments_31 = sequences.gather_packed_rows(split, np.array([3, 1]), 4, PAD)
  np.testing.assert_array_equal(tokens_31, tokens[[3, 1]])
  np.testing.assert_array_equal(segments_31, segments[[3, 1]])


def test_large_vocab_uses_int32_storage():
  one = np.array([1])
  assert sequences.join_documents(np.array([70_000]), one, EOD, 80_000).tokens_N.dtype == np.int32
  assert sequences.join_documents(np.array([7]), one, EOD, 259).tokens_N.dtype == np.uint16


def _masked(tokens, rate, seed=0):
  noise = mlm.draw_noise(np.random.default_rng(seed), tokens.shape, FIRST_REGULAR, VOCAB)
  return mlm.apply_mask(tokens, noise, rate=rate, mask_id=MASK, first_regular_id=FIRST_REGULAR)


@pytest.mark.parametrize("rate", [0.15, 0.25])
def test_mlm_rate_and_80_10_10_split(rate):
  tokens = np.random.default_rng(1).integers(FIRST_REGULAR, VOCAB, (256, 128))
  batch = _masked(tokens, rate)
  n = tokens.size
  selected = batch["weights"] > 0
  # Binomial standard error at n=32768 is < 0.0025; allow 4 of them.
  assert abs(selected.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
  np.testing.assert_array_equal(batch["targets"], tokens)
  assert (batch["inputs"][~selected] == tokens[~selected]).all()
  is_mask = batch["inputs"][selected] == MASK
  kept = batch["inputs"][selected] == tokens[selected]
  m = selected.sum()
  assert abs(is_mask.mean() - 0.8) < 4 * np.sqrt(0.16 / m)
  assert abs(kept.mean() - 0.1) < 4 * np.sqrt(0.09 / m) + 1 / VOCAB  # random may equal itself
  random = ~is_mask & ~kept
  assert (batch["inputs"][selected][random] >= FIRST_REGULAR).all()


def test_mlm_never_masks_padding_or_special_tokens():
  tokens = np.random.default_rng(2).integers(FIRST_REGULAR, VOCAB, (64, 32))
  tokens[:, 20:] = PAD
  tokens[:, 10] = EOD
  batch = _masked(tokens, 0.9)
  special = tokens < FIRST_REGULAR
  assert (batch["weights"][special] == 0).all()
  np.testing.assert_array_equal(batch["inputs"][special], tokens[special])
  assert batch["weights"].dtype == np.float32 and batch["inputs"].dtype == np.int32


def test_mask_noise_of_some_rows_is_those_rows_of_the_whole_batch():
  noise = mlm.draw_noise(np.random.default_rng(0), (8, 4), FIRST_REGULAR, VOCAB)
  part = mlm.draw_noise(np.random.default_rng(0), (8, 4), FIRST_REGULAR, VOCAB, rows=slice(2, 6))
  np.testing.assert_array_equal(part.select_BxT, noise.select_BxT[2:6])
  np.testing.assert_array_equal(part.random_ids_BxT, noise.random_ids_BxT[2:6])
