"""Prepared shards and the pieces under them: index shuffle, prefetch thread, preparation that
survives a kill, content addressing, the prepare command, TensorFlow-free imports."""
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from configs import base
from simplified_flax.data import build_pipeline
from simplified_flax.data import pipeline
from simplified_flax.data import preparation
from simplified_flax.data.errors import DataError
from simplified_flax.data.index_shuffle import IndexShuffle
from simplified_flax.data.corpus import LocalCorpus
from simplified_flax.data.prefetch import Prefetcher
from simplified_flax.data.tokenizers import ByteTokenizer


# ------------------------------------------------------------------------------------------
# Index shuffle.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 64, 1000, 4097])
def test_index_shuffle_is_a_permutation(n):
  order = IndexShuffle(n, [0, 1, 2])(np.arange(n))
  assert sorted(order.tolist()) == list(range(n))


def test_index_shuffle_looks_up_any_position_alone_and_depends_on_the_key():
  n = 10**12  # far too many rows to ever materialise a permutation
  order = IndexShuffle(n, [3, 1, 4])
  positions = np.array([0, 1, 7, n - 1, 123_456_789])
  images = order(positions)
  assert ((images >= 0) & (images < n)).all() and len(set(images.tolist())) == 5
  np.testing.assert_array_equal([order(np.array([p]))[0] for p in positions], images)
  small = IndexShuffle(1000, [3, 1, 4])(np.arange(1000))
  assert (small != IndexShuffle(1000, [3, 1, 5])(np.arange(1000))).mean() > 0.9
  assert (small != np.arange(1000)).mean() > 0.9


# ------------------------------------------------------------------------------------------
# Prefetch thread.
# ------------------------------------------------------------------------------------------
def test_prefetcher_keeps_order_applies_the_transform_and_ends():
  assert list(Prefetcher(iter(range(10)), transform=lambda x: x * x, depth=3)) == [
      x * x for x in range(10)]


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_hands_errors_to_the_consumer_in_order(depth):
  def source():
    yield 1
    raise ValueError("corrupt shard")

  feeder = Prefetcher(source(), depth=depth)
  assert next(feeder) == 1
  with pytest.raises(ValueError, match="corrupt shard"):
    next(feeder)
  with pytest.raises(StopIteration):
    next(feeder)


def test_prefetcher_close_stops_the_thread_and_is_idempotent():
  def endless():
    while True:
      yield np.zeros(4)

  before = threading.active_count()
  feeder = Prefetcher(endless(), depth=2)
  next(feeder)
  feeder.close()
  feeder.close()
  assert threading.active_count() == before


# ------------------------------------------------------------------------------------------
# Preparation.
# ------------------------------------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": f"document {i} " + "ab" * (i % 9)}) + "\n"
                          for i in range(500)))
  return LocalCorpus.text_files([str(path)], json_key="text")


def _arrays(prepared):
  return [(np.asarray(s.tokens_N), np.asarray(s.doc_starts_D1))
          for s in map(prepared.shard, range(prepared.num_shards))]


def test_a_killed_preparation_keeps_its_finished_shards(corpus, tmp_path, monkeypatch):
  tokenizer = ByteTokenizer()
  whole = preparation.prepare_split(corpus, "train", tokenizer, str(tmp_path / "a"),
                                    shard_docs=100)
  assert whole.num_shards == 5 and whole.num_docs == corpus.num_documents("train")

  tokenized = []
  real = preparation._tokenize_shard  # pylint: disable=protected-access

  def killed_at_shard_3(directory, index, texts, tok):
    if index == 3:
      raise KeyboardInterrupt  # what a kill leaves: shards 0-2 on disk, no manifest
    tokenized.append(index)
    return real(directory, index, texts, tok)

  monkeypatch.setattr(preparation, "_tokenize_shard", killed_at_shard_3)
  root = str(tmp_path / "b")
  with pytest.raises(KeyboardInterrupt):
    preparation.prepare_split(corpus, "train", tokenizer, root, shard_docs=100)
  address = preparation.Address(corpus.identity, "train", tokenizer.fingerprint, 100)
  assert preparation.PreparedSplit.open(root, address) is None  # not usable half-way
  monkeypatch.setattr(preparation, "_tokenize_shard",
                      lambda *args: tokenized.append(args[1]) or real(*args))
  resumed = preparation.prepare_split(corpus, "train", tokenizer, root, shard_docs=100)
  assert tokenized == [0, 1, 2, 3, 4]  # shards 0-2 once, then only the missing ones
  assert resumed.shard_crc32 == whole.shard_crc32   # kept shards' checksums read from their files
  for (t_a, d_a), (t_b, d_b) in zip(_arrays(whole), _arrays(resumed), strict=True):
    np.testing.assert_array_equal(t_a, t_b)
    np.testing.assert_array_equal(d_a, d_b)


