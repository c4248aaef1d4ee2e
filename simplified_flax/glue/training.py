"""GLUE fine-tuning of a pretrained encoder, one task per run: the recipe (`finetune_defaults`),
the task loss that training/step.py's train step minimises, and the loop `finetune`.
"""
import copy
import functools
import json
import math
import os

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from simplified_flax import storage
from simplified_flax.glue import classifier
from simplified_flax.glue import metrics
from simplified_flax.glue import tasks
from simplified_flax.fast import build_model
from simplified_flax.runs import config_checks
from simplified_flax.runs import metrics_io
from simplified_flax.runs import nonfinite
from simplified_flax.training import step
from simplified_flax.training.evaluation import load_config, load_tokenizer, restore_read_only

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
  c.num_train_steps = ft.epochs * math.ceil(num_train_examples / ft.batch_size)
  c.model.dropout_rate = ft.dropout_rate
  c.model.context_length = ft.seq_len or pretrain_config.model.context_length
  o = c.optimizer
  o.learning_rate, o.weight_decay = ft.learning_rate, ft.weight_decay
  o.schedule, o.warmup_fraction, o.warmup_steps = "linear", ft.warmup_fraction, None
  return c


def task_loss_sums(state, params, batch: dict, *, train: bool, key,
                   regression: bool) -> dict[str, jax.Array]:
  """The `step.LossFn` of a task: the summed loss of the real rows and their count."""
  outputs_BO = step.apply_model(state, params, batch, train=train, key=key)
  loss_B = classifier.task_loss_B(outputs_BO, batch["labels"], regression)
  return {"loss_sum": jnp.sum(loss_B * batch["weights"]), "weight_sum": jnp.sum(batch["weights"])}


def predict_step(state, batch: dict, regression: bool) -> jax.Array:
  outputs_BO = step.apply_model(state, state.params, batch, train=False)
  return classifier.predictions_B(outputs_BO, regression)


def evaluate_split(predict_fn, state, split: tasks.EncodedSplit, task: tasks.GlueTask,
                   batch_size: int) -> dict[str, float]:
  """The task's metrics on every example of `split` (padding rows dropped)."""
  predictions = [np.asarray(predict_fn(state, batch))[batch["weights"] > 0]
                 for batch in tasks.batches(split, batch_size)]
  return metrics.compute(task.metrics, np.concatenate(predictions), split.labels_N)


def _pretrain_config(pretrained_workdir: str, config):
  """`config` (default: the run's config.json) with the run's vocab_size when unset."""
  saved = load_config(pretrained_workdir)
  pretrain_config = copy.deepcopy(config) if config is not None else saved
  if pretrain_config.model.vocab_size is None:
    pretrain_config.model.vocab_size = saved.model.vocab_size
  if pretrain_config.model.kind != "encoder":
    raise config_checks.ConfigError(f"model.kind={pretrain_config.model.kind!r}: GLUE "
                                    "fine-tuning needs an encoder (a configs/bert_*.py run).")
  return pretrain_config


def finetune(pretrained_workdir: str, task_name: str, workdir: str | None = None, *,
             config=None, ft=None, tensorboard: bool = False) -> dict:
  """Fine-tunes the latest checkpoint of `pretrained_workdir` on a GLUE task; returns (and
  writes to `workdir/result.json`) {"task", "score", "metrics", "pretrained_step", ...}.
  `config` defaults to the run's `config.json`, `ft` to `finetune_defaults()`."""
  task = tasks.get_task(task_name)
  ft = ft if ft is not None else finetune_defaults()
  config_checks.validate_finetune_config(ft, config)   # before the output folder is created
  workdir = workdir or os.path.join(pretrained_workdir, "glue", task.name)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)   # epath: gs://... works too
  pretrain_config = _pretrain_config(pretrained_workdir, config)
  # Restored (read-only) before the data is read: a mismatched config fails in seconds.
  pretrained = restore_read_only(pretrained_workdir, pretrain_config)
  tokenizer = load_tokenizer(pretrain_config, pretrained_workdir)
  load = functools.partial(tasks.load_split, task, tokenizer=tokenizer,
                           seq_len=ft.seq_len or pretrain_config.model.context_length,
                           data_dir=ft.tfds_data_dir)
  train_split = load("train", max_examples=ft.max_train_examples)
  eval_splits = {name: load(name, max_examples=ft.max_eval_examples)
                 for name in task.eval_splits}
  config = finetune_config(pretrain_config, ft, len(train_split))

  # Pretrained encoder, fresh head; the training step with the task's loss.
  model = classifier.Classifier(build_model(config.model, dtype=config.dtype), task.num_labels,
                                ft.dropout_rate)
  state = step.create_train_state(config, jax.random.PRNGKey(ft.seed), model=model)
  state = classifier.with_pretrained_encoder(state, pretrained.state)
  loss_fn = functools.partial(task_loss_sums, regression=task.is_regression)
  train_fn = jax.jit(functools.partial(step.train_step, loss_fn=loss_fn), donate_argnums=0)
  predict_fn = jax.jit(functools.partial(predict_step, regression=task.is_regression))
  logging.info("Fine-tuning step-%d encoder on %s: %d train examples, %d steps.",
               pretrained.step, task.tfds_name, len(train_split), config.num_train_steps)

  # Epochs of shuffled batches; metrics are read only at log steps and epoch ends.
  stale = epath.Path(workdir) / metrics_io.METRICS_FILE
  if jax.process_index() == 0 and stale.exists():   # a fine-tuning run never resumes
    stale.unlink()
  writer = metrics_io.MetricsWriter(workdir, tensorboard)
  rng = np.random.default_rng(ft.seed)
  steps, pending, scores = 0, [], {}
  try:
    for epoch in range(1, ft.epochs + 1):
      for batch in tasks.batches(train_split, ft.batch_size, rng):
        state, step_metrics = train_fn(state, batch)
        steps += 1
        pending.append((steps, step_metrics))
        if steps % ft.log_every_steps == 0:
          pending = _flush(pending, writer)
      pending = _flush(pending, writer)
      scores = {name: evaluate_split(predict_fn, state, split, task, ft.eval_batch_size)
                for name, split in eval_splits.items()}
      row = {f"{name}/{metric}": value for name, values in scores.items()
             for metric, value in values.items()}
      score = tasks.task_score(scores)
      writer.write_scalars(steps, {"epoch": epoch, **row, "score": score})
      logging.info("epoch %d | step %d | %s | score %.2f", epoch, steps,
                   " ".join(f"{k} {v:.4f}" for k, v in row.items()), score)
  finally:
    writer.close()

  result = {"task": task.name, "score": score, "metrics": scores,
            "pretrained_workdir": (pretrained_workdir if storage.is_remote(pretrained_workdir)
                                   else os.path.abspath(pretrained_workdir)),
            "pretrained_step": int(pretrained.step), "steps": steps,
            "train_examples": len(train_split)}
  if jax.process_index() == 0:
    (epath.Path(workdir) / RESULT_FILE).write_text(json.dumps(result, indent=2))
  return result


def _flush(pending: list[tuple[int, dict]], writer) -> list:
  """Checks the pending steps' metrics and writes one row at the last of them (mean loss, last
  grad norm and learning rate); returns []."""
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
