"""Files written through `etils.epath`, the same way locally and in an object store (gs://,
s3://): a file is replaced whole, never seen half-written, and a folder moves whole. Every
remote read and write here is retried on transient errors (`retries.call`, its budget)."""
import json
import os
from typing import BinaryIO, Callable

from etils import epath

from simplified_flax import retries
from simplified_flax.retries import is_remote  # pylint: disable=unused-import  (re-exported)


def write_atomically(path, write: Callable[[BinaryIO], object]) -> None:
  """Calls `write` on a temporary sibling of `path`, then renames it over `path`: a reader, or
  a run killed meanwhile, sees the old file or the new one, never half of one. Remote: the
  whole write and rename is retried (`write` must be repeatable)."""
  path = epath.Path(path)
  tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
  def attempt():
    with tmp.open("wb") as f:
      write(f)
    tmp.replace(path)
  retries.call("write", path, attempt)


def read_bytes(path) -> bytes:
  """The file's bytes (remote: retried on transient errors)."""
  path = epath.Path(path)
  return retries.call("read", path, path.read_bytes)


def read_text(path) -> str:
  path = epath.Path(path)
  return retries.call("read", path, path.read_text)


def exists(path) -> bool:
  path = epath.Path(path)
  return retries.call("look up", path, path.exists)


def unlink(path) -> None:
  """Removes the file if it is there."""
  path = epath.Path(path)
  retries.call("delete", path, lambda: path.unlink(missing_ok=True))


def read_json_object(path, error: Callable[[str], Exception], fix: str) -> dict:
  """The JSON object in the file `path`. A file that is not UTF-8, not JSON (empty, truncated,
  garbage) or not an object raises `error("<path> is damaged (<why>). <fix>")`: one line."""
  path = epath.Path(path)
  try:
    value = json.loads(read_text(path))
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
  for file in retries.call("list", source, lambda: list(_files_under(source))):
    target = dest / file.relative_to(source)
    retries.call("copy", file, lambda file=file, target=target: file.copy(target, overwrite=True))
  retries.call("delete", source, source.rmtree)


def _files_under(folder: epath.Path):
  for child in folder.iterdir():
    if child.is_dir():
      yield from _files_under(child)
    else:
      yield child
