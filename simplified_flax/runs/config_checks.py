"""The whole config checked once per start, before anything is built, read or written.

Every entry point calls `validate_run_config` (finetune: `validate_finetune_config`) first: a bad
value fails in a second with one `ConfigError` line naming the field and the fix. It reads no
file and runs no JAX; the model, the train step and the placement then trust the config.
"""
import numbers
from operator import attrgetter

from simplified_flax.fast import attention_kernels
from simplified_flax.fast import grad_rules
from simplified_flax.model import layer_stack
from simplified_flax.model import layers
from simplified_flax.model import rope
from simplified_flax.model import transformer
from simplified_flax.model import valproj

SCHEDULES = ("linear", "cosine", "rsqrt", "constant")
OPTIMIZERS = ("adamw", "muon")   # optimizer.name (training/optimizer.py builds each)
PARALLEL_MODES = ("jit", "pmap")
TOKENIZERS = ("byte", "sentencepiece", "bpe")   # or "hf:<tokenizer.json | folder | hub name>"


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the fix."""


def require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def one_of(value, allowed, field: str) -> None:
  require(value in allowed, f"{field}={value!r} is unknown: use one of {list(allowed)}.")


def _in_range(config, field: str, low: float, high: float | None = None, *,
              low_open: bool = False, high_open: bool = False, meaning: str = "",
              prefix: str = "", integer: bool = False, unset: str = "") -> None:
  """A number (`integer`: an integer) in [low, high], the open ends as asked (high=None: no
  upper bound); given `unset` (what None means), None too."""
  value = attrgetter(field)(config)
  kind, noun = (numbers.Integral, "an integer") if integer else (numbers.Real, "a number")
  ok = isinstance(value, kind) and not isinstance(value, bool) and (
      value > low if low_open else value >= low) and (
          high is None or (value < high if high_open else value <= high))
  bound = (f"{'>' if low_open else '>='} {low}" if high is None else
           f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")
  require((unset and value is None) or ok, f"{prefix}{field}={value!r} must be "
          f"{f'unset ({unset}) or ' if unset else ''}{noun} {bound}{meaning}.")


def _int_at_least(config, field: str, low: int, meaning: str = "", prefix: str = "", *,
                  unset: str = "") -> None:
  _in_range(config, field, low, meaning=meaning, prefix=prefix, integer=True, unset=unset)


def validate_run_config(config, device_count: int | None = None) -> None:
  """Raises ConfigError for the first field of `config` that cannot work (an unset
  `model.vocab_size` passes); given `device_count`, the batch must split over the devices."""
  validate_model_config(config.model, require_vocab=False)
  _training_rules(config)
  _parallel_rules(config, device_count)
  _optimizer_rules(config)
  _data_rules(config)


def validate_model_config(m, require_vocab: bool = True) -> None:
  """Raises ConfigError for a `config.model` that cannot build a working model."""
  require((m.vocab_size is None and not require_vocab) or (m.vocab_size or 0) > 0,
          f"model.vocab_size={m.vocab_size!r}: set it to the tokenizer's vocabulary size "
          f"(training does this from config.data).")
  for name in ("n_layer", "n_embd", "n_head", "context_length", "max_position_embeddings",
               "mlp_width_mult"):
    _int_at_least(m, name, 1, prefix="model.")
  require(m.n_embd % m.n_head == 0,
          f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}: choose "
          f"n_embd = n_head * head_dim.")
  require(m.context_length <= m.max_position_embeddings,
          f"model.context_length={m.context_length} is longer than the position table "
          f"model.max_position_embeddings={m.max_position_embeddings}: raise "
          f"max_position_embeddings or shorten context_length.")
  for name, allowed in (("kind", ("decoder", "encoder")), ("norm_type", layers.NORM_TYPES),
                        ("norm_position", layers.NORM_POSITIONS),
                        ("qk_norm_type", ("none", "rmsnorm")),
                        ("dot_norm_type", ("none", "tanh")), ("activation", layers.ACTIVATIONS),
                        ("val_init_type", layers.INIT_TYPES),
                        ("proj_init_type", layers.INIT_TYPES),
                        ("attention_impl", attention_kernels.REQUESTS),
                        ("tie_valproj_init", valproj.TIE_MODES)):
    one_of(m[name], allowed, f"model.{name}")
  try:
    grad_rules.parse(grad_rules.mode_of(m))
  except ValueError as error:
    raise ConfigError(str(error)) from None
  for name in ("scan_layers", "remat"):
    one_of(m.get(name, False), (False, True), f"model.{name}")
  one_of(m.get("loss_keep_logits", True), (False, True), "model.loss_keep_logits")
  one_of(m.get("attn_output_gate", False), (False, True), "model.attn_output_gate")
  one_of(m.get("tie_head", True), (False, True), "model.tie_head")
  one_of(m.get("embedding_scale", "none"), ("none", "learned"), "model.embedding_scale")
  one_of(m.get("position_embedding", "learned"), rope.POSITION_EMBEDDINGS,
         "model.position_embedding")
  if rope.uses_rope(m):
    require((m.n_embd // m.n_head) % 2 == 0,
            f"model.position_embedding='rope' rotates pairs of each head's entries, but the head "
            f"dimension n_embd / n_head = {m.n_embd // m.n_head} is odd: choose an even one.")
    _in_range(m, "rope_theta", 1, low_open=True, prefix="model.",
              meaning=" (the rotary frequencies' base, e.g. 10000)")
  if m.get("embedding_scale_init") is not None:
    _in_range(m, "embedding_scale_init", 0, low_open=True, prefix="model.",
              meaning=" (the embedding scalar's start; unset: sqrt(n_embd))")
  for where in ("attn", "mlp", "final"):
    if f"alpha_init_{where}_norm" in m:   # absent from configs saved before them
      _in_range(m, f"alpha_init_{where}_norm", 0, low_open=True, prefix="model.",
                meaning=" (DyT's / Derf's alpha_0)")
  one_of(m.get("scan_residuals", "matmuls"), layer_stack.SCAN_RESIDUALS, "model.scan_residuals")
  _in_range(m, "norm_eps", 0, low_open=True, prefix="model.")
  _in_range(m, "dropout_rate", 0, 1, high_open=True, prefix="model.")
  _model_structure_rules(m)
  _ngpt_and_depth_mup_rules(m)


def _ngpt_and_depth_mup_rules(m) -> None:
  """nGPT (`model.ngpt`, model/ngpt.py) and CompleteP (`model.depth_mup_*`, model/block.py)."""
  ngpt = m.get("ngpt", False)   # absent from configs saved before it
  one_of(ngpt, (False, True), "model.ngpt")
  if ngpt:
    require(m.kind == "decoder", f"model.ngpt=True is nGPT's decoder; model.kind={m.kind!r} "
            "has no nGPT form here: use model.kind='decoder' or model.ngpt=False.")
    require(not m.parallel_layers, "model.parallel_layers=True has no nGPT form (its layer "
            "is sequential, model/ngpt.py): set model.parallel_layers=False.")
  if m.get("depth_mup_alpha") is None:
    return
  require(not ngpt, f"model.depth_mup_alpha={m.depth_mup_alpha!r} scales residual branches, "
          "which nGPT's normalised update does not have: unset model.depth_mup_alpha or set "
          "model.ngpt=False.")
  _in_range(m, "depth_mup_alpha", 0.5, 1, prefix="model.",
            meaning=" (1: CompleteP; 0.5: the 1/sqrt(L) branches of Yang et al.)")
  _int_at_least(m, "depth_mup_base_layers", 1, prefix="model.", meaning=(
      ": the depth L_base at which the learning rate was tuned and the block is Pre-LN's "
      "(e.g. --config.model.depth_mup_base_layers=4)"))


def _model_structure_rules(m) -> None:
  """Settings that conflict with each other; the tied head's loss chunking and padding."""
  if m.parallel_layers:
    require(m.attn_block_skip_gain == 0,
            f"model.attn_block_skip_gain={m.attn_block_skip_gain} has no effect with "
            f"model.parallel_layers=True (the parallel block's only skip is "
            f"mlp_block_skip_gain): set --config.model.attn_block_skip_gain=0.")
    require(m.norm_position == "pre",
            f"model.norm_position={m.norm_position!r} is not supported with "
            f"model.parallel_layers=True: the parallel block normalises its input once; "
            f"use norm_position='pre'.")
  require(m.norm_position != "peri" or m.norm_type != "none",
          "model.norm_position='peri' norms each sub-layer's output, but model.norm_type='none' "
          "has no norm to put there: set model.norm_type (e.g. 'rmsnorm') or use "
          "norm_position='pre'.")
  require(m.tie_valproj_init == "none" or (m.value_skip_gain is not None
                                           and m.proj_skip_gain is not None),
          f"model.tie_valproj_init={m.tie_valproj_init!r} ties the fixed matrices of "
          f"reparameterised Value/Proj layers, but model.value_skip_gain={m.value_skip_gain} / "
          f"model.proj_skip_gain={m.proj_skip_gain} make them plain linears: set both skip "
          f"gains (e.g. 1.0) or use tie_valproj_init='none'.")
  require(m.attention_impl != "fused" or m.dot_norm_type == "none",
          "model.dot_norm_type='tanh' soft-caps logits, which jax.nn.dot_product_attention "
          "cannot: use model.attention_impl='explicit'.")
  for name, low, meaning in (
      ("loss_vocab_chunk_size", 0, " (vocabulary entries per loss chunk; 0: full logits)"),
      ("vocab_pad_multiple", 1, " (1: no padding; 128 pads the head's matmul to 128s)")):
    if name in m:   # absent in configs saved before it existed
      _int_at_least(m, name, low, meaning, prefix="model.")


