"""The one configurable Transformer block and its attention sub-block (docs/model.md, "The block"):
every variant of the papers is this block with different settings (configs/)."""
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import attention
from simplified_flax.model import kv_cache
from simplified_flax.model import layers
from simplified_flax.model import mlp as mlp_lib
from simplified_flax.model import rope
from simplified_flax.model import valproj


def qk_kernel_init(m):
  """W_qk [D, 2D] ~ N(0, 0.02), with the query / key half re-drawn when asked (query_init_std)."""
  def init(key, shape, dtype=jnp.float32):
    D = shape[0]
    base_key, q_key, k_key = jax.random.split(key, 3)
    w = layers.normal_init(layers.PLAIN_STD)(base_key, shape, dtype)
    if m.query_init_std is not None:
      w = w.at[:, :D].set(layers.normal_init(m.query_init_std)(q_key, (D, D), dtype))
    if m.key_init_std is not None:
      w = w.at[:, D:].set(layers.normal_init(m.key_init_std)(k_key, (D, D), dtype))
    return w
  return init


def attention_gains(module: nn.Module, m) -> Dict[str, Any]:
  """The per-head gains [H] of Eq. (4), by their keywords of `attention.shaped_attention`:
  `resid_gain` (beta), and `skip_gain` (alpha) and `centre_gain` (gamma), None without
  `centre_attn` (those terms are then absent). Every attention sub-block, the fast one too,
  passes them on as they are: a new shaping term is one more entry here (None where absent)."""
  H, trainable = m.n_head, m.trainable_attn_mat_gains
  gains = {"resid_gain": layers.gain(module, "attn_mat_resid_gain", m.attn_mat_resid_gain,
                                     trainable, (H,)),
           "skip_gain": None, "centre_gain": None}
  if m.centre_attn:
    gains["skip_gain"] = layers.gain(module, "attn_mat_skip_gain", m.attn_mat_skip_gain,
                                     trainable, (H,))
    gains["centre_gain"] = layers.gain(module, "centre_attn_gain", m.centre_attn_gain,
                                       trainable and m.centre_attn_gain != 0, (H,))
  return gains


def output_gate(x_BTD, out_BTHd, dtype) -> jax.Array:
  """Gated attention (Qiu et al. 2025, arXiv 2505.06708, their elementwise head-specific gate
  G1): the attention output [B, T, H, d] times `sigmoid(x W_g + b_g)`, x the sub-block's input
  [B, T, D], W_g [D, D] (`gate`) N(0, 0.02) and b_g [D] zeros: the gate is part of their q
  projection and shares its bias flag (qiuzh20/gated_attention, modeling_qwen3.py), and q has
  a bias here (`c_attn`). Each token's gate reads that token alone, so a cached step gates
  exactly as the full pass (docs/model.md, "Gated attention")."""
  gate_BTD = layers.dense(x_BTD.shape[-1], dtype, "gate", use_bias=True)(x_BTD)
  gate_BTHd = jax.nn.sigmoid(gate_BTD.astype(jnp.float32)).reshape(out_BTHd.shape)
  return out_BTHd * gate_BTHd.astype(out_BTHd.dtype)


