"""The local tfds builders: preparation once, stable splits, and clear errors on bad input."""
import json
import os

import pytest
import tensorflow_datasets as tfds

from simplified_flax.data import corpus as corpus_lib
from simplified_flax.data import local_files
from simplified_flax.data import sources
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


def _documents(builder, split):
  return {ex["path"].decode(): ex["content"].decode()
          for ex in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  root = _write_python_root(tmp_path_factory.mktemp("root"))
  data_dir = tmp_path_factory.mktemp("tfds")
  builder = sources.PythonCode(config=sources.python_code_config([str(root)]),
                               data_dir=str(data_dir))
  sources.prepare(builder)
  return root, data_dir, builder


def test_python_code_prepares_documents_and_splits(prepared):
  root, _, builder = prepared
  train, validation = _documents(builder, "train"), _documents(builder, "validation")
  assert validation and not set(train) & set(validation)
  assert set(train) | set(validation) == {f"pkg{i % 3}/mod{i}.py" for i in range(30)}
  assert train.get("pkg1/mod1.py", validation.get("pkg1/mod1.py")) == (
      root / "pkg1" / "mod1.py").read_text()
  # The split is a stable hash of the relative path (one document may be moved to validation
  # when the hash leaves it empty).
  assert all(local_files.split_of(name) == "train" for name in train)
  assert sum(local_files.split_of(name) == "train" for name in validation) <= 1


def test_second_run_reuses_the_preparation(prepared, monkeypatch):
  root, data_dir, builder = prepared
  info_file = os.path.join(builder.data_dir, "dataset_info.json")
  mtime = os.path.getmtime(info_file)

  def must_not_run(*args, **kwargs):
    raise AssertionError("the builder ran again")

  monkeypatch.setattr(sources.PythonCode, "_split_generators", must_not_run)
  again = sources.PythonCode(config=sources.python_code_config([str(root)]),
                             data_dir=str(data_dir))
  sources.prepare(again)
  assert again.data_dir == builder.data_dir
  assert os.path.getmtime(info_file) == mtime
  assert again.info.splits["train"].num_examples == builder.info.splits["train"].num_examples


def test_different_roots_get_their_own_preparation(prepared, tmp_path):
  root, _, builder = prepared
  other = _write_python_root(tmp_path / "other", num_files=4)
  assert sources.python_code_config([str(other)]).name != builder.builder_config.name
  assert sources.python_code_config([str(root)]).name == builder.builder_config.name


def test_default_config_is_the_stdlib():
  config = sources.python_code_config(None)
  assert config.roots == (local_files.stdlib_root(),)
  assert config.name.startswith("stdlib-py")


def test_stdlib_walk_skips_site_packages():
  rel_paths = local_files.walk_python_files(local_files.stdlib_root())
  assert "os.py" in rel_paths
  assert not any("site-packages" in p.split(os.sep) for p in rel_paths)


def test_tiny_corpus_still_gets_a_validation_document():
  docs = [local_files.DocRef(name=f"f{i}.py", abs_path=f"/x/f{i}.py") for i in range(2)]
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
  builder = sources.TextFiles(
      config=sources.text_files_config([str(tmp_path / "*.txt"), str(tmp_path / "c.jsonl")],
                                       json_key="body"),
      data_dir=str(tmp_path / "tfds"))
  sources.prepare(builder)
  docs = {**_documents(builder, "train"), **_documents(builder, "validation")}
  assert docs["a.txt"] == "plain document one"
  assert docs["c.jsonl:3"] == "json document 2"
  assert len(docs) == 22


# ------------------------------------------------------------------------------------------
# Bad input: each error names the path and says what to do.
# ------------------------------------------------------------------------------------------
def test_missing_root_is_an_error(tmp_path):
  with pytest.raises(DataError, match=r"data\.roots: '.*nope' is not a directory"):
    local_files.python_documents([str(tmp_path / "nope")])


def test_root_without_python_files_is_an_error(tmp_path):
  (tmp_path / "readme.txt").write_text("hello")
  with pytest.raises(DataError, match=rf"no \*\.py file under '{tmp_path}'"):
    local_files.python_documents([str(tmp_path)])


def test_root_with_only_unusable_files_is_an_error(tmp_path):
  (tmp_path / "a.py").write_bytes(b"x = '\xff\xfe'\n")
  (tmp_path / "b.py").write_text("")
  with pytest.raises(DataError, match=rf"none of the 2 \*\.py files under '{tmp_path}' is "
                     r"usable \(1 not UTF-8, 1 empty\)"):
    local_files.python_documents([str(tmp_path)])


def test_non_utf8_python_file_is_skipped(tmp_path):
  _write_python_root(tmp_path, num_files=2)
  names = {d.name for d in local_files.python_documents([str(tmp_path)])}
  assert "latin1.py" not in names and "empty.py" not in names and len(names) == 2


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
    corpus_lib.open_corpus(config)


def test_unknown_dataset_name_is_an_error():
  config = _data_config(name="lm1bb")
  with pytest.raises(DataError, match=r"unknown dataset 'lm1bb'.*Did you mean 'lm1b'"):
    corpus_lib.open_corpus(config)


def _data_config(**overrides):
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.data_config()
  config.update(overrides)
  return config


_PREPARE_IN_SUBPROCESS = """
import sys
from simplified_flax.data import sources
builder = sources.PythonCode(config=sources.python_code_config([sys.argv[1]]), data_dir=sys.argv[2])
sources.prepare(builder)
print(builder.info.splits["train"].num_examples)
"""


def test_processes_preparing_at_once_wait_for_each_other(tmp_path):
  """Several processes of one machine (hosts, test workers) may open the same corpus at once."""
  import subprocess
  import sys
  root = _write_python_root(tmp_path / "root")
  data_dir = tmp_path / "tfds"
  procs = [subprocess.Popen([sys.executable, "-c", _PREPARE_IN_SUBPROCESS, str(root),
                             str(data_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for _ in range(2)]
  outputs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
  counts = [out.strip().splitlines()[-1] for out, _ in outputs]
  assert counts[0] == counts[1] == "29"
