"""Byte and SentencePiece tokenizers: layout, round trips, saving, reuse and bad files."""
import os

import numpy as np
import pytest

from configs import base
from simplified_flax.data import tokenizers
from simplified_flax.data.errors import DataError

_WORDS = ["".join(chr(97 + c) for c in np.random.default_rng(i).integers(0, 26, 2 + i % 7))
          for i in range(400)]
_TEXTS = ["\n".join(f"def {_WORDS[(i * 7 + j) % 400]}(value):  # é\n    return "
                    f"{_WORDS[(i + j * 13) % 400]} * {i + j}" for j in range(20))
          for i in range(60)]

def _data_config(**overrides):
  config = base.data_config()
  config.update({"tokenizer": "sentencepiece", "spm_vocab_size": 400,
                 "spm_train_chars": 50_000, **overrides})
  return config


def test_byte_tokenizer_layout_and_round_trip():
  tok = tokenizers.ByteTokenizer()
  assert (tok.pad_id, tok.eod_id, tok.mask_id, tok.first_regular_id) == (0, 1, 2, 3)
  assert tok.vocab_size == 259
  text = "x = 'é😀'\n\t"
  ids = tok.encode(text)
  assert min(ids) >= tok.first_regular_id and max(ids) < tok.vocab_size
  assert tok.decode(ids) == text
  flat, lengths = tok.encode_flat([text, "", text])
  assert flat.tolist() == ids * 2 and lengths.tolist() == [len(ids), 0, len(ids)]


def test_byte_decode_survives_invalid_utf8_and_special_ids():
  tok = tokenizers.ByteTokenizer()
  broken = tok.encode("é")[:1] + tok.encode("ok") + [tok.eod_id, tok.pad_id, 10_000]
  assert tok.decode(broken) == "\ufffdok"


def test_sentencepiece_trains_saves_and_is_reused(tmp_path):
  calls = []

  def texts():
    calls.append(1)
    return iter(_TEXTS)

  tok = tokenizers.build_tokenizer(_data_config(), str(tmp_path), texts)
  path = tmp_path / tokenizers.TOKENIZER_FILENAME
  assert path.exists() and len(calls) == 1
  assert tok.vocab_size == 400
  assert (tok.pad_id, tok.eod_id, tok.mask_id) == (0, 1, 2)
  for text in _TEXTS[:3] + ["unseen ✓ text\n\n  indented"]:
    assert tok.decode(tok.encode(text)) == text  # byte fallback: nothing is unknown
  again = tokenizers.build_tokenizer(_data_config(), str(tmp_path), texts)
  assert len(calls) == 1 and again.fingerprint == tok.fingerprint
  from_path = tokenizers.build_tokenizer(_data_config(spm_model_path=str(path)), None, texts)
  assert from_path.fingerprint == tok.fingerprint
  assert tok.decode([tok.eod_id, 99_999, -1]) == ""


def test_sentencepiece_training_is_deterministic():
  a = tokenizers.train_sentencepiece(_TEXTS, vocab_size=400, max_chars=30_000)
  b = tokenizers.train_sentencepiece(_TEXTS, vocab_size=400, max_chars=30_000)
  assert a == b


def test_tokenizer_file_that_does_not_load_is_an_error(tmp_path):
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"this is not a sentencepiece model")
  with pytest.raises(DataError, match=rf"'{bad}' does not load"):
    tokenizers.build_tokenizer(_data_config(spm_model_path=str(bad)), None, lambda: _TEXTS)
  with pytest.raises(DataError, match=r"'/no/such/file.model' cannot be read"):
    tokenizers.build_tokenizer(_data_config(spm_model_path="/no/such/file.model"), None,
                               lambda: _TEXTS)
  (tmp_path / tokenizers.TOKENIZER_FILENAME).write_bytes(b"corrupt")
  with pytest.raises(DataError, match=r"tokenizer\.model' does not load"):
    tokenizers.build_tokenizer(_data_config(), str(tmp_path), lambda: _TEXTS)


def test_workdir_tokenizer_with_another_vocab_size_is_an_error(tmp_path):
  tokenizers.build_tokenizer(_data_config(), str(tmp_path), lambda: iter(_TEXTS))
  with pytest.raises(DataError, match=r"has 400 pieces but data.spm_vocab_size is 420"):
    tokenizers.build_tokenizer(_data_config(spm_vocab_size=420), str(tmp_path),
                               lambda: iter(_TEXTS))


def test_unknown_tokenizer_kind_is_an_error():
  with pytest.raises(DataError, match=r"data.tokenizer is 'wordpiece'; use 'byte', "
                     r"'sentencepiece', 'bpe' or 'hf:"):
    tokenizers.build_tokenizer(_data_config(tokenizer="wordpiece"), None, lambda: _TEXTS)


def test_no_workdir_trains_in_memory(tmp_path):
  tok = tokenizers.build_tokenizer(_data_config(), None, lambda: iter(_TEXTS))
  assert tok.vocab_size == 400 and not os.listdir(tmp_path)
