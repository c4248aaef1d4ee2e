"""GLUE fine-tuning of a pretrained encoder, one task per run: the recipe
(`finetune_defaults`), the jitted steps and the loop, `finetune(pretrained_workdir, task)`.

The command line, what it writes and the recipe in words are in `simplified_flax/finetune.py`
(`python -m simplified_flax.finetune --help`). A NaN or infinite loss stops the run with
NonFiniteLossError (runs/nonfinite.py).
"""
import copy
import functools
import json
import os

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from simplified_flax import storage
from simplified_flax.data import tokenizers
from simplified_flax.data.errors import DataError
from simplified_flax.glue import classifier
from simplified_flax.glue import metrics as task_metrics
from simplified_flax.glue import tasks as glue
from simplified_flax.model.transformer import build_model
from simplified_flax.runs import config_checks
from simplified_flax.runs import metrics_io
from simplified_flax.runs import nonfinite
from simplified_flax.training.evaluation import load_config
from simplified_flax.training.step import create_train_state

RESULT_FILE = "result.json"


def finetune_defaults() -> ml_collections.ConfigDict:
  """The paper's fine-tuning recipe (crammed BERT on GLUE)."""
  f = ml_collections.ConfigDict()
  f.epochs = 5
  f.batch_size = 32
  f.learning_rate = 1.5e-4
  f.warmup_fraction = 0.1
  f.weight_decay = 0.01
  f.dropout_rate = 0.1            # encoder (model.dropout_rate) and head
  f.seq_len = ml_collections.config_dict.placeholder(int)  # None: model.context_length
  f.eval_batch_size = 128
  f.max_train_examples = 0        # > 0: only the first N training examples (quick runs)
  f.max_eval_examples = 0
  f.log_every_steps = 50
  f.seed = 0
  f.tfds_data_dir = ml_collections.config_dict.placeholder(str)  # where GLUE is prepared
  return f


def finetune_config(pretrain_config, ft, num_train_examples: int) -> ml_collections.ConfigDict:
  """The pretraining config with the fine-tuning batch, steps, optimiser and dropout."""
  c = copy.deepcopy(pretrain_config)
  c.seed = ft.seed
  c.batch_size = ft.batch_size
  c.grad_accum_steps = 1
  c.num_train_steps = ft.epochs * glue.num_batches(num_train_examples, ft.batch_size)
  c.model.dropout_rate = ft.dropout_rate
  c.model.context_length = ft.seq_len or pretrain_config.model.context_length
  o = c.optimizer
  o.learning_rate, o.weight_decay = ft.learning_rate, ft.weight_decay
  o.schedule, o.warmup_fraction, o.warmup_steps = "linear", ft.warmup_fraction, None
  return c


# ------------------------------------------------------------------------------------------
# Steps (pure; `regression` is static).
# ------------------------------------------------------------------------------------------
def _outputs(state, params, batch, train: bool, key=None):
  return state.apply_fn({"params": params, **state.constants}, batch["inputs"],
                        key_mask=batch["key_mask"], train=train,
                        rngs={"dropout": key} if train else None)


def train_step(state, batch: dict, regression: bool):
  """One AdamW update on the weighted mean task loss; metrics loss, grad_norm, learning_rate."""
  key = jax.random.fold_in(state.rng, state.step)
  weights_B = batch["weights"]

  def loss_fn(params):
    loss_B = classifier.task_loss_B(_outputs(state, params, batch, True, key), batch["labels"],
                                    regression)
    return jnp.sum(loss_B * weights_B) / jnp.maximum(jnp.sum(weights_B), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, opt_state=opt_state,
                            params=optax.apply_updates(state.params, updates))
  return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads),
                     "learning_rate": jnp.asarray(state.schedule(state.step), jnp.float32)}


def predict_step(state, batch: dict, regression: bool) -> jax.Array:
  return classifier.predictions_B(_outputs(state, state.params, batch, False), regression)


def evaluate_split(predict_fn, state, split: glue.EncodedSplit, task: glue.GlueTask,
                   batch_size: int) -> dict[str, float]:
  """The task's metrics on every example of `split` (padding rows dropped)."""
  predictions = []
  for batch in glue.batches(split, batch_size):
    predictions.append(np.asarray(predict_fn(state, batch))[batch["weights"] > 0])
  return task_metrics.compute(task.metrics, np.concatenate(predictions), split.labels_N)


# ------------------------------------------------------------------------------------------
# The run.
# ------------------------------------------------------------------------------------------
def _pretrained_tokenizer(pretrain_config, pretrained_workdir: str):
  def no_training_texts():
    raise DataError(f"{pretrained_workdir} holds no tokenizer.model and data.spm_model_path is "
                    f"unset: fine-tune with the tokenizer the encoder was pretrained with.")
  return tokenizers.build_tokenizer(pretrain_config.data, pretrained_workdir, no_training_texts)


