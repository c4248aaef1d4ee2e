"""Every rule of the whole-config check fails before anything is built or written: the
workdir stays absent, no tokenizer is trained, no dataset prepared."""
import pytest

import configs
from simplified_flax.runs.config_checks import ConfigError
from simplified_flax.runs.config_checks import validate_run_config
from simplified_flax.train import train_and_evaluate

# (override, text the one-line message must contain). One row per rule.
RULES = [
    ({"model.n_layer": -1}, "model.n_layer=-1"),
    ({"model.n_head": 5}, "not divisible by model.n_head"),
    ({"model.norm_type": "batch"}, "model.norm_type='batch' is unknown"),
    ({"model.position_embedding": "alibi"}, "model.position_embedding='alibi' is unknown"),
    ({"model.n_head": 16, "model.n_embd": 48, "model.position_embedding": "rope"},
     "the head dimension n_embd / n_head = 3 is odd"),
    ({"model.embedding_scale_init": -1.0}, "model.embedding_scale_init=-1.0 must be a number > 0"),
    ({"model.alpha_init_final_norm": 0.0}, "model.alpha_init_final_norm=0.0 must be a number > 0"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"grad_accum_steps": 3}, "grad_accum_steps=3"),
    ({"num_train_steps": 0}, "num_train_steps=0"),
    ({"log_every_steps": -1}, "log_every_steps=-1"),
    ({"eval_every_steps": -5}, "eval_every_steps=-5"),
    ({"eval_steps": -1}, "eval_steps=-1"),
    ({"eval_steps": 0}, "eval_steps=0"),
    ({"checkpoint_every_steps": -1}, "checkpoint_every_steps=-1"),
    ({"max_to_keep": 0}, "max_to_keep=0"),
    ({"keep_every_steps": -2}, "keep_every_steps=-2"),
    ({"keep_every_steps": 30, "checkpoint_every_steps": 20}, "not a multiple"),
    ({"restore_step": -1}, "restore_step=-1"),
    ({"diagnostics_every": -1}, "diagnostics_every=-1"),
    ({"seed": -3}, "seed=-3"),
    ({"dtype": "float64"}, "dtype='float64' is unknown"),
    ({"parallel.mode": "dp"}, "parallel.mode='dp' is unknown"),
    ({"parallel.fsdp": 0}, "parallel.fsdp=0"),
    ({"parallel.mode": "pmap", "parallel.fsdp": 2}, "set parallel.mode='jit' or parallel.fsdp=1"),
    ({"optimizer.learning_rate": -1.0}, "optimizer.learning_rate=-1.0"),
    ({"optimizer.learning_rate": 0.0}, "optimizer.learning_rate=0.0"),
    ({"optimizer.schedule": "step"}, "optimizer.schedule='step' is unknown"),
    ({"optimizer.warmup_fraction": 1.5}, "optimizer.warmup_fraction=1.5"),
    ({"optimizer.warmup_steps": -1}, "optimizer.warmup_steps=-1"),
    ({"optimizer.weight_decay": -0.1}, "optimizer.weight_decay=-0.1"),
    ({"optimizer.b1": 1.0}, "optimizer.b1=1.0"),
    ({"optimizer.b2": -0.5}, "optimizer.b2=-0.5"),
    ({"optimizer.eps": 0.0}, "optimizer.eps=0.0"),
    ({"optimizer.grad_clip_norm": -1.0}, "optimizer.grad_clip_norm=-1.0"),
    ({"data.name": ""}, "data.name=''"),
    ({"data.name": "text_files"}, "needs data.paths"),
    ({"data.tokenizer": "wordpiece"}, "data.tokenizer='wordpiece' is unknown"),
    ({"data.spm_vocab_size": 2}, "data.spm_vocab_size=2"),
    ({"data.spm_train_chars": 0}, "data.spm_train_chars=0"),
    ({"data.mlm_rate": 1.0}, "data.mlm_rate=1.0"),
    ({"data.shuffle_buffer": 0}, "data.shuffle_buffer=0"),
    ({"data.shard_docs": 0}, "data.shard_docs=0"),
    ({"data.prefetch": -1}, "data.prefetch=-1"),
    ({"data.train_split": ""}, "data.train_split=''"),
    ({"data.eval_split": ""}, "data.eval_split=''"),
]

# Rows for data fields that this version of the pipeline does not have are left out.
_DATA_FIELDS = set(configs.load("preln:cpu").data.keys())
RULES = [(o, e) for o, e in RULES
         if all(not k.startswith("data.") or k[5:] in _DATA_FIELDS for k in o)]


def _config(overrides):
  # sentencepiece: a run that got past the check would train a tokenizer into the workdir.
  return configs.load("preln:cpu", {"data.tokenizer": "sentencepiece", **overrides})


@pytest.mark.parametrize("overrides,expected", RULES,
                         ids=[",".join(o) for o, _ in RULES])
def test_each_rule_fails_before_anything_is_written(overrides, expected, tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError) as err:
    train_and_evaluate(_config(overrides), str(workdir), tensorboard=False)
  assert expected in str(err.value)
  assert "\n" not in str(err.value)
  assert not workdir.exists()
  assert list(tmp_path.iterdir()) == []


def test_the_default_configs_pass():
  for name in ("preln:cpu", "sas_p_nonorm", "bert_sas_p"):
    validate_run_config(configs.load(name), device_count=1)


def test_the_batch_must_split_over_the_devices():
  with pytest.raises(ConfigError, match="batch_size=16 does not split over the 3 devices"):
    validate_run_config(configs.load("preln:cpu"), device_count=3)


FINETUNE_RULES = [
    ({"epochs": 0}, "finetune.epochs=0"),
    ({"batch_size": 0}, "finetune.batch_size=0"),
    ({"eval_batch_size": -1}, "finetune.eval_batch_size=-1"),
    ({"log_every_steps": 0}, "finetune.log_every_steps=0"),
    ({"max_train_examples": -1}, "finetune.max_train_examples=-1"),
    ({"max_eval_examples": -1}, "finetune.max_eval_examples=-1"),
    ({"seed": -1}, "finetune.seed=-1"),
    ({"learning_rate": 0.0}, "finetune.learning_rate=0.0"),
    ({"seq_len": 0}, "finetune.seq_len=0"),
    ({"warmup_fraction": -0.1}, "finetune.warmup_fraction=-0.1"),
    ({"dropout_rate": 1.0}, "finetune.dropout_rate=1.0"),
    ({"weight_decay": -1.0}, "finetune.weight_decay=-1.0"),
]


@pytest.mark.parametrize("overrides,expected", FINETUNE_RULES,
                         ids=[",".join(o) for o, _ in FINETUNE_RULES])
def test_each_finetune_rule_fails_before_the_output_folder_exists(overrides, expected,
                                                                  tmp_path):
  from simplified_flax.glue.training import (  # pylint: disable=g-import-not-at-top
      finetune, finetune_defaults)
  ft = finetune_defaults()
  ft.update(overrides)
  with pytest.raises(ConfigError, match=expected):
    finetune(str(tmp_path / "pretrained"), "sst2", str(tmp_path / "out"), ft=ft)
  assert list(tmp_path.iterdir()) == []
