"""Evaluation of a state, and read-only access to a training run's workdir (its saved config,
tokenizer and checkpoints), safe while the run is still writing there."""
import dataclasses
import math
from typing import Callable, Iterable

from etils import epath
import jax
import ml_collections

from simplified_flax.config_files import CONFIG_FILE
from simplified_flax import retries
from simplified_flax import storage
from simplified_flax.data.errors import DataError
from simplified_flax.data.pipeline import shard_root
from simplified_flax.runs import checkpoints
from simplified_flax.runs import config_checks
from simplified_flax.training import losses
from simplified_flax.training.placement import Placement, first_device_target, primary_first
from simplified_flax.model import quantize
from simplified_flax.training.step import create_train_state, eval_step


def run_eval(eval_fn: Callable, state, batches: Iterable[dict], placement) -> dict[str, float]:
  """Token-mean loss and perplexity (encoder: and MLM accuracy) of `batches` (local rows) under
  compiled `eval_fn`, with one host sync after every batch is dispatched."""
  total = None
  for batch in batches:
    sums = eval_fn(state, placement.place_batch(batch))
    total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
  if total is None:
    raise ValueError("The eval split gave no batches (eval_steps must be positive).")
  total = placement.host_metrics(total)
  tokens = float(total["weight_sum"])
  loss = float(total["loss_sum"]) / max(tokens, 1.0)
  result = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)),
            "eval_tokens": tokens}
  if "correct_sum" in total:
    result["eval_mlm_accuracy"] = losses.mlm_accuracy(total)
  return result


def input_pipeline(config, workdir: str, pipeline=None):
  """`pipeline`, or the config's own (built on process 0 first); sets a None
  `config.model.vocab_size` from its tokenizer and a None `config.num_train_steps` to one epoch
  of its training rows (printing the plan)."""
  if pipeline is None:
    from simplified_flax.data import build_pipeline  # pylint: disable=import-outside-toplevel
    pipeline = primary_first(lambda: build_pipeline(config, workdir=workdir), "data")
  if config.model.vocab_size is None:
    config.model.vocab_size = pipeline.tokenizer.vocab_size
  if config.num_train_steps is None:   # one epoch: known once the data is prepared
    config.num_train_steps = pipeline.train.batches_per_epoch
    rows, steps = pipeline.train.source, config.num_train_steps
    if jax.process_index() == 0:
      print(f"Plan: one epoch of {rows.num_docs:,} documents = {rows.num_rows:,} windows of "
            f"{rows.seq_len} tokens = {steps:,} steps of {config.batch_size} "
            f"({steps * config.batch_size * rows.seq_len:,} tokens).", flush=True)
  return pipeline


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a training run wrote to `<workdir>/config.json`; a missing or damaged
  one (not JSON, not an object) is a one-line WorkdirError, and nothing is written."""
  path = epath.Path(workdir) / CONFIG_FILE     # epath: the workdir may be gs://...
  if not storage.exists(path):
    raise checkpoints.WorkdirError(f"{path} does not exist: is {workdir!r} the --workdir of a "
                                   f"training run?")
  saved = storage.read_json_object(path, checkpoints.WorkdirError, (
      "Restore it from a copy of the run's config, or rerun train with the same --config "
      f"flags and --workdir={workdir} (training rewrites it)."))
  return ml_collections.ConfigDict(saved)


def load_tokenizer(config, workdir: str):
  """The run's tokenizer: byte, hf:, or the SentencePiece model / BPE the run saved (never
  trains one)."""
  from simplified_flax.data import tokenizers  # pylint: disable=import-outside-toplevel

  def no_training_texts():
    raise DataError(f"{workdir} holds no trained tokenizer ({tokenizers.TOKENIZER_FILENAME} or "
                    "tokenizer.json) and data.spm_model_path is unset: use the tokenizer the run "
                    "was trained with.")
  return tokenizers.build_tokenizer(config.data, workdir, no_training_texts)


def restore_read_only(workdir: str, config, target=None, step: int | None = None):
  """checkpoints.Restored: the newest intact checkpoint of `workdir` (or `step`), read without
  creating, cleaning up or moving anything. `config` (`load_config`) must have the saved
  parameter shapes (else IncompatibleCheckpointError); `target` gives the shardings (default:
  this process's first device). Raises checkpoints.WorkdirError without a checkpoint."""
  if target is None:
    abstract = jax.eval_shape(lambda: create_train_state(config, jax.random.PRNGKey(0)))
    target = first_device_target(abstract)
  manager = checkpoints.open_read_only(workdir)
  try:
    restored = checkpoints.restore_latest(manager, target, config.to_dict(), workdir,
                                          read_only=True, step=step)
  finally:
    manager.close()
  if restored is None:
    raise checkpoints.WorkdirError(f"No checkpoint under {workdir}/checkpoints yet: train first "
                                   f"(python -m simplified_flax.train --workdir={workdir} ...).")
  return restored


def _on_full_logits(state, batch, axis_name=None):
  """`eval_step` with the loss read from the model's full logits (the chunked head off)."""
  full = state.replace(spec=dataclasses.replace(state.spec, head=None))
  return eval_step(full, batch, axis_name)


def evaluate(workdir: str, eval_steps: int | None = None, pipeline=None,
             step: int | None = None, quantize_scheme: str | None = None) -> dict:
  """Evaluates the latest good checkpoint of `workdir` (or checkpoint `step`) on the eval split.

  `quantize_scheme` ("w8", "a8" or "w8a8"; model/quantize.py) evaluates the same batches again
  with int8 fake-quantised linear layers, adding `quantize`, `quantized_eval_loss` and
  `quantized_loss_increase`; both then score the full logits, so that the tied head is
  quantised too (the chunked loss is out of the quantiser's reach).
  """
  quantizing = quantize.parse_scheme(quantize_scheme) != (False, False)   # fails before reading
  config = load_config(workdir)
  config_checks.validate_run_config(config, jax.device_count())
  retries.configure_from(config, workdir, shard_root(config.data))
  pipeline = input_pipeline(config, workdir, pipeline)
  placement = Placement.from_config(config)
  abstract = jax.eval_shape(lambda: create_train_state(config, jax.random.PRNGKey(config.seed)))
  restored = restore_read_only(workdir, config, placement.restore_target(abstract), step=step)
  state = placement.shard_state(restored.state)
  batches = lambda: pipeline.eval_batches(eval_steps or config.eval_steps)
  step_fn = _on_full_logits if quantizing else eval_step
  eval_fn = placement.compile_step(step_fn, abstract, returns_state=False)
  result = {"step": restored.step, **run_eval(eval_fn, state, batches(), placement)}
  if quantizing:
    quantized_fn = placement.compile_step(quantize.quantized(step_fn, quantize_scheme),
                                          abstract, returns_state=False)
    quantized = run_eval(quantized_fn, state, batches(), placement)
    result.update(quantize=quantize_scheme, quantized_eval_loss=quantized["eval_loss"],
                  quantized_loss_increase=quantized["eval_loss"] - result["eval_loss"])
  return result
