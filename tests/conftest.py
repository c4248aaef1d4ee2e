"""Shared fixtures: tiny model configs of every variant."""
import pytest

import configs

DECODER_VARIANTS = ("preln", "parallel", "value_skipinit", "sas", "sas_p", "sas_p_nonorm", "op",
                    "naive_skipless")
ENCODER_VARIANTS = ("bert_preln", "bert_sas", "bert_sas_p")
TINY_MODEL = dict(n_layer=2, n_embd=32, n_head=4, context_length=16, vocab_size=61)


def load_config(name: str, arg: str = ""):
  return configs.load(f"{name}:{arg}")


def tiny_config(name: str, **model_overrides):
  config = load_config(name)
  config.model.update(dict(TINY_MODEL, **model_overrides))
  return config


@pytest.fixture
def tiny():
  return tiny_config
