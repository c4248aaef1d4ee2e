"""Files written through `etils.epath`, the same way locally and in an object store (gs://,
s3://): a file is replaced whole, never seen half-written, and a folder moves whole."""
import json
import os
from typing import BinaryIO, Callable

from etils import epath


def is_remote(path) -> bool:
  """True for a URI path (gs://, s3://, ...), which lives in an object store."""
  return "://" in os.fspath(path)


def write_atomically(path, write: Callable[[BinaryIO], object]) -> None:
  """Calls `write` on a temporary sibling of `path`, then renames it over `path`: a reader, or
  a run killed meanwhile, sees the old file or the new one, never half of one."""
  path = epath.Path(path)
  tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
  with tmp.open("wb") as f:
    write(f)
  tmp.replace(path)


def read_json_object(path, error: Callable[[str], Exception], fix: str) -> dict:
  """The JSON object in the file `path`. A file that is not UTF-8, not JSON (empty, truncated,
  garbage) or not an object raises `error("<path> is damaged (<why>). <fix>")`: one line."""
  path = epath.Path(path)
  try:
    value = json.loads(path.read_text())
    why = None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"
  except json.JSONDecodeError as e:
    why = "empty" if not e.doc.strip() else f"not JSON: {e.msg} at line {e.lineno}"
  except UnicodeDecodeError:
    why = "not UTF-8 text"
  if why is not None:
    raise error(f"{path} is damaged ({why}). {fix}")
  return value


def move_folder(source, dest) -> None:
  """Moves the folder `source` to `dest`: locally one rename; in an object store every object
  is copied before any is deleted, so `source` stays whole until its copy is."""
  source, dest = epath.Path(source), epath.Path(dest)
  dest.parent.mkdir(parents=True, exist_ok=True)
  if not is_remote(source):
    source.rename(dest)
    return
  for file in _files_under(source):
    target = dest / file.relative_to(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    file.copy(target)
  source.rmtree()


def _files_under(folder: epath.Path):
  for child in folder.iterdir():
    if child.is_dir():
      yield from _files_under(child)
    else:
      yield child
