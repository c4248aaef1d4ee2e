"""Tokenizers: byte-level, SentencePiece trained on the corpus (or loaded from a file), and
Hugging Face `tokenizers` ones ("hf:<file | folder | hub name>", or "bpe" trained on the corpus:
`hf_tokenizer.py`, with the tokenizer's own special ids).

Byte and SentencePiece put their special ids first: 0 = pad, 1 = end-of-document (eod), 2 = [MASK]; ids below
`first_regular_id` are special (MLM draws its random ids above it), and `fingerprint` changes
whenever the ids of any text would. `build_tokenizer` picks one from the config; a trained
SentencePiece model is saved as `<workdir>/tokenizer.model` and reused on resume.
"""
import hashlib
import io
import os
from typing import Callable, Iterable, Iterator, Sequence

from absl import logging
import numpy as np
from etils import epath  # the workdir may be a gs:// bucket on TPU hosts

from simplified_flax.data.errors import DataError
from simplified_flax.data.hf_tokenizer import HfTokenizer, build_bpe, load_hf_tokenizer
from simplified_flax import storage
from simplified_flax.storage import write_atomically

PAD_ID, EOD_ID, MASK_ID = 0, 1, 2
TOKENIZER_FILENAME = "tokenizer.model"


class ByteTokenizer:
  """The UTF-8 bytes 0..255 as ids 3..258; decoding replaces invalid UTF-8 with U+FFFD."""
  pad_id, eod_id, mask_id = PAD_ID, EOD_ID, MASK_ID
  first_regular_id = 3
  vocab_size = 256 + first_regular_id
  fingerprint = "byte-v1"

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def encode_array(self, text: str) -> np.ndarray:
    """int32[n] ids of the UTF-8 bytes of `text`."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.first_regular_id

  def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(int32[M] ids of all texts back to back, int64[D] their lengths): one numpy pass."""
    encoded = [t.encode("utf-8") for t in texts]
    lengths_D = np.fromiter(map(len, encoded), np.int64, len(encoded))
    bytes_M = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return bytes_M.astype(np.int32) + self.first_regular_id, lengths_D

  def decode(self, ids: Iterable[int]) -> str:
    ids_n = np.asarray(list(ids), dtype=np.int64)
    regular_n = ids_n[(ids_n >= self.first_regular_id) & (ids_n < self.vocab_size)]
    return (regular_n - self.first_regular_id).astype(np.uint8).tobytes().decode(
        "utf-8", errors="replace")


class SentencePieceTokenizer:
  """pad 0, control pieces <eod> 1 and <mask> 2, unk 3 (never produced: byte fallback), the
  256 byte pieces, then learned ones (`train_sentencepiece`); decode(encode(s)) == s."""
  pad_id, eod_id, mask_id = PAD_ID, EOD_ID, MASK_ID
  first_regular_id = 4  # pad, eod, mask, unk

  def __init__(self, model_proto: bytes, origin: str = "<in memory>"):
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel  (only when used)
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(model_proto)
    except Exception as e:  # sentencepiece raises bare RuntimeError/OSError for bad protos
      raise DataError(f"The SentencePiece model '{origin}' does not load ({e}). Give a model "
                      "written by sentencepiece (data.spm_model_path), or delete the file to "
                      "train a new one.") from None
    self.vocab_size = self._sp.GetPieceSize()
    expected = {"<pad>": PAD_ID, "<eod>": EOD_ID, "<mask>": MASK_ID}
    found = {piece: self._sp.PieceToId(piece) for piece in expected}
    if found != expected:
      raise DataError(f"The SentencePiece model '{origin}' lays out its special pieces as "
                      f"{found}, but this code needs {expected}. Train it with "
                      "`train_sentencepiece`, or delete it to train a new one.")
    self.model_proto, self._origin = model_proto, origin
    self.fingerprint = "spm-" + hashlib.sha256(model_proto).hexdigest()[:16]

  @classmethod
  def load(cls, path) -> "SentencePieceTokenizer":
    try:
      return cls(storage.read_bytes(path), os.fspath(path))
    except OSError as e:
      reason = getattr(e, "strerror", None) or e
      raise DataError(f"The SentencePiece model '{path}' cannot be read ({reason}). Check "
                      "data.spm_model_path.") from None

  def __reduce__(self):  # picklable for the worker processes: rebuilt from the proto
    return (SentencePieceTokenizer, (self.model_proto, self._origin))

  def encode(self, text: str) -> list[int]:
    return self._sp.EncodeAsIds(text)

  def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    docs = [np.asarray(d, np.int32)
            for d in self._sp.Encode(list(texts), num_threads=os.cpu_count() or 1)]
    lengths_D = np.array([len(d) for d in docs], np.int64)
    return (np.concatenate(docs) if docs else np.zeros(0, np.int32)), lengths_D

  def decode(self, ids: Iterable[int]) -> str:
    # Out-of-range ids would make sentencepiece raise; a decoder should never crash on output.
    return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HfTokenizer