def _training_rules(config) -> None:
  for name in ("batch_size", "grad_accum_steps"):
    _int_at_least(config, name, 1)
  _int_at_least(config, "num_train_steps", 1, unset="one epoch of the prepared training data")
  require(config.batch_size % config.grad_accum_steps == 0,
          f"grad_accum_steps={config.grad_accum_steps} must divide batch_size="
          f"{config.batch_size}.")
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
  _int_at_least(config, "restore_step", 0, " (0: start over; else a kept checkpoint step)",
                unset="the latest good checkpoint")
  _int_at_least(config, "diagnostics_every", 0, " (0: never)")
  budget = config.get("storage_retry_budget_s", 120.0)   # absent in configs saved before it
  require(isinstance(budget, numbers.Real) and not isinstance(budget, bool)
          and 0 < budget <= 86_400, f"storage_retry_budget_s={budget!r} must be a number in "
          "(0, 86400]: the seconds one remote read or write may spend retrying.")
  _int_at_least(config, "seed", 0)


def _parallel_rules(config, device_count: int | None) -> None:
  """The mode, the FSDP degree and, given `device_count`, the split of the global batch."""
  fsdp = config.parallel.fsdp
  one_of(config.parallel.mode, PARALLEL_MODES, "parallel.mode")
  _int_at_least(config, "parallel.fsdp", 1)
  require(fsdp == 1 or config.parallel.mode == "jit",
          f"parallel.fsdp={fsdp} shards parameters only under parallel.mode='jit': set "
          f"parallel.mode='jit' or parallel.fsdp=1.")
  if device_count is not None:
    require(config.batch_size % device_count == 0,
            f"batch_size={config.batch_size} does not split over the {device_count} devices: "
            f"use a multiple of {device_count}.")
    require(device_count % fsdp == 0,
            f"parallel.fsdp={fsdp} must divide the {device_count} devices.")


