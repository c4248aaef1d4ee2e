"""The sampling command's library calls: restore a workdir read-only, continue prompts."""
import json
import os

import jax
import numpy as np
import pytest

from conftest import tiny_config
from simplified_flax import sample
from simplified_flax.runs import checkpoints
from simplified_flax.model import decode
from simplified_flax.data.tokenizers import ByteTokenizer
from simplified_flax.config_files import CONFIG_FILE
from simplified_flax.training.evaluation import load_config, load_tokenizer, restore_read_only
from simplified_flax.model.transformer import build_model
from simplified_flax.training.step import create_train_state


def _training_workdir(tmp_path, steps=(1, 2)):
  """A workdir laid out as training leaves it, with states that differ per step."""
  config = tiny_config("sas_p", vocab_size=ByteTokenizer.vocab_size)
  workdir = str(tmp_path)
  with open(os.path.join(workdir, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(config.to_dict(), f)
  manager = checkpoints.make_manager(workdir, max_to_keep=5, save_interval_steps=1)
  states = {}
  for step in steps:
    states[step] = create_train_state(config, jax.random.PRNGKey(step))
    checkpoints.save(manager, step, states[step], {}, config.to_dict(), {})
  manager.wait_until_finished()
  manager.close()
  return workdir, states


def test_restores_the_latest_intact_step_and_skips_a_corrupt_one(tmp_path):
  workdir, states = _training_workdir(tmp_path)
  config = load_config(workdir)
  restored = restore_read_only(workdir, config)
  assert restored.step == 2
  jax.tree.map(np.testing.assert_array_equal, restored.state.params, states[2].params)

  meta = os.path.join(workdir, "checkpoints", "2", "meta", "metadata")
  with open(meta, encoding="utf-8") as f:
    saved = json.load(f)
  with open(meta, "w", encoding="utf-8") as f:
    json.dump(dict(saved, fingerprint=saved["fingerprint"] + 1), f)
  restored = restore_read_only(workdir, config)
  assert restored.step == 1 and os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
  jax.tree.map(np.testing.assert_array_equal, restored.state.params, states[1].params)


def test_sample_text_continues_each_prompt_and_is_seeded(tmp_path):
  workdir, _ = _training_workdir(tmp_path, steps=(1,))
  config = load_config(workdir)
  restored = restore_read_only(workdir, config)
  variables = {"params": restored.state.params, **restored.state.constants}
  model, tokenizer = build_model(config.model), load_tokenizer(config, workdir)
  prompts = ["def fib(n):", "x"]
  run = lambda seed: sample.sample_text(model, variables, tokenizer, prompts, max_new_tokens=8,
                                        sampling=decode.Sampling(top_k=20), seed=seed)
  texts = run(0)
  assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
  assert run(0) == texts


def test_reading_leaves_a_step_being_written_and_a_bad_step_alone(tmp_path):
  """Evaluating or sampling while training writes a step: Orbax's temporary folder of that
  step must survive (a training manager would clean it up), and nothing moves or appears."""
  workdir, states = _training_workdir(tmp_path)
  in_progress = os.path.join(workdir, "checkpoints", "3.orbax-checkpoint-tmp-1795950000000000")
  os.makedirs(os.path.join(in_progress, "state"))
  with open(os.path.join(workdir, "checkpoints", "2", "meta", "metadata"), "w",
            encoding="utf-8") as f:
    f.write("{truncated")
  before = sorted(os.listdir(workdir)), sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  restored = restore_read_only(workdir, load_config(workdir))
  assert restored.step == 1
  jax.tree.map(np.testing.assert_array_equal, restored.state.params, states[1].params)
  after = sorted(os.listdir(workdir)), sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  assert after == before and os.path.isdir(in_progress)


def test_reading_a_workdir_without_checkpoints_says_what_to_do(tmp_path):
  with pytest.raises(FileNotFoundError, match="--workdir of a training run"):
    restore_read_only(str(tmp_path), tiny_config("sas_p"))
  os.makedirs(tmp_path / "checkpoints")
  with pytest.raises(FileNotFoundError, match="train first"):
    restore_read_only(str(tmp_path), tiny_config("sas_p"))


def test_reading_a_step_that_does_not_exist_lists_the_steps(tmp_path):
  workdir, _ = _training_workdir(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"No checkpoint step 7 .* steps \[1, 2\]"):
    restore_read_only(workdir, load_config(workdir), step=7)
