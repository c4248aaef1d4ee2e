"""GLUE task metrics as pure numpy functions of (predictions [N], labels [N]): accuracy, F1 of
class 1 (MRPC, QQP), Matthews correlation (CoLA), Pearson and Spearman correlation (STS-B).
Degenerate inputs (a constant vector, no positive predictions or labels) give 0.0, not NaN, as
in the GLUE scripts.
"""
from typing import Callable

import numpy as np
from scipy import stats


def accuracy(pred_N, label_N) -> float:
  pred_N, label_N = _pair(pred_N, label_N)
  return float(np.mean(pred_N == label_N))


def f1(pred_N, label_N, positive: int = 1) -> float:
  """2 TP / (2 TP + FP + FN) for class `positive`; 0.0 when that class never occurs."""
  pred_N, label_N = _pair(pred_N, label_N)
  tp = np.sum((pred_N == positive) & (label_N == positive))
  fp = np.sum((pred_N == positive) & (label_N != positive))
  fn = np.sum((pred_N != positive) & (label_N == positive))
  denominator = 2 * tp + fp + fn
  return float(2 * tp / denominator) if denominator else 0.0


def matthews_corr(pred_N, label_N) -> float:
  """(c s - sum_k p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)) over the confusion matrix
  (c: correct, s: samples, p_k / t_k: times class k is predicted / true); for two classes
  (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN))."""
  pred_N, label_N = _pair(pred_N, label_N)
  classes, inverse = np.unique(np.concatenate([pred_N, label_N]), return_inverse=True)
  n = len(pred_N)
  pred_ids, label_ids = inverse[:n], inverse[n:]
  predicted_K = np.bincount(pred_ids, minlength=len(classes)).astype(np.float64)
  true_K = np.bincount(label_ids, minlength=len(classes)).astype(np.float64)
  correct = float(np.sum(pred_ids == label_ids))
  covariance = correct * n - predicted_K @ true_K
  scale = np.sqrt((n * n - predicted_K @ predicted_K) * (n * n - true_K @ true_K))
  return float(covariance / scale) if scale else 0.0


def pearson(pred_N, label_N) -> float:
  pred_N, label_N = _pair(pred_N, label_N, dtype=np.float64)
  pred_N, label_N = pred_N - pred_N.mean(), label_N - label_N.mean()
  scale = np.sqrt(np.sum(pred_N ** 2) * np.sum(label_N ** 2))
  return float(np.sum(pred_N * label_N) / scale) if scale else 0.0


def spearman(pred_N, label_N) -> float:
  """Pearson correlation of the ranks; tied values share the mean of their ranks."""
  pred_N, label_N = _pair(pred_N, label_N, dtype=np.float64)
  return pearson(stats.rankdata(pred_N), stats.rankdata(label_N))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy, "f1": f1, "matthews_corr": matthews_corr, "pearson": pearson,
    "spearman": spearman,
}


def compute(names, pred_N, label_N) -> dict[str, float]:
  """{name: METRICS[name](pred_N, label_N)} for every name in `names`."""
  unknown = [n for n in names if n not in METRICS]
  if unknown:
    raise ValueError(f"Unknown task metric(s) {unknown}; known: {sorted(METRICS)}.")
  return {name: METRICS[name](pred_N, label_N) for name in names}


def _pair(a_N, b_N, dtype=None) -> tuple[np.ndarray, np.ndarray]:
  a_N, b_N = np.asarray(a_N, dtype=dtype).reshape(-1), np.asarray(b_N, dtype=dtype).reshape(-1)
  if a_N.shape != b_N.shape or a_N.size == 0:
    raise ValueError(f"Predictions {a_N.shape} and labels {b_N.shape} must be equal, non-empty "
                     f"vectors.")
  return a_N, b_N
