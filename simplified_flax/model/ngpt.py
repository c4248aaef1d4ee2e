"""nGPT, the normalized Transformer (Loshchilov, Hsieh, Sun, Ginsburg, ICLR 2025), with
`model.ngpt=True` (docs/model.md, "nGPT", Eqs. (9)-(10); docs/beyond_the_paper.md, "nGPT").
Hidden states and every weight vector along the embedding dimension lie on the unit sphere;
there are no norm layers. Each layer moves h towards each branch's normalised output (their
Eqs. (10)-(11)), alpha_A, alpha_M [D] learnable "eigen learning rates":

    h <- Norm(h + alpha_A * (Norm(Attn(h)) - h)),   then the same with alpha_M and MLP(h)

Attn: per head q <- s_qk * Norm(q), k <- s_qk * Norm(k) (Eqs. (15)-(16)), softmax scale
sqrt(d_k). MLP: SwiGLU `(s_u u * SiLU(s_v sqrt(D) v)) W_o` (Eqs. (20)-(21)). Head: z = s_z *
(h E^T) (Eq. (3); model/transformer.py). Each learnable scale s is stored as `s_scale` times
ones and read as `stored * (s_init / s_scale)` (their Sec. 2.5), at the authors' values (the
constants below). Weights are drawn N(0, 1) and normalised (`unit_norm_init`); the optimiser
renormalises them after every step (`renormalize`, training/optimizer.py), so the forward
pass never normalises a weight. Positions: rotary (`model.position_embedding="rope"`, as the
authors' code; q and k rotated before their normalisation, model/rope.py) or a learned table
(`wpe`, unit-norm rows; the first state is then `Norm(E[token] + P[position])`). The head:
a table of its own (`lm_head`, unit-norm rows; `model.tie_head=False`, as the authors' code)
or tied to `wte`. alpha is used as it is (the authors' code takes |alpha|). Their rotation
function computes (-x_odd cos, x_even sin) for each pair, which is not a rotation (q . k then
depends on absolute positions); this code rotates as RoFormer does.
"""
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import attention
from simplified_flax.model import kv_cache
from simplified_flax.model import layers
from simplified_flax.model import rope

ALPHA_INIT = 0.05   # alpha_A, alpha_M at scale 1/sqrt(D) (their code; the paper: ~1 / n_layer)
SQK_INIT = 1.0      # s_qk at scale 1/sqrt(D)
SUV_INIT, SUV_SCALE = 1.0, 1.0   # s_u and s_v
SZ_INIT = 1.0       # s_z at scale 1/sqrt(D)
# The axis along which each weight is a vector of the embedding dimension, by the name of the
# module that holds it: the input axis of the maps from the hidden state (kernels [D, F]), the
# output axis of the maps back to it ([F, D]) and the rows of the tables ([V, D]). Negative,
# so that a scanned stack's leading layer axis leaves them unchanged.
EMBEDDING_AXIS = {"query": -2, "key": -2, "value": -2, "c_fc": -2,
                  "proj": -1, "c_proj": -1, "wte": -1, "wpe": -1, "lm_head": -1}
_TINY = jnp.finfo(jnp.float32).tiny


