"""`data.name="hf:<source>"`: a Hugging Face `datasets` dataset as a corpus (`HfCorpus`).

    corpus = open_hf_corpus(config.data)   # only this imports `datasets`
    corpus.identity                        # "hf/<source>-<hash of the selected documents>"
    for text in corpus.documents("train", start=0): ...

<source> is a hub name ("huggingface-course/codeparrot-ds-train": read from the cache or
downloaded; HF_DATASETS_OFFLINE=1 forbids the download), a `save_to_disk` folder, a folder of
data files, or parquet / arrow / json(l) / csv files or globs (comma-separated). The training
documents are `data.train_split` of it; the eval documents `data.eval_split` of it, or of
`data.eval_name` when that is set (a second source, same forms). Each split is optionally
subset the way the paper's reference code does it, with datasets' own calls:
`shuffle(seed=data.shuffle_seed).select(range(data.max_train_docs))` (eval:
`max_eval_docs`); a None seed keeps the dataset's order, 0 documents means all of them.
"""
import dataclasses
import glob
import hashlib
import os
import re
from typing import Any, Iterator

from simplified_flax.data import hf_hub
from simplified_flax.data.errors import DataError

PREFIX = "hf:"
_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json",
             ".csv": "csv"}
_READ_BATCH = 256  # documents per Arrow -> Python hop


def is_hf(name) -> bool:
  return isinstance(name, str) and name.startswith(PREFIX)


def import_datasets():
  try:
    import datasets  # pylint: disable=import-outside-toplevel  (only hf: corpora need it)
  except ImportError:
    raise DataError("data.name 'hf:...' needs the `datasets` package: pip install "
                    "'simplified_flax[hf]' (or datasets and tokenizers).") from None
  return datasets


@dataclasses.dataclass(frozen=True)
class HfCorpus:
  """The selected documents of each split (one text column each), read in a fixed order."""
  splits: dict[str, Any]   # split name -> datasets.Dataset, selection applied
  text_key: str
  identity: str

  def check_split(self, split: str) -> None:
    if split not in self.splits:
      raise DataError(f"Corpus '{self.identity}' has no split '{split}'; it has "
                      f"{sorted(self.splits)}. Set data.train_split / data.eval_split.")

  def num_documents(self, split: str) -> int:
    self.check_split(split)
    return len(self.splits[split])

  def split_num_bytes(self, split: str) -> int:
    """The Arrow bytes of the text column, scaled to the selected share of its rows."""
    ds = self.splits[split]
    table_rows = max(ds.data.num_rows, 1)
    return int(ds.data.nbytes * len(ds) / table_rows)

  def documents(self, split: str, start: int = 0) -> Iterator[str]:
    """The texts of `split` from document `start` on (None becomes ""); earlier ones are
    skipped by index, not read."""
    self.check_split(split)
    ds = self.splits[split]
    if start:
      ds = ds.select(range(min(start, len(ds)), len(ds)))
    for batch in ds.iter(batch_size=_READ_BATCH):
      yield from (text or "" for text in batch[self.text_key])


def open_hf_corpus(data_config) -> HfCorpus:
  """The corpus of `data_config.name` = "hf:<source>" (module docstring); every problem is one
  DataError naming the source, split or field and what to set."""
  d = data_config
  datasets = import_datasets()
  train_source = d.name[len(PREFIX):].strip()
  eval_source = (d.get("eval_name") or "").strip()
  eval_source = eval_source[len(PREFIX):] if is_hf(eval_source) else eval_source
  if eval_source and d.train_split == d.eval_split:
    raise DataError(f"data.eval_name is set and data.train_split == data.eval_split == "
                    f"'{d.train_split}': give the splits different names (a file's documents "
                    "take the name they are asked by).")
  seed = d.get("shuffle_seed")
  splits = {
      d.train_split: _subset(_load(datasets, train_source, d.train_split, "data.name"),
                             seed, d.get("max_train_docs") or 0, "data.max_train_docs"),
      d.eval_split: _subset(_load(datasets, eval_source or train_source, d.eval_split,
                                  "data.eval_name" if eval_source else "data.name"),
                            seed, d.get("max_eval_docs") or 0, "data.max_eval_docs"),
  }
  for split, ds in splits.items():
    splits[split] = _text_column(ds, d.text_key, split)
  fingerprints = [f"{split}={getattr(ds, '_fingerprint', '')}"
                  for split, ds in sorted(splits.items())]
  digest = hashlib.sha256("\0".join(["hf-v1", train_source, eval_source, d.text_key,
                                     *fingerprints]).encode()).hexdigest()[:12]
  slug = re.sub(r"[^\w.-]+", "_", os.path.basename(train_source.rstrip("/")) or "data")
  return HfCorpus(splits, d.text_key, f"hf/{slug}-{digest}")


