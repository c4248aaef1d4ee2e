"""GLUE tasks from tensorflow-datasets, encoded for the pretrained encoder.

    task = tasks.get_task("sst2")                    # or "glue/sst2"
    split = tasks.load_split(task, "train", tokenizer, seq_len=128)
    for batch in tasks.batches(split, 32, rng=np.random.default_rng(0)): ...

The pretraining tokenizers have no [CLS] or [SEP] token: a pair is `a <eod> b` (eod: the one
boundary token pretraining has seen), truncated longest-first as BERT does; rows are
right-padded and `key_mask` marks the real tokens.
"""
import dataclasses
from typing import Iterator, Sequence

import numpy as np

from simplified_flax.data.errors import DataError
from simplified_flax.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """One GLUE task of tensorflow-datasets' `glue` builder."""
  name: str                        # tfds config name, e.g. "sst2"
  text_keys: tuple[str, ...]       # one text (single sentence) or two (a pair)
  num_labels: int                  # 1: regression (STS-B), else the number of classes
  metrics: tuple[str, ...]         # names in metrics.METRICS
  eval_splits: tuple[str, ...] = ("validation",)

  @property
  def tfds_name(self) -> str:
    return f"glue/{self.name}"

  @property
  def is_regression(self) -> bool:
    return self.num_labels == 1


_ACC, _F1_ACC = ("accuracy",), ("f1", "accuracy")
TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", ("sentence",), 2, ("matthews_corr",)),
    GlueTask("sst2", ("sentence",), 2, _ACC),
    GlueTask("mrpc", ("sentence1", "sentence2"), 2, _F1_ACC),
    GlueTask("qqp", ("question1", "question2"), 2, _F1_ACC),
    GlueTask("stsb", ("sentence1", "sentence2"), 1, ("pearson", "spearman")),
    GlueTask("mnli", ("premise", "hypothesis"), 3, _ACC,
             ("validation_matched", "validation_mismatched")),
    GlueTask("qnli", ("question", "sentence"), 2, _ACC),
    GlueTask("rte", ("sentence1", "sentence2"), 2, _ACC),
    GlueTask("wnli", ("sentence1", "sentence2"), 2, _ACC),
)}
NOT_AVERAGED = ("wnli",)   # crammed BERT leaves WNLI out of its GLUE average


def get_task(name: str) -> GlueTask:
  """The task `name` ("sst2" or "glue/sst2")."""
  short = name.removeprefix("glue/")
  if short not in TASKS:
    raise ValueError(f"--task={name!r} is not a GLUE task; use one of {sorted(TASKS)}.")
  return TASKS[short]


def truncate_longest_first(lengths: Sequence[int], budget: int) -> list[int]:
  """Lengths after removing tokens one at a time from the longest text until they fit."""
  lengths = list(lengths)
  while sum(lengths) > budget:
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))  # ties: the first
    lengths[longest] -= 1
  return lengths


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str], seq_len: int) -> np.ndarray:
  """int32[<= seq_len]: `a` or `a <eod> b`, truncated longest-first."""
  pieces = [np.asarray(tokenizer.encode(t), np.int32) for t in texts]
  separators = len(pieces) - 1
  if seq_len <= separators:
    raise ValueError(f"A sequence length of {seq_len} cannot hold {len(pieces)} texts.")
  kept = truncate_longest_first([len(p) for p in pieces], seq_len - separators)
  parts = [pieces[0][:kept[0]]]
  for piece, n in zip(pieces[1:], kept[1:]):
    parts += [np.asarray([tokenizer.eod_id], np.int32), piece[:n]]
  return np.concatenate(parts)


@dataclasses.dataclass(frozen=True)
class EncodedSplit:
  """N examples as fixed-length rows (right-padded)."""
  inputs_NT: np.ndarray      # int32
  key_mask_NT: np.ndarray    # bool: True on real tokens
  labels_N: np.ndarray        # int32 class ids, or float32 scores (regression)

  def __len__(self) -> int:
    return len(self.labels_N)


