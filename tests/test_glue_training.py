"""GLUE fine-tuning: encoding, batching, the classifier on the encoder, pretrained loading, and
end-to-end runs offline under `tfds.testing.mock_data` (classification and regression)."""
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from conftest import tiny_config
from simplified_flax import train
from simplified_flax.glue import training
from simplified_flax.runs import checkpoints
from simplified_flax.runs import compatibility
from simplified_flax.glue import classifier
from simplified_flax.glue import tasks
from simplified_flax.data import ByteTokenizer, CheckpointableIterator, mlm
from simplified_flax.config_files import CONFIG_FILE
from simplified_flax.model.transformer import build_model
from simplified_flax.training.evaluation import restore_read_only

T = 32
TOK = ByteTokenizer()


def encoder_config(variant="bert_sas_p"):
  config = tiny_config(variant, context_length=T, vocab_size=TOK.vocab_size)
  config.batch_size, config.num_train_steps = 4, 2
  config.checkpoint_every_steps, config.eval_every_steps, config.log_every_steps = 2, 0, 1
  return config


def ids(text):
  return TOK.encode(text)


# ------------------------------------------------------------------------------------------
# Tasks, encoding, batches, scores.
# ------------------------------------------------------------------------------------------
def test_task_table():
  assert tasks.get_task("glue/sst2") is tasks.get_task("sst2")
  assert tasks.get_task("stsb").is_regression and tasks.get_task("mnli").num_labels == 3
  assert tasks.get_task("mnli").eval_splits == ("validation_matched", "validation_mismatched")
  with pytest.raises(ValueError, match="not a GLUE task"):
    tasks.get_task("squad")


def test_truncation_removes_from_the_longest_text_first():
  assert tasks.truncate_longest_first([5, 3], 6) == [3, 3]
  assert tasks.truncate_longest_first([2, 7], 6) == [2, 4]
  assert tasks.truncate_longest_first([4, 4], 5) == [2, 3]   # ties: the first text gives way
  assert tasks.truncate_longest_first([1, 2], 6) == [1, 2]


def test_pairs_are_joined_by_eod_and_truncated():
  np.testing.assert_array_equal(tasks.encode_texts(TOK, ["ab", "c"], 8),
                                ids("ab") + [TOK.eod_id] + ids("c"))
  np.testing.assert_array_equal(tasks.encode_texts(TOK, ["abcdef", "xy"], 6),
                                ids("abc") + [TOK.eod_id] + ids("xy"))
  np.testing.assert_array_equal(tasks.encode_texts(TOK, ["abcdef"], 4), ids("abcd"))


def test_examples_are_right_padded_with_a_key_mask():
  split = tasks.encode_examples(TOK, tasks.get_task("stsb"),
                               {"sentence1": ["ab", "a"], "sentence2": ["c", ""]}, [0.5, 4.0], 6)
  np.testing.assert_array_equal(split.inputs_NT[1], ids("a") + [TOK.eod_id] + [TOK.pad_id] * 4)
  np.testing.assert_array_equal(split.key_mask_NT.sum(axis=1), [4, 2])
  assert split.labels_N.dtype == np.float32


def test_batches_cover_every_example_once_and_weight_padding_zero():
  split = tasks.encode_examples(TOK, tasks.get_task("sst2"),
                               {"sentence": [str(i) for i in range(5)]}, [0, 1, 0, 1, 1], 4)
  got = list(tasks.batches(split, 2, rng=np.random.default_rng(0)))
  assert len(got) == 3
  assert all(b["inputs"].shape == (2, 4) for b in got)
  np.testing.assert_array_equal(np.concatenate([b["weights"] for b in got]), [1, 1, 1, 1, 1, 0])
  real = np.concatenate([b["inputs"][b["weights"] > 0, 0] for b in got])
  assert sorted(real) == sorted(split.inputs_NT[:, 0])


def test_scores_average_metrics_and_leave_out_wnli():
  assert tasks.task_score({"validation": {"f1": 0.8, "accuracy": 0.7}}) == pytest.approx(75.0)
  assert tasks.task_score({"validation_matched": {"accuracy": 0.8},
                          "validation_mismatched": {"accuracy": 0.6}}) == pytest.approx(70.0)
  assert tasks.glue_average({"sst2": 90.0, "cola": 50.0, "wnli": 0.0}) == pytest.approx(70.0)


# ------------------------------------------------------------------------------------------
# The classifier on the encoder.
# ------------------------------------------------------------------------------------------
def _classifier(config, num_outputs=2):
  return classifier.Classifier(build_model(config.model), num_outputs, dropout_rate=0.0)


def test_the_head_reads_what_the_mlm_head_reads():
  config = encoder_config()
  encoder = build_model(config.model)
  tokens_BT = jax.random.randint(jax.random.PRNGKey(1), (2, T), 3, TOK.vocab_size)
  variables = jax.jit(encoder.init)(jax.random.PRNGKey(0), tokens_BT)
  logits_BTV, x_BTD = jax.jit(lambda v: (
      encoder.apply(v, tokens_BT), encoder.apply(v, tokens_BT, return_hidden=True)))(variables)
  wte_VD = variables["params"]["wte"]["embedding"]
  np.testing.assert_allclose(jnp.einsum("btd,vd->btv", x_BTD, wte_VD), logits_BTV,
                             rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_the_output():
  config = encoder_config()
  model = _classifier(config)
  real_BT = jax.random.randint(jax.random.PRNGKey(1), (1, 10), 3, TOK.vocab_size)
  padded_BT = jnp.pad(real_BT, ((0, 0), (0, T - 10)), constant_values=TOK.pad_id)
  mask_BT = jnp.arange(T)[None] < 10
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), padded_BT)
  apply = jax.jit(lambda tokens_BT, mask_BT: model.apply(variables, tokens_BT, key_mask=mask_BT))
  np.testing.assert_allclose(apply(padded_BT, mask_BT), apply(real_BT, jnp.ones((1, 10), bool)),
                             rtol=1e-5, atol=1e-6)


