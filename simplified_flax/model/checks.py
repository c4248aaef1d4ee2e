"""Validation of a config before anything is compiled.

Every error is a `ConfigError` (a ValueError) whose message starts with the dotted name of the
offending field and says how to fix it, e.g.
    model.n_embd=100 is not divisible by model.n_head=12: choose n_embd = n_head * head_dim.
"""
from simplified_flax.model import attention
from simplified_flax.model import grad_rules
from simplified_flax.model import layers
from simplified_flax.model import valproj

SCHEDULES = ("linear", "cosine", "rsqrt", "constant")
PARALLEL_MODES = ("jit", "pmap")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the fix."""


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _one_of(value, allowed, field: str) -> None:
  _require(value in allowed, f"{field}={value!r} is unknown: use one of {list(allowed)}.")


def validate_model_config(m, prefix: str = "model", require_vocab: bool = True) -> None:
  """Raises ConfigError for a model config that cannot build a working model.

  `require_vocab=False` accepts an unset vocab_size (filled in later from the tokenizer).
  """
  f = lambda name: f"{prefix}.{name}"
  _one_of(m.kind, ("decoder", "encoder"), f("kind"))
  _require((m.vocab_size is None and not require_vocab) or (
      m.vocab_size is not None and m.vocab_size > 0),
           f"{f('vocab_size')}={m.vocab_size!r}: set it to the tokenizer's vocabulary size "
           f"(the training script does this from config.data; pass "
           f"--config.model.vocab_size=N when building a model directly).")
  for name in ("n_layer", "n_embd", "n_head", "context_length", "max_position_embeddings",
               "mlp_width_mult"):
    value = m[name]
    _require(isinstance(value, int) and value > 0,
             f"{f(name)}={value!r} must be a positive integer.")
  _require(m.n_embd % m.n_head == 0,
           f"{f('n_embd')}={m.n_embd} is not divisible by {f('n_head')}={m.n_head}: choose "
           f"n_embd = n_head * head_dim.")
  _require(m.context_length <= m.max_position_embeddings,
           f"{f('context_length')}={m.context_length} is longer than the position table "
           f"{f('max_position_embeddings')}={m.max_position_embeddings}: raise "
           f"max_position_embeddings or shorten context_length.")
  _one_of(m.norm_type, layers.NORM_TYPES, f("norm_type"))
  _one_of(m.norm_position, ("pre", "post"), f("norm_position"))
  _one_of(m.qk_norm_type, ("none", "rmsnorm"), f("qk_norm_type"))
  _one_of(m.dot_norm_type, ("none", "tanh"), f("dot_norm_type"))
  _one_of(m.activation, layers.ACTIVATIONS, f("activation"))
  _one_of(m.val_init_type, layers.INIT_TYPES, f("val_init_type"))
  _one_of(m.proj_init_type, layers.INIT_TYPES, f("proj_init_type"))
  _one_of(m.attention_impl, attention.IMPLS, f("attention_impl"))
  _one_of(grad_rules.mode_of(m), grad_rules.MODES, f("grad_rules"))
  _one_of(m.tie_valproj_init, valproj.TIE_MODES, f("tie_valproj_init"))
  _require(m.norm_eps > 0, f"{f('norm_eps')}={m.norm_eps} must be positive.")
  _require(0 <= m.dropout_rate < 1, f"{f('dropout_rate')}={m.dropout_rate} must be in [0, 1).")

  if m.parallel_layers:
    _require(m.attn_block_skip_gain == 0,
             f"{f('attn_block_skip_gain')}={m.attn_block_skip_gain} has no effect with "
             f"{f('parallel_layers')}=True (the parallel block's only skip is "
             f"mlp_block_skip_gain): set --config.{f('attn_block_skip_gain')}=0.")
    _require(m.norm_position == "pre",
             f"{f('norm_position')}={m.norm_position!r} is not supported with "
             f"{f('parallel_layers')}=True: the parallel block normalises its input once; "
             f"use norm_position='pre'.")
  if m.tie_valproj_init != "none":
    _require(m.value_skip_gain is not None and m.proj_skip_gain is not None,
             f"{f('tie_valproj_init')}={m.tie_valproj_init!r} ties the fixed matrices of "
             f"reparameterised Value/Proj layers, but {f('value_skip_gain')}="
             f"{m.value_skip_gain} / {f('proj_skip_gain')}={m.proj_skip_gain} make them plain "
             f"linears: set both skip gains (e.g. 1.0) or use tie_valproj_init='none'.")
  if m.attention_impl == "fused":
    _require(m.dot_norm_type == "none",
             f"{f('dot_norm_type')}='tanh' soft-caps logits, which "
             f"jax.nn.dot_product_attention cannot: use {f('attention_impl')}='explicit'.")


def validate_config(config) -> None:
  """Validates the whole experiment config (model, batch, optimiser, parallelism)."""
  validate_model_config(config.model, require_vocab=False)
  _require(isinstance(config.batch_size, int) and config.batch_size > 0,
           f"batch_size={config.batch_size!r} must be a positive integer.")
  _require(config.grad_accum_steps >= 1 and config.batch_size % config.grad_accum_steps == 0,
           f"grad_accum_steps={config.grad_accum_steps} must be >= 1 and divide "
           f"batch_size={config.batch_size}.")
  _require(config.num_train_steps > 0,
           f"num_train_steps={config.num_train_steps} must be positive.")
  _one_of(config.dtype, COMPUTE_DTYPES, "dtype")
  _one_of(config.optimizer.schedule, SCHEDULES, "optimizer.schedule")
  _require(0 <= config.optimizer.warmup_fraction <= 1,
           f"optimizer.warmup_fraction={config.optimizer.warmup_fraction} must be in [0, 1].")
  _one_of(config.parallel.mode, PARALLEL_MODES, "parallel.mode")