def encode_examples(tokenizer: Tokenizer, task: GlueTask, columns: dict[str, Sequence[str]],
                    labels, seq_len: int) -> EncodedSplit:
  """Encodes the text columns `task.text_keys` of `columns` with their labels."""
  n = len(labels)
  inputs_NT = np.full((n, seq_len), tokenizer.pad_id, np.int32)
  key_mask_NT = np.zeros((n, seq_len), bool)
  for row in range(n):
    ids = encode_texts(tokenizer, [columns[k][row] for k in task.text_keys], seq_len)
    inputs_NT[row, :len(ids)] = ids
    key_mask_NT[row, :len(ids)] = True
  # An empty text would leave a row with no key to attend to: give it one pad token.
  key_mask_NT[:, 0] = True
  label_dtype = np.float32 if task.is_regression else np.int32
  return EncodedSplit(inputs_NT, key_mask_NT, np.asarray(labels, label_dtype))


def load_split(task: GlueTask, split: str, tokenizer: Tokenizer, seq_len: int, *,
               data_dir: str | None = None, max_examples: int = 0) -> EncodedSplit:
  """`split` of the task from tfds (prepared, or downloaded); with `max_examples` > 0 only the
  first that many examples."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel  (slow import)
  try:
    builder = tfds.builder(task.tfds_name, data_dir=data_dir)
    builder.download_and_prepare()
    dataset = builder.as_dataset(split=split, shuffle_files=False)
  except Exception as e:  # tfds reports network, disk and split errors many ways
    raise DataError(
        f"GLUE task '{task.tfds_name}' split '{split}' is not available in "
        f"'{data_dir or '~/tensorflow_datasets'}' ({type(e).__name__}: {e}). On a host with "
        f"network run `tfds build {task.tfds_name} --data_dir=DIR`, copy DIR here and pass "
        f"--finetune.tfds_data_dir=DIR.") from e
  if max_examples > 0:
    dataset = dataset.take(max_examples)
  columns: dict[str, list[str]] = {k: [] for k in task.text_keys}
  labels = []
  for example in tfds.as_numpy(dataset):
    for k in task.text_keys:
      columns[k].append(example[k].decode("utf-8", errors="replace"))
    labels.append(example["label"])
  if not labels:
    raise DataError(f"GLUE task '{task.tfds_name}' split '{split}' has no examples.")
  if not task.is_regression and min(labels) < 0:
    raise DataError(f"'{task.tfds_name}' split '{split}' has no labels (GLUE test splits are "
                    f"unlabelled); fine-tune on 'train' and score on {task.eval_splits}.")
  return encode_examples(tokenizer, task, columns, labels, seq_len)


def batches(split: EncodedSplit, batch_size: int,
            rng: np.random.Generator | None = None) -> Iterator[dict[str, np.ndarray]]:
  """One pass over `split` in batches of exactly `batch_size` rows (shuffled when `rng`):
  inputs int32[B, T], key_mask bool[B, T], labels [B], weights float32[B]. The last batch is
  padded with copies of row 0 of weight 0 (one shape, one compilation)."""
  order_N = rng.permutation(len(split)) if rng is not None else np.arange(len(split))
  for start in range(0, len(split), batch_size):
    rows = order_N[start:start + batch_size]
    real = len(rows)
    rows = np.concatenate([rows, np.zeros(batch_size - real, rows.dtype)])
    weights_B = (np.arange(batch_size) < real).astype(np.float32)
    yield {"inputs": split.inputs_NT[rows], "key_mask": split.key_mask_NT[rows],
           "labels": split.labels_N[rows], "weights": weights_B}


def task_score(metrics_by_split: dict[str, dict[str, float]]) -> float:
  """A task's score in percent: the mean of its metrics over its eval splits."""
  values = [v for split in metrics_by_split.values() for v in split.values()]
  return 100.0 * float(np.mean(values))


def glue_average(scores: dict[str, float]) -> float:
  """Mean of the task scores, leaving out NOT_AVERAGED tasks."""
  kept = [s for name, s in scores.items() if get_task(name).name not in NOT_AVERAGED]
  if not kept:
    raise ValueError("No GLUE task scores to average.")
  return float(np.mean(kept))