def _data_files(source: str) -> tuple[str, list[str]] | None:
  """(builder name, files) when `source` names data files or globs, else None."""
  patterns = [p.strip() for p in source.split(",") if p.strip()]
  if not patterns or not all(glob.has_magic(p) or os.path.isfile(p) for p in patterns):
    return None
  files = sorted({f for p in patterns for f in (glob.glob(os.path.expanduser(p))
                                                 if glob.has_magic(p) else [p])})
  if not files:
    raise DataError(f"data.name: no file matches '{source}'. Give existing files or globs.")
  kinds = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
  if None in kinds or len(kinds) != 1:
    raise DataError(f"data.name: '{source}' must be files of one kind: "
                    f"{', '.join(sorted(_BUILDERS))}.")
  return kinds.pop(), [os.path.abspath(f) for f in files]


def _load(datasets, source: str, split: str, field: str):
  """`split` of `source` as a datasets.Dataset."""
  files = _data_files(source)
  is_saved = os.path.isdir(source) and any(
      os.path.exists(os.path.join(source, f)) for f in ("dataset_dict.json", "state.json"))
  path_like = source.startswith((".", "/", "~")) or glob.has_magic(source) or (
      os.path.splitext(source)[1].lower() in _BUILDERS)
  if files is None and not os.path.isdir(source) and path_like:
    raise DataError(f"{field}: 'hf:{source}' names no existing file, folder or "
                    "matching glob. Check the path.")
  try:
    if files is not None:   # the files are this split, whatever its name
      return datasets.load_dataset(files[0], data_files={split: files[1]}, split=split)
    if is_saved:
      saved = datasets.load_from_disk(source)
      if not isinstance(saved, datasets.DatasetDict):
        return saved        # one Dataset: the documents of any split asked for
      if split not in saved:
        raise _unknown_split(field, source, split, sorted(saved))
      return saved[split]
    hf_hub.offline_unless_reachable()
    return datasets.load_dataset(source, split=split)
  except DataError:
    raise
  except ValueError as e:
    if "split" in str(e).lower():
      raise _unknown_split(field, source, split, None, e) from None
    raise _unloadable(field, source, e) from None
  except Exception as e:  # noqa: BLE001  the hub and Arrow fail many ways (network, cache, files)
    raise _unloadable(field, source, e) from None


def _unknown_split(field, source, split, known, error=None) -> DataError:
  it_has = f"it has {known}" if known is not None else " ".join(str(error).split())
  return DataError(f"{field}: 'hf:{source}' has no split '{split}' ({it_has}). Set "
                   "data.train_split / data.eval_split.")


def _unloadable(field, source, error) -> DataError:
  reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
  return DataError(
      f"{field}: the Hugging Face dataset 'hf:{source}' cannot be loaded ({reason}). Where "
      f"there is network, fetch it once (python -c \"import datasets; datasets.load_dataset("
      f"'{source}').save_to_disk('DIR')\") and set {field}=hf:DIR, or fill the hub cache "
      "(HF_HOME) there and copy it here.")


def _subset(ds, seed, max_docs: int, field: str):
  """ds.shuffle(seed=seed) unless seed is None, then its first `max_docs` (0: all)."""
  if seed is not None:
    ds = ds.shuffle(seed=int(seed))
  if max_docs:
    if max_docs > len(ds):
      raise DataError(f"{field} is {max_docs:,} but the dataset has {len(ds):,} documents. "
                      f"Set {field} to at most {len(ds):,} (0: all).")
    ds = ds.select(range(max_docs))
  return ds


def _text_column(ds, text_key: str, split: str):
  """`ds` with only its `text_key` column, which must hold strings."""
  if text_key not in ds.column_names:
    raise DataError(f"data.text_key: the split '{split}' has no column '{text_key}'; its "
                    f"columns are {ds.column_names}. Set data.text_key to one of them.")
  dtype = getattr(ds.features[text_key], "dtype", None)
  if dtype not in ("string", "large_string"):
    raise DataError(f"data.text_key: the column '{text_key}' of the split '{split}' holds "
                    f"{ds.features[text_key]}, not text. Set data.text_key to a text column.")
  return ds.select_columns([text_key])
