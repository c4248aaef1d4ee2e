"""Configs: every variant loads, linked fields follow, bad values fail naming the field,
and parameter counts at the paper's shape match the authors' code."""
import importlib
import json
import re
import subprocess
import sys

import pytest

import configs
from conftest import DECODER_VARIANTS, ENCODER_VARIANTS, load_config, tiny_config
from simplified_flax import params
from simplified_flax.runs import config_checks
from simplified_flax.model import transformer

# Trainable parameters of the authors' PyTorch code at L=18, D=768, H=12, V=50000, 1024 positions.
AUTHORS_COUNTS = {
    "preln": 166_645_248, "parallel": 166_645_248, "value_skipinit": 166_645_968,
    "sas": 146_002_130, "sas_p": 146_002_094, "sas_p_nonorm": 145_975_982,
    "op": 166_621_440, "naive_skipless": 166_645_248,
}


@pytest.mark.parametrize("variant", sorted(AUTHORS_COUNTS))
def test_trainable_parameter_counts_match_the_authors(variant):
  config = load_config(variant)
  config.model.vocab_size = 50_000
  assert (config.model.n_layer, config.model.n_embd, config.model.n_head) == (18, 768, 12)
  counts = params.count_parameters(config.model)
  assert abs(counts["trainable"] - AUTHORS_COUNTS[variant]) <= 1_000, counts
  # The figure the config file's docstring quotes is this code's count.
  quoted = re.search(r"50K vocabulary: ([\d,]+)",
                     importlib.import_module(f"configs.{variant}").__doc__)
  assert int(quoted.group(1).replace(",", "")) == counts["trainable"]


def test_sas_p_saves_about_fifteen_percent_of_non_embedding_parameters():
  counts = {}
  for variant in ("preln", "sas_p"):
    config = load_config(variant)
    config.model.vocab_size = 50_000
    counts[variant] = params.count_parameters(config.model)["non_embedding"]
  assert 0.15 < 1 - counts["sas_p"] / counts["preln"] < 0.18


@pytest.mark.parametrize("variant", DECODER_VARIANTS + ENCODER_VARIANTS)
def test_every_config_and_its_cpu_form_validate(variant):
  for arg in ("", "cpu"):
    config = load_config(variant, arg)
    config_checks.validate_run_config(config)
    assert config.model.kind == ("encoder" if variant.startswith("bert") else "decoder")
  assert load_config(variant, "cpu").num_train_steps < load_config(variant).num_train_steps


def test_linked_fields_follow_until_set():
  config = load_config("preln")
  config.model.value_skip_gain = 1.0
  config.model.val_init_type = "orth"
  assert config.model.proj_skip_gain == 1.0 and config.model.proj_init_type == "orth"
  config.model.proj_skip_gain = 0.5            # setting the follower leaves the leader alone
  assert config.model.value_skip_gain == 1.0
  config.model.attn_mat_resid_gain = 0.3
  assert config.model.centre_attn_gain == 0.3
  config.model.centre_attn_gain = 0.0
  assert config.model.attn_mat_resid_gain == 0.3


def test_unknown_switch_is_rejected():
  with pytest.raises(ValueError, match="Unknown config switch"):
    load_config("sas", "gpu")


BAD_VALUES = [
    ("n_embd", 30, "model.n_embd=30 is not divisible by model.n_head=4"),
    ("norm_type", "batchnorm", "model.norm_type='batchnorm' is unknown"),
    ("activation", "swish", "model.activation='swish' is unknown"),
    ("val_init_type", "xavier", "model.val_init_type='xavier' is unknown"),
    ("attention_impl", "flash", "model.attention_impl='flash' is unknown"),
    ("context_length", 2048, "model.context_length=2048 is longer than the position table"),
    ("vocab_size", None, "model.vocab_size=None"),
    ("n_layer", 0, "model.n_layer=0 must be an integer >= 1"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES)
def test_bad_model_values_name_the_field(field, value, message):
  config = tiny_config("sas")
  config.model[field] = value
  with pytest.raises(config_checks.ConfigError, match=message.replace("(", r"\(")):
    config_checks.validate_model_config(config.model)


def test_structural_conflicts_name_the_field_and_fix():
  config = tiny_config("sas")          # Value/Proj reparameterised: tying is allowed
  config.model.tie_valproj_init = "all_blocks"
  config_checks.validate_model_config(config.model)
  transformer.build_model(config.model)
  config = tiny_config("preln")
  config.model.tie_valproj_init = "last_block"
  with pytest.raises(config_checks.ConfigError, match="model.tie_valproj_init='last_block'.*"
                     "set both skip gains"):
    config_checks.validate_model_config(config.model)
  config = tiny_config("parallel")
  config.model.attn_block_skip_gain = 1.0
  with pytest.raises(config_checks.ConfigError,
                     match="model.attn_block_skip_gain=1.0 has no effect.*attn_block_skip_gain=0"):
    config_checks.validate_model_config(config.model)
  config = tiny_config("preln", attention_impl="fused")
  config.model.dot_norm_type = "tanh"
  with pytest.raises(config_checks.ConfigError, match="attention_impl='explicit'"):
    config_checks.validate_model_config(config.model)


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "float8", "dtype='float8' is unknown"),
    ("grad_accum_steps", 3, "grad_accum_steps=3 must divide batch_size=128"),
])
def test_bad_training_values_name_the_field(field, value, message):
  config = load_config("sas")
  config[field] = value
  with pytest.raises(config_checks.ConfigError, match=message):
    config_checks.validate_run_config(config)
  config = load_config("sas")
  config.optimizer.schedule = "step"
  with pytest.raises(config_checks.ConfigError, match="optimizer.schedule='step' is unknown"):
    config_checks.validate_run_config(config)


def test_params_command_prints_counts():
  out = subprocess.run(
      [sys.executable, "-m", "simplified_flax.params", "--config=configs/sas.py",
       "--config.model.vocab_size=50000", "--breakdown"],
      capture_output=True, text=True, check=True, cwd=str(__import__("pathlib").Path(
          __file__).parents[1])).stdout
  counts = json.loads(out)
  assert counts["trainable"] == params.count_parameters(
      _with_vocab(load_config("sas")).model)["trainable"]
  assert counts["breakdown"]["wte"] == 50_000 * 768


def _with_vocab(config):
  config.model.vocab_size = 50_000
  return config


def test_load_by_name_applies_dotted_overrides_and_refuses_unknown_fields():
  config = configs.load("sas_p:cpu", {"model.n_layer": 3, "batch_size": 5})
  assert (config.model.n_layer, config.batch_size) == (3, 5)
  assert config.num_train_steps == load_config("sas_p", "cpu").num_train_steps
  with pytest.raises(KeyError, match="n_layr"):
    configs.load("sas_p", {"model.n_layr": 3})
  with pytest.raises(ValueError, match="No config file 'nonexistent'.*known configs: .*sas_p"):
    configs.load("nonexistent")
