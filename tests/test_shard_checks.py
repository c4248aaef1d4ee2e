"""Shard checksums (verified once per open, one-line error with the repair command, in-place
repair, older manifests still load) and token ids checked against the vocabulary."""
import json
import sys

import numpy as np
import pytest

from simplified_flax.data import preparation
from simplified_flax.data import shard_checks
from simplified_flax.data.corpus import LocalCorpus
from simplified_flax.data.errors import DataError
from simplified_flax.data.sequences import ShardedRows
from simplified_flax.data.tokenizers import ByteTokenizer


@pytest.fixture
def corpus(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": f"document {i} " + "ab" * (i % 9)}) + "\n"
                          for i in range(300)))
  return LocalCorpus.text_files([str(path)], json_key="text")


@pytest.fixture
def prepared(corpus, tmp_path):
  return preparation.prepare_split(corpus, "train", ByteTokenizer(), str(tmp_path / "shards"),
                                   shard_docs=100)


def _flip_last_byte(path):
  data = bytearray(path.read_bytes())
  data[-1] ^= 0x01   # the data section: np.load still reads it, with one id changed
  path.write_bytes(bytes(data))


def _reopen(prepared):
  manifest = json.loads((prepared.directory / preparation.MANIFEST).read_text())
  return preparation.PreparedSplit(prepared.directory, manifest)


def test_the_manifest_records_a_crc32_of_both_files_of_every_shard(prepared):
  assert len(prepared.shard_crc32) == 3
  tokens, docs = prepared.shard_file(1), prepared.directory / "docs-00001.npy"
  assert prepared.shard_crc32[1] == [shard_checks.crc32_of_file(tokens),
                                     shard_checks.crc32_of_file(docs)]


@pytest.mark.parametrize("name", ["tokens-00001.npy", "docs-00001.npy"])
def test_a_damaged_shard_is_one_line_naming_the_file_and_the_repair(prepared, monkeypatch, name):
  monkeypatch.setattr(sys, "argv", ["train.py", "--config=configs/sas.py:cpu", "--workdir=w"])
  _flip_last_byte(prepared.directory / name)
  reopened = _reopen(prepared)
  reopened.shard(0), reopened.shard(2)   # the others are intact
  with pytest.raises(DataError) as error:
    reopened.shard(1)
  message = str(error.value)
  assert "\n" not in message and f"{name}' is damaged" in message
  assert message.endswith("python -m simplified_flax.prepare --config=configs/sas.py:cpu "
                          f"--workdir=w --repair_shard={prepared.directory / name}")


def test_a_shard_is_verified_once_per_open_not_per_batch(prepared, monkeypatch):
  calls = []
  real = shard_checks.crc32_of_file
  monkeypatch.setattr(shard_checks, "crc32_of_file", lambda p: calls.append(p) or real(p))
  reopened = _reopen(prepared)
  rows = ShardedRows(reopened, seq_len=4, packing=True, pad_id=0, vocab_size=259)
  for start in range(0, 40, 8):
    rows.rows(np.arange(start, start + 8))
  assert calls == [prepared.shard_file(0)]


def test_a_manifest_without_checksums_still_loads_unverified(prepared):
  path = prepared.directory / preparation.MANIFEST
  manifest = json.loads(path.read_text())
  del manifest["shard_crc32"]
  path.write_text(json.dumps(manifest))
  _flip_last_byte(prepared.shard_file(1))
  reopened = _reopen(prepared)
  assert reopened.shard_crc32 is None
  assert len(reopened.shard(1).tokens_N) == reopened.shard_num_tokens[1]


def test_repair_shard_retokenizes_one_shard_in_place(corpus, prepared, monkeypatch):
  before = prepared.shard_file(1).read_bytes()
  _flip_last_byte(prepared.shard_file(1))
  tokenized = []
  real = preparation._tokenize_shard  # pylint: disable=protected-access
  monkeypatch.setattr(preparation, "_tokenize_shard",
                      lambda *args: tokenized.append(args[1]) or real(*args))
  repaired = preparation.repair_shard(corpus, "train", ByteTokenizer(),
                                      str(prepared.directory.parent), shard_docs=100, index=1)
  assert tokenized == [1] and prepared.shard_file(1).read_bytes() == before
  repaired.shard(1)   # verifies


def test_repair_refuses_a_shard_whose_corpus_changed(corpus, prepared, tmp_path):
  (tmp_path / "docs.jsonl").write_text(
      "".join(json.dumps({"text": f"other {i}"}) + "\n" for i in range(300)))
  with pytest.raises(DataError, match="corpus or the tokenizer changed"):
    preparation.repair_shard(corpus, "train", ByteTokenizer(), str(prepared.directory.parent),
                             shard_docs=100, index=1)


def test_the_prepare_command_repairs_the_shard_file_it_is_given(tmp_path, corpus):
  del corpus   # writes docs.jsonl
  from configs import base  # pylint: disable=import-outside-toplevel
  from simplified_flax import prepare  # pylint: disable=import-outside-toplevel
  config = base.get_config("cpu")
  config.model.context_length = 8
  config.data.update(name="text_files", paths=str(tmp_path / "docs.jsonl"),
                     cache_dir=str(tmp_path / "shards"), shard_docs=100)
  directory = prepare.prepare(config, workers=1, workdir=None)["train"]
  damaged = f"{directory}/tokens-00002.npy"
  before = open(damaged, "rb").read()
  _flip_last_byte(preparation.epath.Path(damaged))
  assert prepare.prepare(config, workers=1, workdir=None, repair_shard=damaged) == {
      "train": directory}
  assert open(damaged, "rb").read() == before
  with pytest.raises(DataError, match="no tokens-NNNNN.npy"):
    prepare.prepare(config, workers=1, workdir=None, repair_shard=str(tmp_path / "x.npy"))


# ------------------------------------------------------------------------------------------
# Token ids in the vocabulary.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_an_id_outside_the_vocabulary_names_the_shard_and_position(prepared, packing):
  rows = ShardedRows(prepared, seq_len=4, packing=packing, pad_id=0, vocab_size=259)
  rows.rows(np.arange(rows.num_rows))   # every id in range: no error
  small = ShardedRows(prepared, seq_len=4, packing=packing, pad_id=0, vocab_size=100)
  with pytest.raises(DataError) as error:
    small.rows(np.arange(small.num_rows))
  message = str(error.value)
  assert "\n" not in message and str(prepared.shard_file(0)) in message
  token = int(message.split(" at token ")[1].split(" ")[0])
  assert prepared.shard(0).tokens_N[token] == int(message.split()[2]) >= 100


def test_check_token_ids_passes_in_range_and_finds_the_first_bad_one():
  shard_checks.check_token_ids(np.array([[0, 5], [9, 1]]), 10, "x")
  with pytest.raises(DataError, match=r"Token id -1 at row 1, column 0 of split 'eval'"):
    shard_checks.check_token_ids(np.array([[0, 5], [-1, 10]]), 10, "split 'eval'")


def test_the_non_finite_advice_says_the_ids_were_checked_before_the_learning_rate():
  from simplified_flax.runs import nonfinite  # pylint: disable=import-outside-toplevel
  for kept in ([], [10, 20]):
    advice = nonfinite.resume_advice("w", kept)
    assert advice.index("token ids were checked") < advice.index("learning")
