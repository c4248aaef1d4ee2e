"""Decoder LM and encoder MLM: embeddings, L blocks, final norm, head (docs/model.md).

    model = build_model(config.model, dtype="bfloat16")
    variables = model.init(jax.random.key(0), tokens_BT)      # {"params", "constants"}
    logits_BTV = model.apply(variables, tokens_BT)

`constants`: the fixed anchors of reparameterised Value/Proj layers (never trained). Each
block's output ("hidden") and the explicit path's softmax ("attn_probs") are sown into
`intermediates`. `decode=True` (decoder; decode.py) reads and advances a KV cache in `cache`,
created by an init call whose T is the cache length (kv_cache.py).
"""
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from simplified_flax.model import block
from simplified_flax.model import kv_cache
from simplified_flax.model import layer_stack
from simplified_flax.model import layers
from simplified_flax.model import masks
from simplified_flax.model import ngpt
from simplified_flax.model import rope
from simplified_flax.model import valproj

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class Transformer(nn.Module):
  """Token + position embeddings (learned, or rotary inside attention), `n_layer` blocks, final
  LayerNorm, head tied to `wte` (or `lm_head` of its own, `model.tie_head=False`): tokens
  [B, T] int -> logits [B, T, V] float32. `causal` picks the decoder or the encoder."""
  cfg: Any     # FrozenConfigDict: the model config
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens_BT, **kwargs):
    """`forward` with the token table read by row lookup."""
    return self.forward(tokens_BT, **kwargs)

  @nn.nowrap
  def block_class(self) -> type:
    """The block every layer runs: `block.Block`, or nGPT's (model/ngpt.py)."""
    return ngpt.Block if self.cfg.get("ngpt", False) else block.Block

  @nn.nowrap
  def block_attributes(self) -> dict:
    """Attributes of `block_class()` beyond (cfg, layer, causal, dtype)."""
    return {}

  @nn.nowrap
  def remat_policy(self) -> Callable:
    """What a scanned block keeps for its backward under `scan_residuals="matmuls"`."""
    return jax.checkpoint_policies.checkpoint_dots

  @nn.nowrap
  def forward(self, tokens_BT, *, segment_ids=None, key_mask=None, train: bool = False,
              decode: bool = False, lengths=None, return_hidden: bool = False,
              lookup: Callable = layers.take_rows):
    """`lengths` [B] (decode only): each row's real leading tokens (default T), by which its
    cache index advances. `return_hidden`: the final norm's output [B, T, D] instead of the
    logits (for a task head or the training loss's own head). `lookup(table_VD, tokens_BT)`:
    how tokens read the `wte` table (any exact form of `layers.take_rows`)."""
    m = self.cfg
    B, T = tokens_BT.shape
    if T > m.max_position_embeddings:
      raise ValueError(f"Sequence length {T} exceeds model.max_position_embeddings="
                       f"{m.max_position_embeddings}; raise it or shorten the input.")
    anchors = self.variable("constants", "anchors", lambda: valproj.anchor_matrices(
        self.make_rng("params"), m)).value

    hypersphere = m.get("ngpt", False)   # nGPT: unit-norm rows (model/ngpt.py)
    table_init = ngpt.unit_norm_init(-1) if hypersphere else layers.normal_init(layers.PLAIN_STD)
    wte = layers.Embed(m.vocab_size, m.n_embd, name="wte", embedding_init=table_init)
    cache_index_B = None
    if decode:
      if not self.causal or segment_ids is not None or key_mask is not None or train:
        raise ValueError("decode=True is for the causal decoder at inference: no segment_ids, "
                         "key_mask or train (rows of different lengths use `lengths`).")
      cache_index_B, lengths = kv_cache.advance_index(self, B, T, lengths)
    x_BTD = wte(tokens_BT, lookup)
    if not rope.uses_rope(m):   # learned absolute positions (GPT-2); rotary ones are q's and k's
      wpe = nn.Embed(m.max_position_embeddings, m.n_embd, name="wpe", embedding_init=table_init)
      x_BTD = x_BTD + wpe(masks.token_positions(B, T, cache_index=cache_index_B,
                                                segment_ids=segment_ids))
    if m.get("embedding_scale", "none") == "learned":
      # DyT's and Derf's language models: a learnable scalar from sqrt(D) times the embedding,
      # so that the first hidden state has RMS near that of a normed one (docs/model.md).
      scale_init = m.get("embedding_scale_init") or m.n_embd ** 0.5
      scale = self.param("embedding_scale_gain", nn.initializers.constant(scale_init), (),
                         jnp.float32)
      x_BTD = x_BTD * scale
    x_BTD = x_BTD.astype(self.dtype)
    if hypersphere and not rope.uses_rope(m):
      # nGPT's first hidden state is on the sphere: E's rows are (the optimiser keeps them so),
      # E + P is not. With rotary positions it is E[token] itself, as in the authors' code.
      x_BTD = ngpt.unit_norm(x_BTD).astype(self.dtype)
    if m.norm_position == "peri":   # Peri-LN norms the embedding too (docs/model.md, "Peri-LN")
      x_BTD = layers.make_norm(m.norm_type, m.norm_eps, self.dtype, "ln_emb")(x_BTD)
    x_BTD = nn.Dropout(m.dropout_rate, deterministic=not train)(x_BTD)

    x_BTD = layer_stack.run_blocks(self, m, x_BTD, anchors, causal=self.causal, dtype=self.dtype,
                                   key_mask=key_mask, segment_ids=segment_ids, train=train,
                                   cache_index=cache_index_B, lengths=lengths)

    x_BTD = final_norm(m, self.dtype)(x_BTD)
    if return_hidden:
      return x_BTD
    # vocab_pad_multiple: the head's matmul reads a zero-padded table; its extra columns are cut.
    multiple = m.get("vocab_pad_multiple", 1)
    padded = -(-m.vocab_size // multiple) * multiple
    head_VD = wte.embedding if m.get("tie_head", True) else layers.Embed(
        m.vocab_size, m.n_embd, name="lm_head", embedding_init=table_init).embedding
    table_VD = jnp.pad(head_VD, ((0, padded - m.vocab_size), (0, 0)))
    logits_BTV = layers.tied_head(x_BTD, table_VD, self.dtype)[..., :m.vocab_size]
    if hypersphere:   # nGPT's z = s_z * (h E^T) (model/ngpt.py)
      logits_BTV = logits_BTV * ngpt.logit_scale(self, m.vocab_size)
    return logits_BTV


def final_norm(m, dtype):
  """The norm before the head: a LayerNorm, or DyT / Derf where the blocks use it (Zhu et al.
  and Chen et al. replace every norm, the final one included); none in nGPT (the identity)."""
  norm_type = "none" if m.get("ngpt", False) else (
      m.norm_type if m.norm_type in ("dyt", "derf") else "ln")
  return layers.make_norm(norm_type, m.norm_eps, dtype, "ln_f",
                          block.norm_alpha_init(m, "final"))


def build_model(model_config, dtype="float32") -> Transformer:
  """The reference model `model_config.kind` names ("decoder" or "encoder") in `dtype`: the
  papers' equations under autodiff, on every platform (the config is checked once per start,
  runs/config_checks.py). Training builds its model through `simplified_flax.fast.build_model`:
  this model, or one with the same parameters that computes the same values faster."""
  assert model_config.kind in ("decoder", "encoder"), model_config.kind
  return Transformer(ml_collections.FrozenConfigDict(model_config),   # hashable, as attributes are
                     causal=model_config.kind == "decoder",
                     dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype)
