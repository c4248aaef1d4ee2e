"""Hugging Face `tokenizers` tokenizers: `data.tokenizer="hf:<tokenizer.json | folder | hub
name>"`, or "bpe": a byte-level BPE trained on the corpus (no transformers, no torch).

    tokenizer = load_hf_tokenizer("huggingface-course/code-search-net-tokenizer")
    tokenizer.eod_id   # the tokenizer's own "<|endoftext|>" (or </s>, <eos>, [SEP])

The special ids are the tokenizer's own tokens: eod (required), pad (else eod, as the
reference code sets pad = eos), mask (None when absent: the MLM encoder then refuses it).
`first_regular_id` is the count of special ids at the start of the vocabulary (MLM draws its
random ids above it). Text is encoded as `tokenizer(text)` in transformers does (the
post-processor's tokens included; none for GPT-2 style), truncation and padding off.
`fingerprint` hashes the tokenizer.json text, so it changes whenever any ids could. A trained
BPE ("<pad>" 0, "<|endoftext|>" 1, "<mask>" 2, then the 256 bytes and merges) is saved as
`<workdir>/tokenizer.json` and reused on resume.
"""
import hashlib
import os
from typing import Callable, Iterable, Iterator, Sequence

from absl import logging
from etils import epath
import numpy as np

from simplified_flax.data import hf_hub
from simplified_flax.data.errors import DataError
from simplified_flax import storage
from simplified_flax.storage import write_atomically

PREFIX = "hf:"
BPE_FILENAME = "tokenizer.json"
BPE_SPECIALS = ("<pad>", "<|endoftext|>", "<mask>")   # ids 0, 1, 2 of a trained BPE
_CANDIDATES = {"eod": ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]"),
               "pad": ("<pad>", "[PAD]", "<|pad|>", "<|padding|>"),
               "mask": ("<mask>", "[MASK]", "<|mask|>")}


def _library():
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel  (only hf:/bpe need it)
  except ImportError:
    raise DataError("data.tokenizer 'hf:...' / 'bpe' needs the `tokenizers` package: pip "
                    "install 'simplified_flax[hf]'.") from None
  return tokenizers


