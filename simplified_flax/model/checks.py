"""The model config's rules, checked before anything is compiled (the training, optimiser,
data and parallelism rules: runs/config_checks.py).

Every error is a `ConfigError` (a ValueError) whose message starts with the dotted name of the
offending field and says how to fix it, e.g.
    model.n_embd=100 is not divisible by model.n_head=12: choose n_embd = n_head * head_dim.
"""
from simplified_flax.model import attention_kernels
from simplified_flax.model import grad_rules
from simplified_flax.model import layers
from simplified_flax.model import valproj


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field and the fix."""


def require(ok: bool, message: str) -> None:
  """Raises ConfigError(message) unless `ok`."""
  if not ok:
    raise ConfigError(message)


def one_of(value, allowed, field: str) -> None:
  """Raises ConfigError unless `value` is one of `allowed`, naming `field` and the choices."""
  require(value in allowed, f"{field}={value!r} is unknown: use one of {list(allowed)}.")


def validate_model_config(m, prefix: str = "model", require_vocab: bool = True) -> None:
  """Raises ConfigError for a model config that cannot build a working model.

  `require_vocab=False` accepts an unset vocab_size (filled in later from the tokenizer).
  """
  f = lambda name: f"{prefix}.{name}"
  one_of(m.kind, ("decoder", "encoder"), f("kind"))
  vocab = m.vocab_size
  require((vocab is None and not require_vocab) or (vocab is not None and vocab > 0),
          f"{f('vocab_size')}={vocab!r}: set it to the tokenizer's vocabulary size (the "
          f"training script does this from config.data; pass --config.model.vocab_size=N "
          f"when building a model directly).")
  for name in ("n_layer", "n_embd", "n_head", "context_length", "max_position_embeddings",
               "mlp_width_mult"):
    value = m[name]
    require(isinstance(value, int) and value > 0,
            f"{f(name)}={value!r} must be a positive integer.")
  require(m.n_embd % m.n_head == 0,
          f"{f('n_embd')}={m.n_embd} is not divisible by {f('n_head')}={m.n_head}: choose "
          f"n_embd = n_head * head_dim.")
  require(m.context_length <= m.max_position_embeddings,
          f"{f('context_length')}={m.context_length} is longer than the position table "
          f"{f('max_position_embeddings')}={m.max_position_embeddings}: raise "
          f"max_position_embeddings or shorten context_length.")
  one_of(m.norm_type, layers.NORM_TYPES, f("norm_type"))
  one_of(m.norm_position, ("pre", "post"), f("norm_position"))
  one_of(m.qk_norm_type, ("none", "rmsnorm"), f("qk_norm_type"))
  one_of(m.dot_norm_type, ("none", "tanh"), f("dot_norm_type"))
  one_of(m.activation, layers.ACTIVATIONS, f("activation"))
  one_of(m.val_init_type, layers.INIT_TYPES, f("val_init_type"))
  one_of(m.proj_init_type, layers.INIT_TYPES, f("proj_init_type"))
  one_of(m.attention_impl, attention_kernels.REQUESTS, f("attention_impl"))
  one_of(grad_rules.mode_of(m), grad_rules.MODES, f("grad_rules"))
  one_of(m.tie_valproj_init, valproj.TIE_MODES, f("tie_valproj_init"))
  for name in ("scan_layers", "remat"):
    one_of(m.get(name, False), (False, True), f(name))
  require(m.norm_eps > 0, f"{f('norm_eps')}={m.norm_eps} must be positive.")
  require(0 <= m.dropout_rate < 1, f"{f('dropout_rate')}={m.dropout_rate} must be in [0, 1).")

  _validate_head(m, f)

  if m.parallel_layers:
    require(m.attn_block_skip_gain == 0,
            f"{f('attn_block_skip_gain')}={m.attn_block_skip_gain} has no effect with "
            f"{f('parallel_layers')}=True (the parallel block's only skip is "
            f"mlp_block_skip_gain): set --config.{f('attn_block_skip_gain')}=0.")
    require(m.norm_position == "pre",
            f"{f('norm_position')}={m.norm_position!r} is not supported with "
            f"{f('parallel_layers')}=True: the parallel block normalises its input once; "
            f"use norm_position='pre'.")
  if m.tie_valproj_init != "none":
    require(m.value_skip_gain is not None and m.proj_skip_gain is not None,
            f"{f('tie_valproj_init')}={m.tie_valproj_init!r} ties the fixed matrices of "
            f"reparameterised Value/Proj layers, but {f('value_skip_gain')}="
            f"{m.value_skip_gain} / {f('proj_skip_gain')}={m.proj_skip_gain} make them plain "
            f"linears: set both skip gains (e.g. 1.0) or use tie_valproj_init='none'.")
  if m.attention_impl == "fused":
    require(m.dot_norm_type == "none",
            f"{f('dot_norm_type')}='tanh' soft-caps logits, which "
            f"jax.nn.dot_product_attention cannot: use {f('attention_impl')}='explicit'.")


def _validate_head(m, f) -> None:
  """The tied head's loss chunking and vocabulary padding (absent in configs saved before
  they existed: the defaults)."""
  chunk = m.get("loss_vocab_chunk_size", 0)
  require(isinstance(chunk, int) and chunk >= 0,
          f"{f('loss_vocab_chunk_size')}={chunk!r} must be a whole number of vocabulary "
          f"entries per loss chunk (e.g. 8192), or 0 to score the full logits.")
  multiple = m.get("vocab_pad_multiple", 1)
  require(isinstance(multiple, int) and multiple > 0,
          f"{f('vocab_pad_multiple')}={multiple!r} must be a positive integer (1: no padding; "
          f"128 pads the head's matmul to a multiple of 128).")
