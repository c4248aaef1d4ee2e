"""GLUE metrics on small inputs whose values are worked out by hand in the comments."""
import math

import numpy as np
import pytest

from simplified_flax.training import losses
from simplified_flax.glue import metrics

# TP = 3 (rows 0, 3, 5), FP = 1 (row 2), FN = 1 (row 4), TN = 1 (row 1).
PRED = [1, 0, 1, 1, 0, 1]
LABEL = [1, 0, 0, 1, 1, 1]


def test_accuracy():
  assert metrics.accuracy(PRED, LABEL) == pytest.approx(4 / 6)


def test_f1_of_the_positive_class():
  assert metrics.f1(PRED, LABEL) == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))   # 0.75


def test_binary_matthews():
  # (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (3 - 1) / sqrt(4 * 4 * 2 * 2) = 0.25
  assert metrics.matthews_corr(PRED, LABEL) == pytest.approx(0.25)


def test_multiclass_matthews():
  # c = 3 correct of s = 4; predicted counts p = (1, 1, 2), true counts t = (1, 2, 1):
  # (3*4 - p.t) / sqrt((16 - p.p)(16 - t.t)) = (12 - 5) / sqrt(10 * 10) = 0.7
  assert metrics.matthews_corr([0, 1, 2, 2], [0, 1, 1, 2]) == pytest.approx(0.7)


def test_pearson():
  # x - mean = (-1, 0, 1); y - mean = (-5/3, -2/3, 7/3): r = 4 / sqrt(2 * 78/9) = 12 / sqrt(156)
  assert metrics.pearson([1, 2, 3], [1, 2, 5]) == pytest.approx(12 / math.sqrt(156))


def test_spearman_averages_tied_ranks():
  # ranks x = (1, 2.5, 2.5, 4), y = (1, 3, 2, 4): r = 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
  assert metrics.spearman([10, 20, 20, 40], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9))


def test_spearman_is_one_for_any_increasing_map_pearson_is_not():
  x, y = [1, 2, 3, 4], [1, 8, 27, 64]
  assert metrics.spearman(x, y) == pytest.approx(1.0)
  assert metrics.pearson(x, y) < 0.99


def test_degenerate_inputs_score_zero_not_nan():
  constant, labels = [1, 1, 1, 1], [0, 1, 0, 1]
  assert metrics.matthews_corr(constant, labels) == 0.0
  assert metrics.pearson(constant, labels) == 0.0
  assert metrics.spearman(constant, labels) == 0.0
  assert metrics.f1([0, 0], [0, 0]) == 0.0


def test_compute_names_every_metric_and_rejects_unknown_ones():
  assert metrics.compute(["accuracy", "f1"], PRED, LABEL) == pytest.approx(
      {"accuracy": 4 / 6, "f1": 0.75})
  with pytest.raises(ValueError, match="Unknown task metric"):
    metrics.compute(["bleu"], PRED, LABEL)
  with pytest.raises(ValueError, match="equal, non-empty"):
    metrics.accuracy([1, 0], [1])


def test_mlm_accuracy_counts_weighted_argmax_hits():
  # Row 0: argmax (1, 0, 2) vs targets (1, 2, 2), weights (1, 1, 0) -> 1 hit of 2 scored.
  logits_BTV = np.array([[[0, 5, 0], [9, 0, 0], [0, 0, 1]]], np.float32)
  batch = {"targets": np.array([[1, 2, 2]]), "weights": np.array([[1.0, 1.0, 0.0]])}
  sums = losses.loss_sums(logits_BTV, batch, "encoder", with_correct=True)
  assert float(sums["correct_sum"]) == 1.0
  assert losses.mlm_accuracy({**sums, "weight_sum": 2.0}) == 0.5
  assert losses.mlm_accuracy({"correct_sum": 0.0, "weight_sum": 0.0}) == 0.0