def _optimizer_rules(config) -> None:
  o = config.optimizer
  one_of(o.get("name", "adamw"), OPTIMIZERS, "optimizer.name")
  one_of(o.schedule, SCHEDULES, "optimizer.schedule")
  _in_range(config, "optimizer.warmup_fraction", 0, 1)
  _in_range(config, "optimizer.learning_rate", 0, low_open=True)
  _int_at_least(config, "optimizer.warmup_steps", 0, unset="use warmup_fraction")
  _in_range(config, "optimizer.weight_decay", 0)
  for beta in ("b1", "b2"):
    _in_range(config, f"optimizer.{beta}", 0, 1, high_open=True)
  _in_range(config, "optimizer.eps", 0, low_open=True)
  _in_range(config, "optimizer.grad_clip_norm", 0, meaning=" (0: no clipping)")
  require(o.get("name", "adamw") == "adamw" or config.model.get("depth_mup_alpha") is None,
          f"optimizer.name={o.get('name')!r} with model.depth_mup_alpha="
          f"{config.model.get('depth_mup_alpha')}: CompleteP's learning-rate and eps rules "
          "(Dey et al. 2025, Table 1) are AdamW's; use optimizer.name='adamw'.")
  if o.get("name", "adamw") == "muon":
    _in_range(config, "optimizer.muon_beta", 0, 1, high_open=True)
    _in_range(config, "optimizer.muon_rms", 0, low_open=True)