def test_shards_are_addressed_by_corpus_split_tokenizer_and_size(corpus):
  base_address = preparation.Address(corpus.identity, "train", "byte-v1", 100)
  others = [preparation.Address("text_files/other", "train", "byte-v1", 100),
            preparation.Address(corpus.identity, "validation", "byte-v1", 100),
            preparation.Address(corpus.identity, "train", "spm-0123456789abcdef", 100),
            preparation.Address(corpus.identity, "train", "byte-v1", 50)]
  directories = {str(a.directory("/root")) for a in [base_address, *others]}
  assert len(directories) == 5


def test_a_corrupt_manifest_is_an_error_naming_the_fix(corpus, tmp_path):
  prepared = preparation.prepare_split(corpus, "train", ByteTokenizer(), str(tmp_path),
                                       shard_docs=1000)
  (prepared.directory / preparation.MANIFEST).write_text("{not json")
  address = preparation.Address(corpus.identity, "train", "byte-v1", 1000)
  with pytest.raises(DataError, match=r"manifest .* is corrupt .*Delete .* prepare the split"):
    preparation.PreparedSplit.open(str(tmp_path), address)


def _config(tmp_path, **data):
  config = base.get_config("cpu")
  config.model.context_length = 8
  config.batch_size = 4
  config.data.update(name="text_files", paths=str(tmp_path / "docs.jsonl"),
                     cache_dir=str(tmp_path / "shards"), **data)
  return config


def test_a_large_unprepared_split_asks_for_the_prepare_command(corpus, tmp_path, monkeypatch):
  del corpus  # writes docs.jsonl
  monkeypatch.setattr(pipeline, "PREPARE_IN_PROCESS_BYTES", 100)
  monkeypatch.setattr(sys, "argv", ["train.py", "--config=configs/sas.py:cpu", "--workdir=w"])
  with pytest.raises(DataError, match=r"is not prepared in .*shards.*  python -m "
                     r"simplified_flax\.prepare --config=configs/sas\.py:cpu --workdir=w$"):
    build_pipeline(_config(tmp_path), process_index=0, process_count=1)


def test_training_reads_the_shards_of_the_prepare_command(corpus, tmp_path, monkeypatch):
  del corpus
  from simplified_flax import prepare  # pylint: disable=g-import-not-at-top
  directories = prepare.prepare(_config(tmp_path, shard_docs=100), workers=1, workdir=None)
  assert set(directories) == {"train", "validation"}

  def must_not_run(*args, **kwargs):
    raise AssertionError("prepared again")

  monkeypatch.setattr(preparation, "_tokenize_shard", must_not_run)
  built = build_pipeline(_config(tmp_path, shard_docs=100), process_index=0, process_count=1)
  batch = next(built.train_iterator())
  assert batch["inputs"].shape == (4, 8)
  texts = [json.loads(line)["text"] for line in (tmp_path / "docs.jsonl").read_text().split("\n")
           if line]
  for row in batch["inputs"]:  # every window is a piece of one document
    assert any(built.tokenizer.decode(row) in text for text in texts)


def test_the_data_package_imports_without_tensorflow():
  code = ("import sys, simplified_flax.data, simplified_flax.data.preparation, "
          "simplified_flax.data.corpus, simplified_flax.prepare; "
          "bad = [m for m in ('tensorflow', 'tensorflow_datasets') if m in sys.modules]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
