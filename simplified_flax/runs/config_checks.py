"""The whole experiment config checked at once, before anything is built or written.

`validate_run_config(config)` runs the model's rules (`model/checks.py`), then every rule of
the training, parallelism, optimiser and data fields. It reads nothing from disk and writes
nothing: an entry point calls it first, so that a bad value fails in a second with one
`ConfigError` naming the field and the fix, before a tokenizer is trained, a dataset is
prepared or a file appears in the workdir. `validate_config(config)` is the same without the
data and device rules: what `step.create_train_state` checks.
"""
import numbers

from simplified_flax.model import checks
from simplified_flax.model import transformer
from simplified_flax.model.checks import ConfigError, one_of, require

SCHEDULES = ("linear", "cosine", "rsqrt", "constant")
OPTIMIZERS = ("adamw", "muon")   # optimizer.name (training/optimizer.py builds each)
PARALLEL_MODES = ("jit", "pmap")
TOKENIZERS = ("byte", "sentencepiece")

__all__ = ["ConfigError", "validate_config", "validate_run_config", "validate_finetune_config"]


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int_at_least(config, field: str, low: int, meaning: str = "", prefix: str = "") -> None:
  value = _get(config, field)
  require(_is_int(value) and value >= low,
          f"{prefix}{field}={value!r} must be an integer >= {low}{meaning}.")


def _in_range(config, field: str, low: float, high: float, *, low_open: bool = False,
              high_open: bool = False, prefix: str = "") -> None:
  value = _get(config, field)
  above = value > low if low_open else value >= low
  below = value < high if high_open else value <= high
  interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
  require(_is_number(value) and above and below,
          f"{prefix}{field}={value!r} must lie in {interval}.")


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def validate_config(config) -> None:
  """Raises ConfigError for the first model, training, parallelism or optimiser field of
  `config` that cannot work (no data or device rules). Pure and cheap, as every check here:
  no file is read or written, no JAX computation runs."""
  checks.validate_model_config(config.model, require_vocab=False)
  _training_rules(config)
  _optimizer_rules(config)


def validate_run_config(config, device_count: int | None = None) -> None:
  """Raises ConfigError for the first field of `config` that cannot work. `device_count`
  (default: none checked) is the number of devices the global batch is split over."""
  validate_config(config)
  if device_count is not None:
    device_rules(config, device_count)
  _data_rules(config)


def device_rules(config, device_count: int) -> None:
  """The global batch and the parameter-sharding axis split over `device_count` devices."""
  require(config.batch_size % device_count == 0,
          f"batch_size={config.batch_size} does not split over the {device_count} devices: "
          f"use a multiple of {device_count}.")
  require(device_count % config.parallel.fsdp == 0,
          f"parallel.fsdp={config.parallel.fsdp} must divide the {device_count} devices.")


def _training_rules(config) -> None:
  batch, accum, steps = config.batch_size, config.grad_accum_steps, config.num_train_steps
  require(_is_int(batch) and batch > 0, f"batch_size={batch!r} must be a positive integer.")
  require(accum >= 1 and batch % accum == 0,
          f"grad_accum_steps={accum!r} must be >= 1 and divide batch_size={batch}.")
  require(_is_int(steps) and steps > 0, f"num_train_steps={steps!r} must be a positive integer.")
  one_of(config.dtype, tuple(transformer.DTYPES), "dtype")
  _int_at_least(config, "log_every_steps", 0, " (0: log the last step only)")
  _int_at_least(config, "eval_every_steps", 0, " (0: never evaluate)")
  _int_at_least(config, "eval_steps", 1, " (eval batches per evaluation)")
  _int_at_least(config, "checkpoint_every_steps", 0, " (0: save the last step only)")
  _int_at_least(config, "max_to_keep", 1,
                ": a run keeps at least its latest checkpoint, or a rerun would start over")
  _int_at_least(config, "keep_every_steps", 0, " (0: keep only the latest max_to_keep)")
  keep_every, every = config.keep_every_steps, config.checkpoint_every_steps
  require(keep_every == 0 or every == 0 or keep_every % every == 0,
          f"keep_every_steps={keep_every} is not a multiple of checkpoint_every_steps="
          f"{every}: no saved step would be kept; use a multiple (e.g. {every * 10}).")
  restore = config.restore_step
  require(restore is None or (_is_int(restore) and restore >= 0),
          f"restore_step={restore!r} must be unset (the latest good checkpoint), 0 (start "
          f"over) or a kept checkpoint step.")
  _int_at_least(config, "diagnostics_every", 0, " (0: never)")
  _int_at_least(config, "seed", 0)
  parallel_rules(config)