def finetune(pretrained_workdir: str, task_name: str, workdir: str | None = None, *,
             config=None, ft=None, tensorboard: bool = False) -> dict:
  """Fine-tunes the latest checkpoint of `pretrained_workdir` on a GLUE task.

  `config` defaults to the run's `config.json`, `ft` to `finetune_defaults()`. Returns (and
  writes to `workdir/result.json`) {"task", "score", "metrics", "pretrained_step", ...}.
  """
  # Configs, pretrained encoder, tokenizer, data.
  task = glue.get_task(task_name)
  ft = ft if ft is not None else finetune_defaults()
  config_checks.validate_finetune_config(ft)   # before the output folder is created
  workdir = workdir or os.path.join(pretrained_workdir, "glue", task.name)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)   # epath: gs://... works too
  saved = load_config(pretrained_workdir)
  pretrain_config = copy.deepcopy(config) if config is not None else saved
  if pretrain_config.model.vocab_size is None:
    pretrain_config.model.vocab_size = saved.model.vocab_size
  if pretrain_config.model.kind != "encoder":
    raise ValueError(f"model.kind={pretrain_config.model.kind!r}: GLUE fine-tuning needs an "
                     f"encoder (a configs/bert_*.py run).")
  # Restored before the data is read: a mismatched config fails in seconds, not after QQP.
  encoder_params, encoder_constants, pretrained_step = classifier.load_pretrained_encoder(
      pretrained_workdir, pretrain_config)
  tokenizer = _pretrained_tokenizer(pretrain_config, pretrained_workdir)
  seq_len = ft.seq_len or pretrain_config.model.context_length
  load = functools.partial(glue.load_split, task, tokenizer=tokenizer, seq_len=seq_len,
                           data_dir=ft.tfds_data_dir)
  train_split = load("train", max_examples=ft.max_train_examples)
  eval_splits = {name: load(name, max_examples=ft.max_eval_examples)
                 for name in task.eval_splits}
  config = finetune_config(pretrain_config, ft, len(train_split))

  # Model: pretrained encoder, fresh head.
  model = classifier.Classifier(build_model(config.model, dtype=config.dtype), task.num_labels,
                                ft.dropout_rate)
  state = create_train_state(config, jax.random.PRNGKey(ft.seed), model=model)
  state = classifier.with_pretrained_encoder(state, encoder_params, encoder_constants)
  regression = task.is_regression
  train_fn = jax.jit(functools.partial(train_step, regression=regression), donate_argnums=0)
  predict_fn = jax.jit(functools.partial(predict_step, regression=regression))
  logging.info("Fine-tuning step-%d encoder on %s: %d train examples, %d steps.",
               pretrained_step, task.tfds_name, len(train_split), config.num_train_steps)

  # Loop: epochs of shuffled batches; metrics are read only at log steps and epoch ends.
  stale = epath.Path(workdir) / metrics_io.METRICS_FILE
  if jax.process_index() == 0 and stale.exists():   # a fine-tuning run never resumes
    stale.unlink()
  writer = metrics_io.MetricsWriter(workdir, tensorboard)
  rng = np.random.default_rng(ft.seed)
  step, pending, scores = 0, [], {}
  try:
    for epoch in range(1, ft.epochs + 1):
      for batch in glue.batches(train_split, ft.batch_size, rng):
        state, metrics = train_fn(state, batch)
        step += 1
        pending.append((step, metrics))
        if step % ft.log_every_steps == 0:
          pending = _flush(pending, writer)
      pending = _flush(pending, writer)
      scores = {name: evaluate_split(predict_fn, state, split, task, ft.eval_batch_size)
                for name, split in eval_splits.items()}
      row = {f"{name}/{metric}": value for name, values in scores.items()
             for metric, value in values.items()}
      score = glue.task_score(scores)
      writer.write_scalars(step, {"epoch": epoch, **row, "score": score})
      logging.info("epoch %d | step %d | %s | score %.2f", epoch, step,
                   " ".join(f"{k} {v:.4f}" for k, v in row.items()), score)
  finally:
    writer.close()

  result = {"task": task.name, "score": glue.task_score(scores), "metrics": scores,
            "pretrained_workdir": (pretrained_workdir if storage.is_remote(pretrained_workdir)
                                   else os.path.abspath(pretrained_workdir)),
            "pretrained_step": int(pretrained_step), "steps": step,
            "train_examples": len(train_split)}
  if jax.process_index() == 0:
    (epath.Path(workdir) / RESULT_FILE).write_text(json.dumps(result, indent=2))
  return result


def _flush(pending: list[tuple[int, dict]], writer) -> list:
  """Checks the pending steps' metrics and writes one row at the last of them: the mean loss
  over them, the last grad norm and learning rate. Returns an empty list."""
  if not pending:
    return []
  pending = [(s, jax.device_get(m)) for s, m in pending]
  nonfinite.check_finite(pending, label="fine-tuning step", advice=(
      "Lower --finetune.learning_rate (the paper reports NaNs for encoders without norms "
      "here); a fine-tuning run keeps no checkpoints, so it starts over."))
  last_step, last = pending[-1]
  writer.write_scalars(last_step, {
      "loss": float(np.mean([m["loss"] for _, m in pending])),
      "grad_norm": float(last["grad_norm"]), "learning_rate": float(last["learning_rate"])})
  return []
