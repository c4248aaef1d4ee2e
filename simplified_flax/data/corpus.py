"""`config.data.name` -> a corpus: documents as plain strings, split by split.

    corpus = open_corpus(config.data)
    corpus.identity                      # names the data in shard addresses and iterator states
    for text in corpus.documents("train", start=0): ...

Names: "python_code" (local Python source, default the interpreter's stdlib) and "text_files"
(local plain-text / JSON-lines files), read straight from the files (`local_corpus.py`), or
any tensorflow-datasets name with an optional config and version ("lm1b", "c4/en:3.0.1"),
whose text lives in the feature `data.text_key` (`tfds_corpus.py`, the only place TensorFlow
is imported).
"""
from typing import Iterator, Protocol, Sequence

from simplified_flax.data.local_corpus import LocalCorpus


class Corpus(Protocol):
  identity: str
  text_key: str

  def check_split(self, split: str) -> None: ...
  def split_num_bytes(self, split: str) -> int | None: ...
  def num_documents(self, split: str) -> int | None: ...
  def documents(self, split: str, start: int = 0) -> Iterator[str]: ...


def parse_list(value: str | Sequence[str] | None) -> list[str]:
  """A config list: a comma-separated string or a sequence; None or '' is empty."""
  if not value:
    return []
  items = value.split(",") if isinstance(value, str) else list(value)
  return [item.strip() for item in items if item.strip()]


def open_corpus(data_config) -> Corpus:
  """The corpus `data_config.name` names, with both of its splits checked."""
  name = data_config.name
  if name == "python_code":
    corpus = LocalCorpus.python_code(parse_list(data_config.roots))
  elif name == "text_files":
    corpus = LocalCorpus.text_files(parse_list(data_config.paths), data_config.json_key)
  else:
    from simplified_flax.data.tfds_corpus import TfdsCorpus  # pylint: disable=g-import-not-at-top
    corpus = TfdsCorpus.open(name, data_config.text_key, data_config.tfds_data_dir)
  for split in (data_config.train_split, data_config.eval_split):
    corpus.check_split(split)
  return corpus