def test_task_losses():
  outputs_BK = jnp.array([[0.0, jnp.log(3.0)], [2.0, 2.0]])
  np.testing.assert_allclose(classifier.task_loss_B(outputs_BK, jnp.array([1, 0]), False),
                             [-np.log(0.75), np.log(2.0)], rtol=1e-6)
  np.testing.assert_allclose(classifier.task_loss_B(jnp.array([[1.5], [0.0]]),
                                                    jnp.array([1.0, 2.0]), True), [0.25, 4.0])
  np.testing.assert_array_equal(classifier.predictions_B(outputs_BK, False), [1, 0])


# ------------------------------------------------------------------------------------------
# Pretraining runs (the training loop on random MLM batches) and fine-tuning end to end.
# ------------------------------------------------------------------------------------------
class RandomMLMPipeline:
  """The pipeline interface train_and_evaluate reads, on uniformly random byte tokens."""
  tokenizer = TOK

  def __init__(self, batch_size):
    self.batch_size = batch_size

  def _batch(self, k):
    rng = np.random.default_rng(k)
    tokens = rng.integers(TOK.first_regular_id, TOK.vocab_size, (self.batch_size, T))
    noise = mlm.draw_noise(rng, tokens.shape, TOK.first_regular_id, TOK.vocab_size)
    batch = mlm.apply_mask(tokens, noise, rate=0.25, mask_id=TOK.mask_id,
                           first_regular_id=TOK.first_regular_id)
    return dict(batch, key_mask=np.ones(tokens.shape, bool))

  def train_iterator(self, prefetch=None):
    del prefetch   # batches are made on demand
    return CheckpointableIterator(lambda k: map(self._batch, itertools.count(k)),
                                  {"random_mlm": T}, prefetch=0)

  def eval_batches(self, n):
    return map(self._batch, range(10**6, 10**6 + n))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """(workdir, final state) of a 2-step MLM pretraining run of a tiny SAS-P encoder."""
  workdir = str(tmp_path_factory.mktemp("bert_sas_p"))
  config = encoder_config()
  state = train.train_and_evaluate(config, workdir, pipeline=RandomMLMPipeline(4),
                                   tensorboard=False)
  return workdir, state


def quick_recipe(**overrides):
  ft = training.finetune_defaults()
  ft.epochs, ft.batch_size, ft.eval_batch_size, ft.log_every_steps = 2, 8, 16, 1
  ft.update(overrides)
  return ft


@pytest.mark.slow
def test_pretrained_encoder_loads_into_the_classifier(pretrained):
  workdir, trained = pretrained
  config = encoder_config()
  restored = restore_read_only(workdir, config)
  assert restored.step == 2
  chex_equal = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  state = train.create_train_state(config, jax.random.PRNGKey(5), model=_classifier(config))
  state = classifier.with_pretrained_encoder(state, restored.state)
  chex_equal(state.params["encoder"], trained.params)
  chex_equal(state.constants["constants"]["encoder"], trained.constants["constants"])
  assert set(state.params) == {"encoder", "head"}


@pytest.mark.slow
def test_a_config_with_other_shapes_is_refused_naming_the_field(pretrained):
  workdir, _ = pretrained
  config = encoder_config()
  config.model.n_layer = 3
  with pytest.raises(compatibility.IncompatibleCheckpointError, match="model.n_layer"):
    restore_read_only(workdir, config)


@pytest.mark.slow
@pytest.mark.parametrize("task,metrics", [("sst2", {"validation/accuracy"}),
                                          ("stsb", {"validation/pearson",
                                                    "validation/spearman"})])
def test_finetuning_end_to_end_under_mock_glue(pretrained, tmp_path, task, metrics):
  workdir, _ = pretrained
  with tfds.testing.mock_data(num_examples=20):
    result = training.finetune(workdir, task, str(tmp_path), ft=quick_recipe())
  assert result["pretrained_step"] == 2 and result["steps"] == 2 * 3
  for split_metrics in result["metrics"].values():
    assert all(np.isfinite(v) and -1.0 <= v <= 1.0 for v in split_metrics.values())
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  epoch_rows = [r for r in rows if "epoch" in r]
  assert [r["epoch"] for r in epoch_rows] == [1.0, 2.0] and metrics <= set(epoch_rows[-1])
  assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
  assert json.load(open(tmp_path / training.RESULT_FILE))["score"] == pytest.approx(
      result["score"])


def save_fresh_encoder(config, workdir):
  """A pretraining workdir holding a freshly initialised model (checkpoint + config.json)."""
  state = train.create_train_state(config, jax.random.PRNGKey(0))
  manager = checkpoints.make_manager(workdir, 1, 1, async_save=False)
  checkpoints.save(manager, 1, state, {}, config.to_dict(), {})
  manager.wait_until_finished()
  manager.close()
  with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
    json.dump(config.to_dict(), f)


@pytest.mark.slow
def test_a_diverging_no_norm_encoder_stops_with_the_training_loop_error(tmp_path):
  config = encoder_config("bert_sas_p_nonorm")
  save_fresh_encoder(config, str(tmp_path / "pretrained"))
  recipe = quick_recipe(learning_rate=1e6, warmup_fraction=0.0)
  with tfds.testing.mock_data(num_examples=20):
    with pytest.raises(train.NonFiniteLossError, match="Non-finite loss at fine-tuning step"):
      training.finetune(str(tmp_path / "pretrained"), "sst2", str(tmp_path / "ft"), ft=recipe)
