"""Datasets by tfds name (offline, under tfds.testing.mock_data), prepared in shards, and the
real default corpus (slow)."""
import json
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import base
from simplified_flax.data import build_pipeline
from simplified_flax.data import corpus
from simplified_flax.data.errors import DataError

T, BATCH = 8, 4


def _config(data_dir, *switches, **data):
  config = base.get_config(",".join(["cpu", *switches]))
  config.model.context_length = T
  config.batch_size = BATCH
  config.data.tfds_data_dir = str(data_dir)
  config.data.update(data)
  return config


def _mock(tmp_path, num_examples):
  """Offline random data for any tfds name; data_dir keeps caches inside the test's tmp dir
  (by default mock_data points builders into the tfds package itself)."""
  return tfds.testing.mock_data(num_examples=num_examples, data_dir=str(tmp_path / "mock"))


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  for a, b in zip(batches_a, batches_b, strict=True):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_tfds_dataset_by_name(tmp_path):
  config = _config(tmp_path, name="lm1b", eval_split="test")  # lm1b's text key is "text"
  with _mock(tmp_path, 64):
    pipeline = build_pipeline(config, process_index=0, process_count=1)
    batch = next(pipeline.train_iterator())
    assert batch["inputs"].shape == (BATCH, T)
    again = build_pipeline(config, process_index=0, process_count=1)
    _assert_same(_take(pipeline.train_iterator(), 5), _take(again.train_iterator(), 5))
    assert len(list(pipeline.eval_batches(3))) == 3
  assert pipeline.description["dataset"].startswith("lm1b/")
  assert pipeline.description["text_key"] == "text"


def test_empty_split_of_a_tfds_dataset_is_an_error(tmp_path):
  with _mock(tmp_path, 0):
    with pytest.raises(DataError, match=r"split 'train' of dataset 'lm1b/.*' is empty"):
      build_pipeline(_config(tmp_path, name="lm1b"), process_index=0, process_count=1)


def test_text_files_by_config(tmp_path):
  (tmp_path / "docs").mkdir()
  for i in range(6):
    (tmp_path / "docs" / f"{i}.txt").write_text(f"document number {i} " * 5)
  (tmp_path / "docs" / "more.jsonl").write_text(
      "".join(json.dumps({"text": f"line {i} " * 4}) + "\n" for i in range(30)))
  config = _config(tmp_path / "tfds", name="text_files", packing=True,
                   paths=f"{tmp_path}/docs/*.txt, {tmp_path}/docs/more.jsonl")
  config.model.context_length = 256  # whole documents fit in a row
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  text = "".join(pipeline.tokenizer.decode(b["inputs"].ravel())
                 for b in _take(pipeline.train_iterator(), 20))
  assert "document number" in text and "line " in text


def test_text_key_missing_from_a_dataset_is_an_error():
  with pytest.raises(DataError, match=r"dataset 'squad' has no feature 'content'; its text "
                     r"features are \['title', 'context', 'question'\]"):
    corpus._text_key(tfds.builder("squad"), "content")  # pylint: disable=protected-access


def test_tfds_corpus_in_several_shards_resumes_exactly(tmp_path):
  config = _config(tmp_path, "encoder", name="lm1b", eval_split="test", packing=True,
                   shard_docs=16)
  with _mock(tmp_path, 64):
    pipeline = build_pipeline(config, process_index=0, process_count=1)
    iterator = pipeline.train_iterator()
    per_epoch = pipeline.description["rows_per_epoch"] // BATCH
    _take(iterator, per_epoch + 1)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = _take(iterator, 4)
    again = build_pipeline(config, process_index=0, process_count=1).train_iterator()
    again.set_state(state)
    _assert_same(_take(again, 4), expected)
    evals = list(pipeline.eval_batches(3))
    _assert_same(evals, list(pipeline.eval_batches(3)))
  assert (state["epoch"], state["position"]) == (1, 1)
  assert set(expected[0]) == {"inputs", "targets", "weights", "key_mask", "segment_ids"}
  assert len(list(tmp_path.glob("token_shards/lm1b*.train.*/docs-*.npy"))) == 4


@pytest.mark.slow
def test_default_config_prepares_the_stdlib_offline(tmp_path):
  """The acceptance path: the real default corpus, prepared once, then reused."""
  config = base.get_config("cpu")
  config.data.tfds_data_dir = str(tmp_path)
  start = time.time()
  pipeline = build_pipeline(config, workdir=str(tmp_path / "work"), process_index=0,
                            process_count=1)
  first_build = time.time() - start
  batch = next(pipeline.train_iterator())
  assert batch["inputs"].shape == (config.batch_size, config.model.context_length)
  assert pipeline.description["rows_per_epoch"] > 100_000  # ~30 MB of Python source
  start = time.time()
  build_pipeline(config, workdir=str(tmp_path / "work"), process_index=0, process_count=1)
  assert time.time() - start < first_build / 3
  print(f"default corpus: prepared and tokenized in {first_build:.1f}s")
