"""What an `hf:<source>` names, and one split of it loaded with `datasets` (hf_corpus.py
selects documents from it): a `save_to_disk` folder (memory-mapped, any split it holds), data
files or globs of one kind (the files are the split asked for, whatever its name), a folder of
data files, or a hub name (offline unless the hub is reachable). Every failure is one
DataError naming the field, the source and what to set.
"""
import glob
import os

from absl import logging

from simplified_flax.data import hf_hub
from simplified_flax.data.errors import DataError

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json",
            ".csv": "csv"}


def same_source(a: str, b: str) -> bool:
  """Whether sources `a` and `b` are one (local paths compared where they lead)."""
  if a == b:
    return True
  return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def data_files(source: str) -> tuple[str, list[str]] | None:
  """(builder name, files) when `source` names data files or globs, else None."""
  patterns = [p.strip() for p in source.split(",") if p.strip()]
  if not patterns or not all(glob.has_magic(p) or os.path.isfile(p) for p in patterns):
    return None
  files = sorted({f for p in patterns for f in (glob.glob(os.path.expanduser(p))
                                                 if glob.has_magic(p) else [p])})
  if not files:
    raise DataError(f"data.name: no file matches '{source}'. Give existing files or globs.")
  kinds = {BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
  if None in kinds or len(kinds) != 1:
    raise DataError(f"data.name: '{source}' must be files of one kind: "
                    f"{', '.join(sorted(BUILDERS))}.")
  return kinds.pop(), [os.path.abspath(f) for f in files]


def is_saved(source: str) -> bool:
  """Whether `source` is a `save_to_disk` folder."""
  return os.path.isdir(source) and any(
      os.path.exists(os.path.join(source, f)) for f in ("dataset_dict.json", "state.json"))


def load(datasets, source: str, split: str, field: str, streaming: bool = False):
  """(`split` of `source` as a datasets.Dataset, None), or streamed: (an IterableDataset, its
  builder), as `load_dataset(..., streaming=True)` makes them (module docstring)."""
  files = data_files(source)
  saved_folder = is_saved(source)
  path_like = source.startswith((".", "/", "~")) or glob.has_magic(source) or (
      os.path.splitext(source)[1].lower() in BUILDERS)
  if files is None and not os.path.isdir(source) and path_like:
    raise DataError(f"{field}: 'hf:{source}' names no existing file, folder or "
                    "matching glob. Check the path.")
  try:
    if saved_folder:
      if streaming:
        logging.info("%s: 'hf:%s' is a local save_to_disk folder, read as it is (memory-mapped); "
                     "data.streaming does not apply to it.", field, source)
      saved = datasets.load_from_disk(source)
      if not isinstance(saved, datasets.DatasetDict):
        return saved, None  # one Dataset: the documents of any split asked for
      if split not in saved:
        raise _unknown_split(field, source, split, sorted(saved))
      return saved[split], None
    if files is not None:   # the files are this split, whatever its name
      path, kwargs = files[0], {"data_files": {split: files[1]}}
    else:
      if not os.path.isdir(source):   # a folder of data files needs no hub
        hf_hub.offline_unless_reachable()
      path, kwargs = source, {}
    if streaming:           # load_dataset(..., streaming=True), keeping its builder
      builder = datasets.load_dataset_builder(path, **kwargs)
      return builder.as_streaming_dataset(split=split), builder
    return datasets.load_dataset(path, split=split, **kwargs), None
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