class AttentionSubBlock(nn.Module):
  """`Proj(merge((alpha*I + beta*A - gamma*C) Value(x)))` for x [B, T, D] (Eqs. (3)-(7); gains:
  `attention_gains`); with `attn_output_gate`, `Proj(sigmoid(x W_g) * merge(...))`. With
  `cache_index` [B]: T new tokens per row against this layer's `cache` (kv_cache.py)."""
  cfg: Any     # FrozenConfigDict: the model config
  layer: int
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, anchors: Dict[str, jax.Array], *, key_mask=None, segment_ids=None,
               cache_index=None, lengths=None):
    m = self.cfg
    B, T, D = x_BTD.shape
    H = m.n_head
    qk_BTF = layers.dense(2 * D, self.dtype, "c_attn", qk_kernel_init(m), use_bias=True)(x_BTD)
    q_BTD, k_BTD = jnp.split(qk_BTF, 2, axis=-1)
    v_BTD = layers.ReparamLinear(valproj.value_settings(m, self.layer), self.dtype,
                                 name="value")(x_BTD, anchors.get("value"))
    q_BTHd, k_BTHd, v_BTHd = (a.reshape(B, T, H, D // H) for a in (q_BTD, k_BTD, v_BTD))
    if m.qk_norm_type == "rmsnorm":
      q_BTHd = layers.RMSNorm(m.norm_eps, self.dtype, name="q_norm")(q_BTHd)
      k_BTHd = layers.RMSNorm(m.norm_eps, self.dtype, name="k_norm")(k_BTHd)
    # Rotary positions after the QK-norm, as Qwen3 and OLMo 2 order them (model/rope.py).
    q_BTHd, k_BTHd = rope.rotate_qk(m, q_BTHd, k_BTHd, cache_index=cache_index,
                                    segment_ids=segment_ids)

    attn_args = dict(attention_gains(self, m),
                     logit_soft_cap=30.0 if m.dot_norm_type == "tanh" else None)
    # "auto" is the explicit form here; the speed package picks a platform's fastest exact form.
    impl = "explicit" if m.attention_impl == "auto" else m.attention_impl
    if cache_index is not None:
      out_BTHd = kv_cache.attend(self, q_BTHd, k_BTHd, v_BTHd, attn_args, impl,
                                 index_B=cache_index, lengths_B=lengths)
    else:   # the explicit form also returns A, which diagnostics read
      out_BTHd = attention.shaped_attention(
          q_BTHd, k_BTHd, v_BTHd, **attn_args, causal=self.causal, key_mask=key_mask,
          segment_ids=segment_ids, impl=impl, return_probs=impl == "explicit")
      if impl == "explicit":
        out_BTHd, probs_BHTT = out_BTHd
        self.sow("intermediates", "attn_probs", probs_BHTT)
    if m.get("attn_output_gate", False):   # every form and the cache alike: a gate on the output
      out_BTHd = output_gate(x_BTD, out_BTHd, self.dtype)
    return layers.ReparamLinear(valproj.proj_settings(m, self.layer), self.dtype, name="proj")(
        out_BTHd.reshape(B, T, D), anchors.get("proj"))


def block_norms(m, layer: int, dtype):
  """(norm1, norm2, norm1_out, norm2_out) of `norm_type`, but with "none" layer 0's norm1 is
  a LayerNorm (it normalises the embedding); the output norms, on the branches' outputs, are
  the identity unless norm_position="peri" (Peri-LN: Kim et al. 2025, arXiv 2502.02732)."""
  norm1_type = "ln" if (m.norm_type == "none" and layer == 0) else m.norm_type
  peri = m.norm_position == "peri"
  # DyT's and Derf's alpha_0: the attention norm's and the MLP norm's own (their LM code).
  attn = lambda norm_type, name: layers.make_norm(norm_type, m.norm_eps, dtype, name,
                                                  norm_alpha_init(m, "attn"))
  mlp = lambda norm_type, name: layers.make_norm(norm_type, m.norm_eps, dtype, name,
                                                 norm_alpha_init(m, "mlp"))
  return (attn(norm1_type, "norm1"), mlp(m.norm_type, "norm2"),
          attn(m.norm_type if peri else "none", "norm1_out"),
          mlp(m.norm_type if peri else "none", "norm2_out"))


def norm_alpha_init(m, where: str) -> float:
  """DyT's / Derf's alpha_0 of the `where` ("attn", "mlp" or "final") norms:
  `model.alpha_init_<where>_norm` (both authors' language-model code set the attention norm,
  the MLP norm and the final norm apart), 0.5 in configs saved before the fields existed."""
  return float(m.get(f"alpha_init_{where}_norm", layers.DYT_ALPHA_INIT))


def depth_branch_multiplier(m) -> float:
  """CompleteP's (L_base / L)^alpha on every residual branch (Dey et al. 2025, Table 1;
  docs/model.md, "CompleteP"): the learning rate transfers across depth. 1 without
  `depth_mup_alpha` (absent from configs saved before it): the block is then unchanged."""
  if m.get("depth_mup_alpha") is None:
    return 1.0
  return float((m.depth_mup_base_layers / m.n_layer) ** m.depth_mup_alpha)


class Block(nn.Module):
  """One block, sequential or parallel (Eqs. (1) and (2)), x [B, T, D] -> [B, T, D], the
  residual stream held in `dtype`. The parallel form reads only `norm1`; `norm2` is still
  created there, as in the authors' code, so that parameter counts and converted checkpoints
  line up with theirs. A skip whose gain is 0 is omitted, not multiplied by 0."""
  cfg: Any
  layer: int
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, anchors, *, key_mask=None, segment_ids=None, train=False,
               cache_index=None, lengths=None):
    """`cache_index` / `lengths`: decoding against the `cache` collection (AttentionSubBlock)."""
    m = self.cfg
    norm1, norm2, norm1_out, norm2_out = block_norms(m, self.layer, self.dtype)
    drop = nn.Dropout(m.dropout_rate, deterministic=not train)
    attn = AttentionSubBlock(m, self.layer, self.causal, self.dtype, name="attn")
    mlp = mlp_lib.MLP(m, self.dtype, name="mlp")
    attn_fn = lambda h_BTD: drop(norm1_out(attn(h_BTD, anchors, key_mask=key_mask,
                                                segment_ids=segment_ids,
                                                cache_index=cache_index, lengths=lengths)))
    mlp_fn = lambda h_BTD: drop(norm2_out(mlp(h_BTD)))
    gain = lambda name, kind: layers.gain(self, name, m[name], m[f"trainable_{kind}_block_gains"])
    branch_scale = depth_branch_multiplier(m)   # CompleteP's (L_base / L)^alpha, else 1
    resid = lambda kind: branch_scale * gain(f"{kind}_block_resid_gain", kind)

    if m.parallel_layers:   # Eq. (2): one norm feeds both branches; the skip gain is fixed
      h_BTD = norm1(x_BTD)
      if m.norm_type != "none":
        norm2(h_BTD)   # created, unread: see the class docstring
      out_BTD = resid("mlp") * mlp_fn(h_BTD) + resid("attn") * attn_fn(h_BTD)
      if m.mlp_block_skip_gain != 0:
        out_BTD = out_BTD + m.mlp_block_skip_gain * x_BTD
      return out_BTD.astype(self.dtype)

    # Eq. (1): x = resid * branch(norm(x)) + skip * x, first attention then MLP; "post" norms
    # x itself before the sub-block; "peri" is "pre" with x + Norm_out(F(Norm_in(x))).
    for kind, norm, branch in (("attn", norm1, attn_fn), ("mlp", norm2, mlp_fn)):
      if m.norm_position == "post":
        x_BTD = norm(x_BTD)
      h_BTD = x_BTD if m.norm_position == "post" else norm(x_BTD)
      out_BTD = resid(kind) * branch(h_BTD)
      if m[f"{kind}_block_skip_gain"] != 0:
        out_BTD = out_BTD + gain(f"{kind}_block_skip_gain", kind) * x_BTD
      x_BTD = out_BTD.astype(self.dtype)
    return x_BTD