def unit_norm(x, axis: int = -1) -> jax.Array:
  """x / ||x|| along `axis`, in float32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(x32), axis, keepdims=True), _TINY))


def unit_norm_init(axis: int):
  """N(0, 1), then every vector along `axis` scaled to unit norm."""
  def init(key, shape, dtype=jnp.float32):
    return unit_norm(jax.random.normal(key, shape, jnp.float32), axis).astype(dtype)
  return init


def scaled_param(module: nn.Module, name: str, s_init: float, s_scale: float, shape):
  """A learnable scale stored as `s_scale * ones(shape)` and returned as `stored * (s_init /
  s_scale)`: `s_init` at initialisation. Named `*_gain`: never weight-decayed, logged with the
  gains (the logged value is the stored one)."""
  stored = module.param(name, nn.initializers.constant(s_scale), shape, jnp.float32)
  return stored * (s_init / s_scale)


def hypersphere_step(h_BTD, branch_BTD, alpha_D, dtype) -> jax.Array:
  """`Norm(h + alpha * (Norm(branch) - h))` (Eqs. (10)-(11)), in float32, returned in `dtype`."""
  h32 = h_BTD.astype(jnp.float32)
  return unit_norm(h32 + alpha_D * (unit_norm(branch_BTD) - h32)).astype(dtype)


def embedding_axis(names) -> int | None:
  """The axis of the parameter at `names` (module names..., leaf name) along which nGPT keeps
  it unit-norm: every weight matrix and table (a `kernel` or `embedding` leaf) has one
  (`EMBEDDING_AXIS`, by its module's name); None for the learnable scales. An unknown matrix
  is an error, so that none is left off the sphere unnoticed."""
  if names[-1] not in ("kernel", "embedding"):
    return None
  axis = EMBEDDING_AXIS.get(names[-2]) if len(names) > 1 else None
  if axis is None:
    raise ValueError(f"nGPT parameter {'/'.join(map(str, names))!r}: no embedding axis is "
                     "known for it; add its module to simplified_flax.model.ngpt.EMBEDDING_AXIS.")
  return axis


def renormalize(params):
  """`params` with every weight matrix and table normalised along the embedding dimension
  (`embedding_axis`), the learnable scales unchanged: what the optimiser does after each step
  (training/optimizer.py, `renormalized`)."""
  def project(path, leaf):
    axis = embedding_axis(tuple(getattr(k, "key", str(k)) for k in path))
    return leaf if axis is None else unit_norm(leaf, axis).astype(leaf.dtype)
  return jax.tree_util.tree_map_with_path(project, params)


def _dense(features: int, dtype, name: str) -> nn.Dense:
  return layers.dense(features, dtype, name, kernel_init=unit_norm_init(EMBEDDING_AXIS[name]))


class Attention(nn.Module):
  """nGPT's attention branch (Eqs. (15)-(16)), h [B, T, D] -> [B, T, D]: plain softmax
  attention of per-head normalised, s_qk-scaled queries and keys with scale sqrt(d_k), no
  biases. `attention.py` divides the logits by sqrt(d_k): q carries a factor d_k, which makes
  it sqrt(d_k). With `cache_index` [B]: against this layer's `cache` (kv_cache.py)."""
  cfg: Any
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h_BTD, *, key_mask=None, segment_ids=None, cache_index=None, lengths=None):
    m = self.cfg
    B, T, D = h_BTD.shape
    H = m.n_head
    d = D // H
    q_BTHd, k_BTHd, v_BTHd = (_dense(D, self.dtype, name)(h_BTD).reshape(B, T, H, d)
                              for name in ("query", "key", "value"))
    # Rotary positions before the normalisation, where the authors' code rotates them.
    q_BTHd, k_BTHd = rope.rotate_qk(m, q_BTHd, k_BTHd, cache_index=cache_index,
                                    segment_ids=segment_ids)
    sqk_Hd = scaled_param(self, "sqk_gain", SQK_INIT, D ** -0.5, (D,)).reshape(H, d)
    q_BTHd = (sqk_Hd * unit_norm(q_BTHd) * d).astype(self.dtype)
    k_BTHd = (sqk_Hd * unit_norm(k_BTHd)).astype(self.dtype)
    attn_args = dict(resid_gain=1.0, skip_gain=None, centre_gain=None, logit_soft_cap=None)
    impl = "explicit" if m.attention_impl == "auto" else m.attention_impl
    if cache_index is not None:
      out_BTHd = kv_cache.attend(self, q_BTHd, k_BTHd, v_BTHd, attn_args, impl,
                                 index_B=cache_index, lengths_B=lengths)
    else:
      out_BTHd = attention.shaped_attention(
          q_BTHd, k_BTHd, v_BTHd, **attn_args, causal=self.causal, key_mask=key_mask,
          segment_ids=segment_ids, impl=impl, return_probs=impl == "explicit")
      if impl == "explicit":   # A, for the diagnostics' attention entropy
        out_BTHd, probs_BHTT = out_BTHd
        self.sow("intermediates", "attn_probs", probs_BHTT)
    return _dense(D, self.dtype, "proj")(out_BTHd.reshape(B, T, D))


class MLP(nn.Module):
  """nGPT's MLP branch (Eqs. (20)-(21)), h [B, T, D] -> [B, T, D]: `(s_u u * SiLU(s_v sqrt(D)
  v)) W_o` with [u, v] = h W_fc (`c_fc` [D, 2F]: W_u then W_v), W_o = `c_proj` [F, D]."""
  cfg: Any
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h_BTD):
    m, D = self.cfg, h_BTD.shape[-1]
    F = m.mlp_width_mult * D
    u_BTF, v_BTF = jnp.split(_dense(2 * F, self.dtype, "c_fc")(h_BTD), 2, axis=-1)
    su_F = scaled_param(self, "su_gain", SUV_INIT, SUV_SCALE, (F,))
    sv_F = scaled_param(self, "sv_gain", SUV_INIT, SUV_SCALE, (F,)) * math.sqrt(D)
    gated_BTF = (su_F * u_BTF) * jax.nn.silu(sv_F * v_BTF)
    return _dense(D, self.dtype, "c_proj")(gated_BTF.astype(self.dtype))


class Block(nn.Module):
  """One nGPT layer, h [B, T, D] (unit norm along D) -> [B, T, D] (unit norm): Eq. (10) with
  the attention, then Eq. (11) with the MLP. The call of `block.Block`, whose place it takes
  (model/transformer.py); `anchors` go unread (nGPT has no fixed matrices)."""
  cfg: Any
  layer: int
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h_BTD, anchors, *, key_mask=None, segment_ids=None, train=False,
               cache_index=None, lengths=None):
    del anchors
    m, D = self.cfg, h_BTD.shape[-1]
    drop = nn.Dropout(m.dropout_rate, deterministic=not train)
    attn = Attention(m, self.causal, self.dtype, name="attn")
    mlp = MLP(m, self.dtype, name="mlp")
    branches = (("attn", lambda x: attn(x, key_mask=key_mask, segment_ids=segment_ids,
                                        cache_index=cache_index, lengths=lengths)),
                ("mlp", mlp))
    for kind, branch in branches:
      alpha_D = scaled_param(self, f"{kind}_alpha_gain", ALPHA_INIT, D ** -0.5, (D,))
      h_BTD = hypersphere_step(h_BTD, drop(branch(h_BTD)), alpha_D, self.dtype)
    return h_BTD


def logit_scale(module: nn.Module, vocab_size: int) -> jax.Array:
  """s_z [V] (Eq. (3)): the head's logits are `s_z * (h E^T)`."""
  return scaled_param(module, "sz_gain", SZ_INIT, module.cfg.n_embd ** -0.5, (vocab_size,))