class HfTokenizer:
  """A `tokenizers.Tokenizer` behind the interface of `tokenizers.py`."""

  def __init__(self, json_text: str, origin: str = "<in memory>"):
    try:
      self._tok = _library().Tokenizer.from_str(json_text)
    except Exception as e:  # noqa: BLE001  the Rust side raises plain Exception
      raise DataError(f"The tokenizer '{origin}' does not load ({' '.join(str(e).split())}). "
                      "Give a tokenizer.json written by the `tokenizers` library.") from None
    self._tok.no_truncation()
    self._tok.no_padding()
    self.json_text, self.origin = json_text, origin
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    found = {role: next((i for t in names if (i := self._tok.token_to_id(t)) is not None), None)
             for role, names in _CANDIDATES.items()}
    if found["eod"] is None:
      raise DataError(f"The tokenizer '{origin}' has no end-of-document token (one of "
                      f"{list(_CANDIDATES['eod'])}). Use a tokenizer with one.")
    self.eod_id, self.mask_id = found["eod"], found["mask"]
    self.pad_id = found["pad"] if found["pad"] is not None else self.eod_id
    special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    self.first_regular_id = next(i for i in range(self.vocab_size + 1) if i not in special)
    self.fingerprint = "hf-" + hashlib.sha256(json_text.encode()).hexdigest()[:16]

  def __reduce__(self):  # picklable for the worker processes: rebuilt from the JSON
    return (HfTokenizer, (self.json_text, self.origin))

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(int32[M] ids of all texts back to back, int64[D] their lengths)."""
    docs = [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(list(texts))]
    lengths_D = np.array([len(d) for d in docs], np.int64)
    return (np.concatenate(docs) if docs else np.zeros(0, np.int32)), lengths_D

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size],
                            skip_special_tokens=True)


def _read_text(path: epath.Path) -> str:
  """The text of a tokenizer.json; bytes that are not UTF-8 are a one-line DataError (invalid
  JSON is one too, raised by HfTokenizer)."""
  try:
    return storage.read_text(path)
  except UnicodeDecodeError:
    raise DataError(f"The tokenizer '{path}' is damaged (not UTF-8 text). Give a tokenizer.json "
                    "written by the `tokenizers` library.") from None


def load_hf_tokenizer(spec: str) -> HfTokenizer:
  """The tokenizer of a tokenizer.json file, a folder holding one, or a hub repository (its
  tokenizer.json, from the cache or downloaded; HF_HUB_OFFLINE=1 forbids the download)."""
  path = epath.Path(spec)
  if spec.endswith(".json") or spec.startswith((".", "/", "~", "gs://")) or path.exists():
    path = path / BPE_FILENAME if path.is_dir() else path
    try:
      return HfTokenizer(_read_text(path.expanduser()), os.fspath(path))
    except OSError as e:
      raise DataError(f"data.tokenizer: '{path}' cannot be read "
                      f"({getattr(e, 'strerror', None) or e}). Give a tokenizer.json, a folder "
                      "holding one, or a hub name.") from None
  try:
    hf_hub.offline_unless_reachable()
    import huggingface_hub  # pylint: disable=import-outside-toplevel  (tokenizers needs it)
    local = huggingface_hub.hf_hub_download(spec, BPE_FILENAME)
  except Exception as e:  # noqa: BLE001  offline, unknown repository, no tokenizer.json, ...
    reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    raise DataError(f"data.tokenizer: the hub tokenizer 'hf:{spec}' cannot be loaded "
                    f"({reason}). Where there is network, download its tokenizer.json "
                    f"(huggingface_hub.hf_hub_download('{spec}', 'tokenizer.json')) and set "
                    "data.tokenizer=hf:<that file>.") from None
  return HfTokenizer(_read_text(epath.Path(local)), f"hf:{spec}")


def train_bpe(texts: Iterable[str], *, vocab_size: int, max_chars: int) -> str:
  """The tokenizer.json of a byte-level BPE (GPT-2's pre-tokenizer and decoder, no prefix
  space) with `vocab_size` ids, trained on the first `max_chars` characters of `texts`."""
  lib = _library()
  tok = lib.Tokenizer(lib.models.BPE())
  tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = lib.decoders.ByteLevel()
  trainer = lib.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS), show_progress=False,
      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_leading_chars(texts, max_chars), trainer=trainer)
  return tok.to_str()


def _leading_chars(texts: Iterable[str], max_chars: int) -> Iterator[str]:
  remaining = max_chars
  for text in texts:
    if remaining <= 0:
      return
    yield text[:remaining]
    remaining -= len(text)


def build_bpe(data_config, workdir: str | None,
              training_texts: Callable[[], Iterable[str]]) -> HfTokenizer:
  """`<workdir>/tokenizer.json` if it exists (a resumed run keeps its ids), else a BPE of
  `data.bpe_vocab_size` ids trained on `training_texts()` and saved there."""
  vocab_size = data_config.bpe_vocab_size
  path = epath.Path(workdir) / BPE_FILENAME if workdir else None
  if path and path.exists():
    tokenizer = HfTokenizer(_read_text(path), os.fspath(path))
    if tokenizer.vocab_size != vocab_size:
      raise DataError(f"'{path}' has {tokenizer.vocab_size} ids but data.bpe_vocab_size is "
                      f"{vocab_size}. Use the workdir's tokenizer (set data.bpe_vocab_size to "
                      "match) or start in a new workdir.")
    logging.info("Reusing the BPE tokenizer %s.", path)
    return tokenizer
  logging.info("Training a %d-id byte-level BPE on the first %d characters.", vocab_size,
               data_config.bpe_train_chars)
  json_text = train_bpe(training_texts(), vocab_size=vocab_size,
                        max_chars=data_config.bpe_train_chars)
  tokenizer = HfTokenizer(json_text, os.fspath(path) if path else "<trained in memory>")
  if tokenizer.vocab_size != vocab_size:
    raise DataError(f"The corpus supports only {tokenizer.vocab_size} BPE ids, fewer than "
                    f"data.bpe_vocab_size={vocab_size}. Lower data.bpe_vocab_size or raise "
                    "data.bpe_train_chars.")
  if path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: f.write(json_text.encode()))  # whole or not at all
  return tokenizer
