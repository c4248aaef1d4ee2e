"""A digest of every file of a saved checkpoint step, `<step>/digest.json`, written last (once
Orbax has committed the step) and checked before the step is restored: a byte that changed
after the save (a bad disk, a partial copy between buckets) makes the step unrestorable, so
it is set aside like a corrupt one, before any of its arrays is decoded.

The checksums are what is cheapest where the files are:
  * local: `zlib.crc32` of each file (in the standard library, GB/s on one core), read back
    right after the save, while the files are still in the page cache;
  * an object store: the checksum the store computed itself as each object was written (GCS:
    crc32c; else md5 or the ETag), from one listing of the step: nothing is downloaded.
The state fingerprint in `meta` (checkpoints.fingerprint) still checks the decoded arrays: a
changed byte that the decoder does not notice, or one in an array's bytes, is caught by one
or the other. A step without digest.json (saved before it existed, or a run killed between
Orbax's commit and the digest) is checked by the fingerprint alone.
"""
import json
import os
import zlib

from etils import epath

from simplified_flax import retries
from simplified_flax import storage

DIGEST_FILE = "digest.json"
_CHUNK = 1 << 24


def file_checksums(step_dir) -> dict[str, str | None]:
  """{path relative to `step_dir`: checksum} of every file under it but the digest itself."""
  step_dir = epath.Path(step_dir)
  if storage.is_remote(step_dir):
    import fsspec  # pylint: disable=import-outside-toplevel
    fs, root = fsspec.core.url_to_fs(os.fspath(step_dir))
    found = fs.find(root, detail=True)
    sums = {name[len(root.rstrip("/")) + 1:]: (info.get("crc32c") or info.get("md5Hash")
                                                or info.get("ETag"))
            for name, info in found.items() if info.get("type", "file") == "file"}
  else:
    sums = {}
    for dirpath, _, names in os.walk(os.fspath(step_dir)):
      for name in names:
        path = os.path.join(dirpath, name)
        sums[os.path.relpath(path, os.fspath(step_dir))] = f"{_crc32(path):08x}"
  # Not the digest, nor its temporary (a run killed while writing it leaves one).
  return dict(sorted((k, v) for k, v in sums.items() if not k.startswith(DIGEST_FILE)))


def _crc32(path: str) -> int:
  crc = 0
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(_CHUNK), b""):
      crc = zlib.crc32(chunk, crc)
  return crc & 0xFFFFFFFF


def write(step_dir) -> None:
  """Writes `<step_dir>/digest.json` from the files there now (call once the step is
  committed)."""
  step_dir = epath.Path(step_dir)
  sums = retries.call("list", step_dir, lambda: file_checksums(step_dir))
  text = json.dumps({"files": sums}, indent=1).encode()
  storage.write_atomically(step_dir / DIGEST_FILE, lambda f: f.write(text))


def mismatch(step_dir) -> str | None:
  """Why the files that `step_dir`'s digest lists differ from it, or None (they are all there,
  unchanged; or the step has no digest). Files it does not list are not judged."""
  step_dir = epath.Path(step_dir)
  path = step_dir / DIGEST_FILE
  if not storage.exists(path):
    return None
  try:
    saved = json.loads(storage.read_text(path))["files"]
  except (ValueError, KeyError, TypeError) as e:
    return f"its {DIGEST_FILE} is damaged ({e!r:.100})"
  now = retries.call("list", step_dir, lambda: file_checksums(step_dir))
  for name in sorted(saved):
    if name not in now:
      return f"its file {name} is missing"
    if saved[name] != now[name]:
      return (f"its file {name} differs from the digest written at the save (checksum "
              f"{now[name]}, saved {saved[name]})")
  return None