def nominal_vocab_size(data_config) -> int:
  """The vocabulary size `data_config.tokenizer` gives, without a corpus (an hf: one loads)."""
  kind = data_config.tokenizer
  if kind == "byte":
    return ByteTokenizer.vocab_size
  if kind == "bpe":
    return data_config.bpe_vocab_size
  if kind.startswith("hf:"):
    return load_hf_tokenizer(kind[len("hf:"):]).vocab_size
  return data_config.spm_vocab_size


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int, max_chars: int) -> bytes:
  """A serialised SentencePiece model trained on the first `max_chars` characters of `texts`,
  line by line (SentencePiece skips "sentences" longer than max_sentence_length, and source
  files are far longer); newlines then fall back to their byte piece."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  writer = io.BytesIO()
  try:
    spm.SentencePieceTrainer.Train(
        sentence_iterator=_training_lines(texts, max_chars), model_writer=writer,
        vocab_size=vocab_size, model_type="unigram",
        byte_fallback=True,                 # any text encodes; no <unk> ever appears
        pad_id=PAD_ID, unk_id=3, bos_id=-1, eos_id=-1, control_symbols=["<eod>", "<mask>"],
        normalization_rule_name="identity",  # keep code's whitespace and characters as they are
        remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,   # indentation runs become single pieces
        split_digits=True, character_coverage=0.9995, max_sentence_length=1 << 16,
        num_threads=os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:
    raise DataError(f"SentencePiece training failed ({e}). data.spm_vocab_size must exceed the "
                    "256 byte pieces plus the distinct characters, and a small corpus only "
                    "supports a small vocabulary: adjust data.spm_vocab_size or "
                    "data.spm_train_chars.") from None
  return writer.getvalue()


def _training_lines(texts: Iterable[str], max_chars: int) -> Iterator[str]:
  """The non-empty lines of the first `max_chars` characters of `texts`."""
  remaining = max_chars
  for text in texts:
    if remaining <= 0:
      return
    yield from (line for line in text[:remaining].splitlines() if line)
    remaining -= len(text)


def build_tokenizer(data_config, workdir: str | None,
                    training_texts: Callable[[], Iterable[str]]) -> Tokenizer:
  """The tokenizer `data_config.tokenizer` names. SentencePiece, in order: `spm_model_path` if
  set; else `<workdir>/tokenizer.model` if it exists (a resumed run keeps its ids); else one
  trained on `training_texts()` and saved there. "bpe" likewise with `<workdir>/tokenizer.json`
  (`hf_tokenizer.build_bpe`); "hf:<spec>" loads the tokenizer `spec` names."""
  kind = data_config.tokenizer
  if kind == "byte":
    return ByteTokenizer()
  if kind.startswith("hf:"):
    return load_hf_tokenizer(kind[len("hf:"):])
  if kind == "bpe":
    return build_bpe(data_config, workdir, training_texts)
  if kind != "sentencepiece":
    raise DataError(f"data.tokenizer is '{kind}'; use 'byte', 'sentencepiece', 'bpe' or "
                    "'hf:<tokenizer.json | folder | hub name>'.")
  if data_config.spm_model_path:
    return SentencePieceTokenizer.load(data_config.spm_model_path)
  path = epath.Path(workdir) / TOKENIZER_FILENAME if workdir else None
  if path and path.exists():
    tokenizer = SentencePieceTokenizer.load(path)
    if tokenizer.vocab_size != data_config.spm_vocab_size:
      raise DataError(f"'{path}' has {tokenizer.vocab_size} pieces but data.spm_vocab_size is "
                      f"{data_config.spm_vocab_size}. Use the workdir's tokenizer (set "
                      "data.spm_vocab_size to match) or start in a new workdir.")
    logging.info("Reusing the SentencePiece model %s.", path)
    return tokenizer
  logging.info("Training a %d-piece SentencePiece model on the first %d characters.",
               data_config.spm_vocab_size, data_config.spm_train_chars)
  proto = train_sentencepiece(training_texts(), vocab_size=data_config.spm_vocab_size,
                              max_chars=data_config.spm_train_chars)
  if path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: f.write(proto))  # whole or not at all: a resume trusts it
  return SentencePieceTokenizer(proto, os.fspath(path) if path else "<trained in memory>")
