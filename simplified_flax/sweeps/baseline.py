"""The loss a run must beat to have learned anything: the data's unigram cross-entropy.

A model that ignores its context can do no better than predict every token by its frequency.
Here that is measured as the runs measure themselves: the token frequencies of the training
shards (add-one smoothed over the vocabulary, so that no eval token has probability 0), scored
on the same eval batches, targets and weights as every run's final evaluation (the pipeline's
`eval_batches(config.eval_steps)`, `losses.targets_and_weights_BT`). A run whose final eval loss
is not below it by `LEARNED_MARGIN` nats did not learn: it gets no verdict and is never a best
value (comparison.py).

    nats = unigram_cross_entropy(config)   # reads prepared shards; trains nothing
"""
import math

from absl import logging
import numpy as np

from simplified_flax.data.errors import DataError

# How far below the unigram loss a run must end to count as learned: a model at the plateau
# sits within a few hundredths of it (DyT without its embedding scalar ended 0.002-0.009
# above it), and any run that learned context is tenths below.
LEARNED_MARGIN = 0.05


def _key(config) -> tuple:
  """What the unigram loss depends on: the data, the window, the batch and the eval batches
  (the same for every seed)."""
  return (repr(sorted(config.data.to_dict().items())), config.model.kind,
          config.model.context_length, config.batch_size, config.eval_steps)


def train_token_counts(prepared, vocab_size: int) -> np.ndarray:
  """int64[V]: how often each id occurs in every shard of a prepared split."""
  counts_V = np.zeros(vocab_size, np.int64)
  for index in range(prepared.num_shards):
    counts_V += np.bincount(np.asarray(prepared.shard(index).tokens_N), minlength=vocab_size)
  return counts_V


def scored_cross_entropy(log_probs_V: np.ndarray, batches, kind: str) -> float:
  """The weighted mean of -log p(target) over `batches`, with the targets and weights every
  run's evaluation scores (`losses.targets_and_weights_BT`)."""
  from simplified_flax.training import losses  # pylint: disable=import-outside-toplevel
  loss_sum, weight_sum = 0.0, 0.0
  for batch in batches:
    targets_BT, weights_BT = (np.asarray(a) for a in losses.targets_and_weights_BT(batch, kind))
    loss_sum += float(np.sum(-log_probs_V[targets_BT] * weights_BT))
    weight_sum += float(np.sum(weights_BT))
  if weight_sum == 0:
    raise ValueError("The eval batches score no token (eval_steps must be positive).")
  return loss_sum / weight_sum


def unigram_cross_entropy(config) -> float:
  """The unigram cross-entropy (nats per scored token) of `config`'s data on its eval batches.
  Builds the config's pipeline in this process (preparing the shards if no run has yet)."""
  from simplified_flax.data import build_pipeline  # pylint: disable=import-outside-toplevel
  config = config.copy_and_resolve_references()
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  vocab_size = pipeline.tokenizer.vocab_size
  counts_V = train_token_counts(pipeline.train.source.prepared, vocab_size) + 1
  log_probs_V = np.log(counts_V) - math.log(float(counts_V.sum()))
  return scored_cross_entropy(log_probs_V, pipeline.eval_batches(config.eval_steps),
                              config.model.kind)


class Baselines:
  """The unigram loss of each distinct data setting among a sweep's runs, computed once."""

  def __init__(self, compute=unigram_cross_entropy):
    self._compute = compute
    self._values: dict[tuple, float] = {}

  def of(self, config) -> float | None:
    """The unigram loss of `config`'s data; None (logged once) where its shards or tokenizer
    cannot be read here (a report made away from the data holds its runs to nothing)."""
    key = _key(config)
    if key not in self._values:
      try:
        self._values[key] = self._compute(config)
      except (DataError, OSError, ValueError) as error:
        logging.warning("No unigram loss for the sweep's data (%s): its runs are not checked "
                        "for learning.", error)
        self._values[key] = None
    return self._values[key]


def learned(loss: float | None, unigram: float | None, margin: float = LEARNED_MARGIN) -> bool:
  """Whether a final eval loss is finite and below the unigram loss by `margin` (True where
  no unigram loss is known: nothing to hold the run to)."""
  if loss is None or not math.isfinite(loss):
    return False
  return unigram is None or loss < unigram - margin
