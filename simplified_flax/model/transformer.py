"""Decoder LM and encoder MLM models (docs/model.md, "The model"): embeddings, L blocks, final
LayerNorm, tied head.

    model = build_model(config.model, dtype="bfloat16")
    variables = model.init(jax.random.key(0), tokens_BT)      # {"params", "constants"}
    logits_BTV = model.apply(variables, tokens_BT)

`constants` holds the fixed anchor matrices of reparameterised Value/Proj layers: never
trained, never decayed, saved with the parameters. Hidden states (per block, "hidden") and
softmax attention probabilities (explicit path, "attn_probs") are sown into the
`intermediates` collection: `model.apply(variables, tokens, mutable=["intermediates"])`.

Incremental decoding (decoder only; `simplified_flax.model.decode` drives it): with `decode=True`
the model reads and advances a key/value cache in the `cache` collection, created by an init
call whose T is the cache length. Each row continues from its own cache index, so rows of
different lengths decode together (kv_cache.py):

    logits_BTV, state = model.apply({**variables, "cache": cache}, tokens_BT, decode=True,
                                    lengths=lengths_B, mutable=["cache"])
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from simplified_flax.model import layer_stack
from simplified_flax.model import layers
from simplified_flax.model import masks
from simplified_flax.model import valproj

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def multiple_of(n: int, multiple: int) -> int:
  """`n` rounded up to a multiple of `multiple`."""
  return -(-n // multiple) * multiple


def segment_positions(segment_ids_BT) -> jax.Array:
  """Position of each token inside its own (contiguous) segment, [B, T]."""
  return jnp.arange(segment_ids_BT.shape[1]) - masks.segment_run_starts(segment_ids_BT)


class Transformer(nn.Module):
  """Token + position embeddings, `n_layer` blocks, final LayerNorm, head tied to `wte`.

  tokens [B, T] int -> logits [B, T, V] float32. `causal` picks the decoder or the encoder.
  """
  cfg: Any     # FrozenConfigDict: the model config
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens_BT, *, segment_ids=None, key_mask=None, train: bool = False,
               decode: bool = False, lengths=None, return_hidden: bool = False):
    """`lengths` [B] (decode only): how many leading tokens of each row are real (default T);
    the cache index of row b advances by lengths[b]. `return_hidden`: return the final
    LayerNorm's output [B, T, D] (what the tied head reads) instead of the logits, e.g. for a
    task head (glue/classifier.py); the parameters are the same either way."""
    m = self.cfg
    B, T = tokens_BT.shape
    if T > m.max_position_embeddings:
      raise ValueError(f"Sequence length {T} exceeds model.max_position_embeddings="
                       f"{m.max_position_embeddings}; raise it or shorten the input.")
    anchors = self.variable("constants", "anchors", lambda: valproj.anchor_matrices(
        self.make_rng("params"), m)).value

    wte = nn.Embed(m.vocab_size, m.n_embd, embedding_init=layers.normal_init(layers.PLAIN_STD),
                   name="wte")
    wpe = nn.Embed(m.max_position_embeddings, m.n_embd, name="wpe",
                   embedding_init=layers.normal_init(layers.PLAIN_STD))
    cache_index_B = None
    if decode:
      cache_index_B, lengths = self._advance_cache(
          B, T, lengths=lengths, segment_ids=segment_ids, key_mask=key_mask, train=train)
      positions_BT = masks.query_positions(T, cache_index_B)
    elif segment_ids is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    else:
      positions_BT = segment_positions(segment_ids)
    x_BTD = (wte(tokens_BT) + wpe(positions_BT)).astype(self.dtype)
    x_BTD = nn.Dropout(m.dropout_rate, deterministic=not train)(x_BTD)

    x_BTD = layer_stack.run_blocks(self, m, x_BTD, anchors, causal=self.causal, dtype=self.dtype,
                                   key_mask=key_mask, segment_ids=segment_ids, train=train,
                                   cache_index=cache_index_B, lengths=lengths)

    x_BTD = nn.LayerNorm(epsilon=m.norm_eps, dtype=self.dtype, name="ln_f")(x_BTD)
    if return_hidden:
      return x_BTD
    # Tied head (layers.TiedHead: float32 logits for a stable softmax cross-entropy). With
    # vocab_pad_multiple the matmul runs on a zero-padded table and the padded columns are cut
    # off again, so no caller (loss, sampling, metrics) ever sees them.
    padded = multiple_of(m.vocab_size, m.get("vocab_pad_multiple", 1))
    table_VD = jnp.pad(wte.embedding, ((0, padded - m.vocab_size), (0, 0)))
    return layers.TiedHead(self.dtype, name="head")(x_BTD, table_VD)[..., :m.vocab_size]

  def _advance_cache(self, B, T, *, lengths, segment_ids, key_mask, train):
    """(cache index [B] where this chunk starts, lengths [B]); moves the index past the chunk."""
    if not self.causal or segment_ids is not None or key_mask is not None or train:
      raise ValueError("decode=True is for the causal decoder at inference: no segment_ids, "
                       "key_mask or train (rows of different lengths use `lengths`).")
    index = self.variable("cache", "index", jnp.zeros, (B,), jnp.int32)
    lengths_B = (jnp.full((B,), T, jnp.int32) if lengths is None
                 else jnp.asarray(lengths, jnp.int32))
    start_B = index.value
    if not self.is_initializing():
      index.value = start_B + lengths_B
    return start_B, lengths_B


def TransformerLM(cfg, dtype=jnp.float32, **kwargs) -> Transformer:
  """The decoder (causal) language model."""
  return Transformer(_frozen(cfg), causal=True, dtype=dtype, **kwargs)


def TransformerEncoder(cfg, dtype=jnp.float32, **kwargs) -> Transformer:
  """The bidirectional encoder with an MLM head tied to the token embedding."""
  return Transformer(_frozen(cfg), causal=False, dtype=dtype, **kwargs)


def build_model(model_config, dtype="float32") -> Transformer:
  """The model `model_config.kind` names ("decoder" or "encoder"), computing in `dtype`."""
  compute_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
  make = TransformerLM if model_config.kind == "decoder" else TransformerEncoder
  return make(model_config, dtype=compute_dtype)


def _frozen(cfg):
  if isinstance(cfg, ml_collections.FrozenConfigDict):
    return cfg
  return ml_collections.FrozenConfigDict(cfg)
