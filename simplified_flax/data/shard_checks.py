"""Checks on prepared shards: a checksum per shard file, verified once when a shard is opened,
and token ids in the vocabulary, checked on every batch (one vectorised max: negligible).

The checksum is `zlib.crc32`: in the standard library and fast (GB/s). crc32c would be as
good, but its fast implementation (google-crc32c) is not a declared dependency of this project.
"""
import os
import shlex
import sys
import zlib

from etils import epath
import numpy as np

from simplified_flax.data.errors import DataError
from simplified_flax import storage
from simplified_flax.storage import is_remote

_CHUNK = 1 << 24  # 16 MiB: a local file is checksummed without being held in memory


def crc32_of_bytes(data: bytes) -> int:
  return zlib.crc32(data) & 0xFFFFFFFF


def crc32_of_file(path: epath.Path) -> int:
  """The crc32 of the file's bytes (a local file in chunks, a remote one whole)."""
  if is_remote(path):
    return crc32_of_bytes(storage.read_bytes(path))
  crc = 0
  with open(os.fspath(path), "rb") as f:
    for chunk in iter(lambda: f.read(_CHUNK), b""):
      crc = zlib.crc32(chunk, crc)
  return crc & 0xFFFFFFFF


def prepare_command(*extra: str) -> str:
  """`python -m simplified_flax.prepare` with this process's --config flags (a placeholder
  when it has none, e.g. in `evaluate`), its --workdir (where a trained tokenizer is kept, so
  the same one is used) and `extra`."""
  config_flags = [a for a in sys.argv[1:] if a.startswith("--config")]
  workdir_flags = [a for a in sys.argv[1:] if a.startswith("--workdir=")][-1:]
  return shlex.join(["python", "-m", "simplified_flax.prepare",
                     *(config_flags or ["--config=configs/<your variant>.py"]), *workdir_flags,
                     *extra])


def repair_command(path: epath.Path) -> str:
  """The command that re-tokenizes only the shard that `path` (either of its files) is part of."""
  return prepare_command(f"--repair_shard={os.fspath(path)}")


def verify_checksum(path: epath.Path, actual: int, expected: int | None) -> None:
  """DataError (one line: the file and the repair command) unless `actual` is `expected`;
  `expected` None (a manifest written before checksums existed) is not checked."""
  if expected is not None and actual != expected:
    raise DataError(f"The shard file '{path}' is damaged (crc32 {actual:08x}, its manifest says "
                    f"{expected:08x}). Rebuild just this shard:  {repair_command(path)}")


def check_token_ids(tokens: np.ndarray, vocab_size: int, where: str, offsets=None) -> None:
  """DataError naming `where` and the position of the first id outside [0, vocab_size) in
  `tokens` (int [B, T]); `offsets(row, column)` gives that position's token offset in the
  shard file. One vectorised max per call when every id is in range (signed ids are read as
  unsigned, so a negative one is a huge one)."""
  if ids_in_range(tokens, vocab_size):
    return
  row, column = (int(i) for i in np.argwhere((tokens < 0) | (tokens >= vocab_size))[0])
  position = (f"token {offsets(row, column)}" if offsets is not None
              else f"row {row}, column {column}")
  raise DataError(f"Token id {int(tokens[row, column])} at {position} of {where} is outside the "
                  f"tokenizer's vocabulary (0..{vocab_size - 1}): the shard is damaged or was "
                  "made with another tokenizer. Delete its directory and prepare the split again.")


def ids_in_range(tokens: np.ndarray, vocab_size: int) -> bool:
  """Whether every id of `tokens` lies in [0, vocab_size): one vectorised max."""
  return tokens.size == 0 or _max_as_unsigned(tokens) < vocab_size


def _max_as_unsigned(tokens: np.ndarray) -> int:
  if tokens.dtype.kind == "u":
    return int(tokens.max())
  if tokens.dtype.kind == "i" and tokens.flags.c_contiguous:
    return int(tokens.view(np.dtype(f"u{tokens.dtype.itemsize}")).max())
  return int(tokens.max()) if tokens.min() >= 0 else np.iinfo(np.uint64).max