def _data_rules(config) -> None:
  d = config.data
  require(isinstance(d.name, str) and d.name.strip() != "",
          f"data.name={d.name!r} must name a dataset: 'python_code', 'text_files', "
          f"'hf:<hub name | folder | files>' or a tensorflow-datasets name.")
  require(d.name != "text_files" or bool(d.paths),
          "data.name='text_files' needs data.paths: give comma-separated files or globs, "
          "e.g. --config.data.paths='corpus/*.txt'.")
  if not (isinstance(d.tokenizer, str) and d.tokenizer.startswith("hf:")):
    one_of(d.tokenizer, TOKENIZERS, "data.tokenizer")
  require(d.tokenizer != "hf:" and d.name != "hf:",
          "data.name / data.tokenizer 'hf:' needs what follows it: a hub name, folder or file, "
          "e.g. --config.data.tokenizer=hf:tokenizer.json.")
  _int_at_least(config, "data.spm_vocab_size", 5, " (4 special pieces + 1)")
  _int_at_least(config, "data.spm_train_chars", 1)
  for field, low, why in (("bpe_vocab_size", 259, " (3 special ids + 256 bytes)"),
                          ("bpe_train_chars", 1, ""), ("max_train_docs", 0, " (0: all)"),
                          ("max_eval_docs", 0, " (0: all)")):
    if field in d:     # configs saved before these fields existed lack them
      _int_at_least(config, f"data.{field}", low, why)
  if "shuffle_seed" in d:
    _int_at_least(config, "data.shuffle_seed", 0, unset="the dataset's order")
  _in_range(config, "data.mlm_rate", 0, 1, low_open=True, high_open=True)
  for field in ("shuffle_buffer", "shard_docs"):   # only some pipelines have them
    if field in d:
      _int_at_least(config, f"data.{field}", 1)
  _int_at_least(config, "data.prefetch", 0, " (0: no background thread)")
  for field, example in (("train_split", "train"), ("eval_split", "validation")):
    require(isinstance(d[field], str) and d[field] != "",
            f"data.{field}={d[field]!r} must name a split, e.g. '{example}'.")
  # One split name for both is the same documents, unless data.eval_name (hf: data only)
  # names a second source whose split it is (the corpora and their shards are kept apart).
  second_source = d.name.startswith("hf:") and _source(d.get("eval_name")) not in (
      "", _source(d.name))
  require(d.train_split != d.eval_split or second_source,
          f"data.train_split == data.eval_split == {d.train_split!r} with one source: "
          "evaluation would read the training documents. Set data.eval_split to another split, "
          "or (hf: data) data.eval_name to a second source whose split it is, e.g. "
          "--config.data.name=hf:DIR/train --config.data.eval_name=hf:DIR/valid "
          "--config.data.eval_split=train.")


def _source(name: str | None) -> str:
  """An "hf:" data source as written, without the prefix and a trailing slash."""
  name = (name or "").strip()
  return (name[len("hf:"):].strip() if name.startswith("hf:") else name).rstrip("/")


def validate_finetune_config(ft, pretrain_config=None) -> None:
  """Raises ConfigError for a GLUE fine-tuning recipe (`--finetune.*`) that cannot work, or for
  a given pretraining config (the run's saved one was checked when it started)."""
  for name in ("epochs", "batch_size", "eval_batch_size", "log_every_steps"):
    _int_at_least(ft, name, 1, prefix="finetune.")
  for name in ("max_train_examples", "max_eval_examples"):
    _int_at_least(ft, name, 0, " (0: all)", prefix="finetune.")
  _int_at_least(ft, "seed", 0, prefix="finetune.")
  _in_range(ft, "learning_rate", 0, low_open=True, prefix="finetune.")
  _int_at_least(ft, "seq_len", 1, prefix="finetune.", unset="the model's context_length")
  _in_range(ft, "warmup_fraction", 0, 1, prefix="finetune.")
  _in_range(ft, "dropout_rate", 0, 1, high_open=True, prefix="finetune.")
  _in_range(ft, "weight_decay", 0, prefix="finetune.")
  if pretrain_config is not None:
    validate_run_config(pretrain_config)
