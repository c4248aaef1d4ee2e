"""Every user-damageable file a command reads (config.json, metrics.jsonl, the tokenizer files,
a shard manifest), damaged four ways, ends in a one-line user error with nothing written; and
`evaluate` on a damaged config.json, end to end."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from configs import base
from simplified_flax import cli
from simplified_flax.data import preparation
from simplified_flax.data import tokenizers
from simplified_flax.data.corpus import LocalCorpus
from simplified_flax.runs import metrics_io
from simplified_flax.training import evaluation

DAMAGES = {
    "truncated": lambda good: good[:len(good) // 2],
    "garbage": lambda good: b"\xff\xfe\x00\x9cgarbage\x00",
    "empty": lambda good: b"",
    "wrong_type": lambda good: b"[1, 2, 3]\n",
}
_ROWS = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]


def _texts():
  return [f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}" for i in range(300)]


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
  """{file name: (good bytes, how to read it from a folder)} of every damageable file."""
  folder = tmp_path_factory.mktemp("originals")
  spm = base.data_config()
  spm.update(tokenizer="sentencepiece", spm_vocab_size=288, spm_train_chars=20_000)
  bpe = base.data_config()
  bpe.update(tokenizer="bpe", bpe_vocab_size=280)
  readers = {"config.json": lambda d: evaluation.load_config(str(d)),
             "metrics.jsonl": lambda d: metrics_io.cut_history(str(d), step=2),
             "tokenizer.model": lambda d: tokenizers.build_tokenizer(spm, str(d), _texts),
             "tokenizer.json": lambda d: tokenizers.build_tokenizer(bpe, str(d), _texts)}
  (folder / "config.json").write_text(json.dumps(base.get_config("cpu").to_dict()))
  (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _ROWS))
  tokenizers.build_tokenizer(spm, str(folder), _texts)
  tokenizers.build_tokenizer(bpe, str(folder), _texts)
  (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
  corpus = LocalCorpus.text_files([str(folder / "docs.jsonl")], json_key="text")
  prepared = preparation.prepare_split(corpus, "train", tokenizers.ByteTokenizer(),
                                       str(folder / "shards"), shard_docs=100)
  address = preparation.Address(corpus.identity, "train", "byte-v1", 100)
  readers[preparation.MANIFEST] = lambda d: preparation.PreparedSplit.open(
      str(d / "shards"), address)
  good = {name: (folder / name).read_bytes() for name in readers if name != preparation.MANIFEST}
  good[preparation.MANIFEST] = (prepared.directory / preparation.MANIFEST).read_bytes()
  return {name: (good[name], readers[name]) for name in readers}, prepared.directory


def _damage(name: str, kind: str, good: bytes) -> bytes:
  if name == metrics_io.METRICS_FILE:   # a damaged middle line (a torn last one is tolerated)
    lines = good.splitlines(keepends=True)
    return lines[0] + DAMAGES[kind](lines[1]).rstrip(b"\n") + b"\n" + lines[2]
  return DAMAGES[kind](good)


def _snapshot(folder):
  return {os.path.relpath(os.path.join(root, f), folder): open(os.path.join(root, f), "rb").read()
          for root, _, files in os.walk(folder) for f in files}


def _place(shard_dir, folder, name, data: bytes):
  """`folder` with `name` holding `data` (the manifest inside a copy of the shard directory)."""
  if name == preparation.MANIFEST:
    shutil.copytree(shard_dir, folder / "shards" / shard_dir.name)
    (folder / "shards" / shard_dir.name / name).write_bytes(data)
  else:
    folder.mkdir()
    (folder / name).write_bytes(data)
  return folder


@pytest.mark.parametrize("kind", sorted(DAMAGES))
@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "tokenizer.model",
                                  "tokenizer.json", "manifest.json"])
def test_a_damaged_file_is_one_line_and_nothing_is_written(originals, tmp_path, name, kind):
  entries, shard_dir = originals
  good, read = entries[name]
  folder = _place(shard_dir, tmp_path / "w", name, _damage(name, kind, good))
  before = _snapshot(folder)
  if name == metrics_io.METRICS_FILE and kind == "empty":   # a blank middle line: no damage
    assert metrics_io.read_history(folder / name) == [_ROWS[0], _ROWS[2]]
    return
  with pytest.raises(Exception) as error:
    read(folder)
  assert cli.exit_status(error.value) == cli.OTHER_ERROR, repr(error.value)
  message = cli.one_line(error.value)
  assert "\n" not in message and name in message, message
  assert any(word in message for word in ("damaged", "corrupt", "does not load")), message
  assert _snapshot(folder) == before


def test_a_torn_last_metrics_line_is_still_tolerated(tmp_path):
  good = "".join(json.dumps(r) + "\n" for r in _ROWS)
  (tmp_path / "metrics.jsonl").write_text(good + '{"step": 4, "lo')
  assert metrics_io.read_history(tmp_path / "metrics.jsonl") == _ROWS


def test_evaluate_on_a_damaged_config_prints_one_line_and_writes_nothing(tmp_path):
  (tmp_path / "config.json").write_text('{"model": {"n_layer": 2,')
  before = _snapshot(tmp_path)
  done = subprocess.run([sys.executable, "-m", "simplified_flax.evaluate",
                         f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=300)
  assert done.returncode == cli.OTHER_ERROR
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and "config.json is damaged" in lines[0], done.stderr
  assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_a_damaged_authors_config_is_one_line(tmp_path, kind):
  from simplified_flax.authors import dirs  # pylint: disable=import-outside-toplevel
  (tmp_path / "config.json").write_bytes(DAMAGES[kind](b'{"n_layer": 2, "n_embd": 32}'))
  with pytest.raises(Exception) as error:
    dirs.read_authors_dir(str(tmp_path))
  assert cli.exit_status(error.value) == cli.OTHER_ERROR
  assert "config.json is damaged" in cli.one_line(error.value)