def parallel_rules(config) -> None:
  """Raises ConfigError unless `config.parallel` names a mode and an FSDP degree that work
  together (reads only `config.parallel`)."""
  one_of(config.parallel.mode, PARALLEL_MODES, "parallel.mode")
  _int_at_least(config, "parallel.fsdp", 1)
  require(config.parallel.fsdp == 1 or config.parallel.mode == "jit",
          f"parallel.fsdp={config.parallel.fsdp} shards parameters only under "
          f"parallel.mode='jit': set parallel.mode='jit' or parallel.fsdp=1.")


def _optimizer_rules(config) -> None:
  o = config.optimizer
  one_of(o.get("name", "adamw"), OPTIMIZERS, "optimizer.name")
  one_of(o.schedule, SCHEDULES, "optimizer.schedule")
  require(0 <= o.warmup_fraction <= 1,
          f"optimizer.warmup_fraction={o.warmup_fraction} must be in [0, 1].")
  require(_is_number(o.learning_rate) and o.learning_rate > 0,
          f"optimizer.learning_rate={o.learning_rate!r} must be a positive number.")
  require(o.warmup_steps is None or (_is_int(o.warmup_steps) and o.warmup_steps >= 0),
          f"optimizer.warmup_steps={o.warmup_steps!r} must be unset (use warmup_fraction) "
          f"or an integer >= 0.")
  require(_is_number(o.weight_decay) and o.weight_decay >= 0,
          f"optimizer.weight_decay={o.weight_decay!r} must be >= 0.")
  _in_range(config, "optimizer.b1", 0, 1, high_open=True)
  _in_range(config, "optimizer.b2", 0, 1, high_open=True)
  require(_is_number(o.eps) and o.eps > 0, f"optimizer.eps={o.eps!r} must be positive.")
  if o.get("name", "adamw") == "muon":
    _in_range(config, "optimizer.muon_beta", 0, 1, high_open=True)
    require(_is_number(o.muon_rms) and o.muon_rms > 0,
            f"optimizer.muon_rms={o.muon_rms!r} must be a positive number.")
  require(_is_number(o.grad_clip_norm) and o.grad_clip_norm >= 0,
          f"optimizer.grad_clip_norm={o.grad_clip_norm!r} must be >= 0 (0: no clipping).")


def _data_rules(config) -> None:
  d = config.data
  require(isinstance(d.name, str) and d.name.strip() != "",
          f"data.name={d.name!r} must name a dataset: 'python_code', 'text_files' or a "
          f"tensorflow-datasets name.")
  require(d.name != "text_files" or bool(d.paths),
          "data.name='text_files' needs data.paths: give comma-separated files or globs, "
          "e.g. --config.data.paths='corpus/*.txt'.")
  one_of(d.tokenizer, TOKENIZERS, "data.tokenizer")
  _int_at_least(config, "data.spm_vocab_size", 5, " (4 special pieces + 1)")
  _int_at_least(config, "data.spm_train_chars", 1)
  _in_range(config, "data.mlm_rate", 0, 1, low_open=True, high_open=True)
  # Fields that only some data pipelines have (streaming buffers, prepared token shards).
  for field in ("shuffle_buffer", "shard_docs"):
    if field in d:
      _int_at_least(config, f"data.{field}", 1)
  _int_at_least(config, "data.prefetch", 0, " (0: no background thread)")
  require(isinstance(d.train_split, str) and d.train_split != "",
          f"data.train_split={d.train_split!r} must name a split, e.g. 'train'.")
  require(isinstance(d.eval_split, str) and d.eval_split != "",
          f"data.eval_split={d.eval_split!r} must name a split, e.g. 'validation'.")


def validate_finetune_config(ft) -> None:
  """Raises ConfigError for a GLUE fine-tuning recipe (`--finetune.*`) that cannot work."""
  for name in ("epochs", "batch_size", "eval_batch_size", "log_every_steps"):
    _int_at_least(ft, name, 1, prefix="finetune.")
  for name in ("max_train_examples", "max_eval_examples"):
    _int_at_least(ft, name, 0, " (0: all)", prefix="finetune.")
  _int_at_least(ft, "seed", 0, prefix="finetune.")
  require(_is_number(ft.learning_rate) and ft.learning_rate > 0,
          f"finetune.learning_rate={ft.learning_rate!r} must be a positive number.")
  require(ft.seq_len is None or (_is_int(ft.seq_len) and ft.seq_len >= 1),
          f"finetune.seq_len={ft.seq_len!r} must be unset (the model's context_length) or >= 1.")
  _in_range(ft, "warmup_fraction", 0, 1, prefix="finetune.")
  _in_range(ft, "dropout_rate", 0, 1, high_open=True, prefix="finetune.")
  require(_is_number(ft.weight_decay) and ft.weight_decay >= 0,
          f"finetune.weight_decay={ft.weight_decay!r} must be >= 0.")
