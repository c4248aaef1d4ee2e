"""Local corpora read from files: documents, stable splits, identities, clear errors on bad
input."""
import json
import logging
import os

import pytest

from simplified_flax.data import corpus
from simplified_flax.data import local_files
from simplified_flax.data.corpus import LocalCorpus
from simplified_flax.data.errors import DataError


def _write_python_root(root, num_files=30):
  """A tiny source tree, plus things the builder must skip."""
  for i in range(num_files):
    sub = root / f"pkg{i % 3}"
    sub.mkdir(parents=True, exist_ok=True)
    (sub / f"mod{i}.py").write_text(f"def f{i}(x):\n" + f"    return x + {i}\n" * (i + 1))
  (root / "empty.py").write_text("")
  (root / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
  (root / "notes.txt").write_text("not python")
  (root / "site-packages").mkdir()
  (root / "site-packages" / "third_party.py").write_text("x = 1\n")
  return root


def _texts(corpus, split):
  return list(corpus.documents(split))


def test_python_code_documents_and_splits(tmp_path):
  root = _write_python_root(tmp_path)
  corpus = LocalCorpus.python_code([str(root)])
  train, validation = _texts(corpus, "train"), _texts(corpus, "validation")
  assert validation and train and corpus.num_documents("train") == len(train)
  expected = {(root / f"pkg{i % 3}" / f"mod{i}.py").read_text() for i in range(30)}
  assert sorted(train + validation) == sorted(expected)  # each file once; skipped files absent
  # The split is a stable hash of the relative path (one document may be moved to validation
  # when the hash leaves it empty).
  splits = local_files.assign_splits(local_files.python_documents([str(root)]))
  cut = local_files.VALIDATION_PERCENT * 100
  assert all(g.buckets()[0] >= cut for g in splits["train"])
  assert sum(g.buckets()[0] >= cut for g in splits["validation"]) <= 1


def test_documents_from_a_start_skip_the_ones_before(tmp_path):
  corpus = LocalCorpus.python_code([str(_write_python_root(tmp_path))])
  assert _texts(corpus, "train")[5:] == list(corpus.documents("train", start=5))


def test_identity_follows_the_files(tmp_path):
  root = _write_python_root(tmp_path / "root")
  identity = LocalCorpus.python_code([str(root)]).identity
  assert LocalCorpus.python_code([str(root)]).identity == identity
  other = _write_python_root(tmp_path / "other", num_files=4)
  assert LocalCorpus.python_code([str(other)]).identity != identity
  (root / "pkg0" / "mod0.py").write_text("def changed():\n    pass\n")  # new size and mtime
  assert LocalCorpus.python_code([str(root)]).identity != identity


def test_default_corpus_is_the_stdlib():
  corpus = LocalCorpus.python_code(None)
  assert corpus.roots == (local_files.stdlib_root(),)
  assert corpus.identity.startswith("python_code/stdlib-")


def test_stdlib_walk_skips_site_packages():
  rel_paths = local_files.walk_python_files(local_files.stdlib_root())
  assert "os.py" in rel_paths
  assert not any("site-packages" in p.split(os.sep) for p in rel_paths)


def test_tiny_corpus_still_gets_a_validation_document():
  docs = [local_files.DocGroup(name=f"f{i}.py", abs_path=f"/x/f{i}.py") for i in range(2)]
  splits = local_files.assign_splits(docs)
  assert len(splits["train"]) == 1 and len(splits["validation"]) == 1
  assert splits == local_files.assign_splits(list(reversed(docs)))


def test_text_files_reads_plain_and_jsonl(tmp_path):
  (tmp_path / "a.txt").write_text("plain document one")
  (tmp_path / "b.txt").write_text("plain document two")
  with open(tmp_path / "c.jsonl", "w") as f:
    for i in range(20):
      f.write(json.dumps({"body": f"json document {i}"}) + "\n")
    f.write("\n")
  corpus = LocalCorpus.text_files([str(tmp_path / "*.txt"), str(tmp_path / "c.jsonl")],
                                  json_key="body")
  docs = _texts(corpus, "train") + _texts(corpus, "validation")
  assert sorted(docs) == sorted(["plain document one", "plain document two"] +
                                [f"json document {i}" for i in range(20)])
  lines = [g for g in local_files.text_documents([str(tmp_path / "c.jsonl")], "body")]
  assert lines[0].lines == tuple(range(1, 21))  # the blank last line is no document


# ------------------------------------------------------------------------------------------
# Bad input: each error names the path and says what to do.
# ------------------------------------------------------------------------------------------
def test_missing_root_is_an_error(tmp_path):
  with pytest.raises(DataError, match=r"data\.roots: '.*nope' is not a directory"):
    local_files.python_documents([str(tmp_path / "nope")])


def test_root_without_python_files_is_an_error(tmp_path):
  (tmp_path / "readme.txt").write_text("hello")
  with pytest.raises(DataError, match=rf"no usable \*\.py file under '{tmp_path}' \(0 found"):
    local_files.python_documents([str(tmp_path)])


def test_root_with_only_unusable_files_is_an_error(tmp_path):
  (tmp_path / "a.py").write_bytes(b"x = '\xff\xfe'\n")
  (tmp_path / "b.py").write_text("")
  with pytest.raises(DataError, match=rf"no usable \*\.py file under '{tmp_path}' \(2 found "
                     r".*; 1 not UTF-8, 1 empty\)"):
    local_files.python_documents([str(tmp_path)])


def test_non_utf8_python_file_is_skipped(tmp_path):
  _write_python_root(tmp_path, num_files=2)
  names = {d.name for d in local_files.python_documents([str(tmp_path)])}
  assert "latin1.py" not in names and "empty.py" not in names and len(names) == 2


def test_skipped_files_warn_except_under_the_default_standard_library_root(tmp_path, caplog,
                                                                          monkeypatch):
  _write_python_root(tmp_path, num_files=2)
  warned = lambda: [r for r in caplog.records if r.levelno >= logging.WARNING]
  # On absl's own logger: a test earlier in the worker that parsed absl flags leaves it at
  # WARNING, which would drop the INFO line this test looks for.
  with caplog.at_level(logging.INFO, logger="absl"):
    local_files.python_documents([str(tmp_path)])
    assert "skipped 1 non-UTF-8 file(s)" in warned()[0].getMessage()
    caplog.clear()
    monkeypatch.setattr(local_files, "stdlib_root", lambda: str(tmp_path))
    local_files.python_documents([str(tmp_path)])   # the default corpus: its skips are expected
    assert not warned() and "skipped" in caplog.records[0].getMessage()


def test_glob_matching_nothing_is_an_error(tmp_path):
  with pytest.raises(DataError, match=r"the glob '.*\*\.md' matches no file"):
    local_files.expand_paths([str(tmp_path / "*.md")])


def test_non_utf8_text_file_is_an_error(tmp_path):
  (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
  (tmp_path / "good.txt").write_text("fine")
  with pytest.raises(DataError, match=r"'.*bad\.txt' is not UTF-8 text"):
    local_files.text_documents([str(tmp_path / "bad.txt"), str(tmp_path / "good.txt")], "text")


def test_bad_jsonl_lines_are_errors(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "ok"}\nnot json\n')
  with pytest.raises(DataError, match=r"'.*a\.jsonl' line 2 is not JSON"):
    local_files.text_documents([str(tmp_path / "a.jsonl")], "text")
  (tmp_path / "b.jsonl").write_text('{"body": "ok"}\n')
  with pytest.raises(DataError, match=r"'.*b\.jsonl' line 1 has no string field 'text'"):
    local_files.text_documents([str(tmp_path / "b.jsonl")], "text")


def test_empty_corpus_is_an_error(tmp_path):
  (tmp_path / "a.txt").write_text("")
  (tmp_path / "b.jsonl").write_text('{"text": ""}\n')
  with pytest.raises(DataError, match=r"the corpus is empty"):
    local_files.text_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], "text")


def test_text_files_without_paths_is_an_error():
  config = _data_config(name="text_files")
  with pytest.raises(DataError, match=r"data\.paths is empty"):
    corpus.open_corpus(config)


def test_unknown_dataset_name_is_an_error():
  config = _data_config(name="lm1bb")
  with pytest.raises(DataError, match=r"unknown dataset 'lm1bb'.*Did you mean 'lm1b'"):
    corpus.open_corpus(config)


def _data_config(**overrides):
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.data_config()
  config.update(overrides)
  return config
