"""The one configurable Transformer block and its attention sub-block (docs/model.md, "The block"):
every variant of the papers is this block with different settings (configs/).
"""
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import attention
from simplified_flax.model import attention_kernels
from simplified_flax.model import grad_rules
from simplified_flax.model import kv_cache
from simplified_flax.model import layers
from simplified_flax.model import mlp as mlp_lib
from simplified_flax.model import target_platform
from simplified_flax.model import valproj


def _qk_kernel_init(m):
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


# The fewest tokens per device for which the attention sub-block makes q and k as GEMMs of
# their own (`grad_rules.biased_halves`). The copies that saves grow with the tokens; the
# second weight-gradient GEMM it costs (XLA gives each a split-K pass) does not. H200
# roofline estimates at the paper's shape, batch 128 over 4 GPUs (4,096 tokens a device):
# Pre-LN 7.92 -> 7.82 ms, SAS-P 7.15 -> 6.86; over 8 (2,048): Pre-LN 5.01 -> 5.08, SAS-P
# 4.52 -> 4.43.
SEPARATE_QK_MIN_TOKENS = 4096


class AttentionSubBlock(nn.Module):
  """`Proj(merge((alpha*I + beta*A - gamma*C) Value(x)))` for x [B, T, D] (Eqs. (3)-(7)), per
  head alpha = attn_mat_skip_gain, beta = attn_mat_resid_gain, gamma = centre_attn_gain. With
  `cache_index` [B]: T new tokens per row against this layer's `cache` (kv_cache.py)."""
  cfg: Any     # FrozenConfigDict: the model config
  layer: int
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, anchors: Dict[str, jax.Array], *, key_mask=None, segment_ids=None,
               cache_index=None, lengths=None, out_gain=None, addend=None,
               with_sum_squares=False):
    """With the identity projection only: `out_gain` (a scalar), the output times it;
    `addend` [B, T, D], added to the output; `with_sum_squares`, (output, its sum of squares
    over D [B, T], float32, for `layers.rms_norm`; not with a cache)."""
    m = self.cfg
    B, T, D = x_BTD.shape
    H = m.n_head
    impl = self._impl()
    # The fused path's kernels take q and k as arrays of their own: cut out of one GEMM's
    # output they are copies, so there they are made apart (grad_rules' `split` rule), where
    # each device has the tokens for the copies to outweigh a second weight-gradient GEMM.
    separate = (impl == "fused" and grad_rules.enabled("split") and
                attention_kernels.tokens_per_device(B, T, H) >= SEPARATE_QK_MIN_TOKENS)
    q_BTD, k_BTD = layers.QKDense(self.dtype, _qk_kernel_init(m), separate=separate,
                                  name="c_attn")(x_BTD)
    v_BTD = layers.ReparamLinear(valproj.value_settings(m, self.layer), self.dtype,
                                 name="value")(x_BTD, anchors.get("value"))
    q_BTHd, k_BTHd, v_BTHd = (a.reshape(B, T, H, D // H) for a in (q_BTD, k_BTD, v_BTD))
    if m.qk_norm_type == "rmsnorm":
      q_BTHd = layers.RMSNorm(m.norm_eps, self.dtype, name="q_norm")(q_BTHd)
      k_BTHd = layers.RMSNorm(m.norm_eps, self.dtype, name="k_norm")(k_BTHd)

    trainable = m.trainable_attn_mat_gains
    resid_H = layers.gain(self, "attn_mat_resid_gain", m.attn_mat_resid_gain, trainable, (H,))
    skip_H = centre_H = None
    if m.centre_attn:
      skip_H = layers.gain(self, "attn_mat_skip_gain", m.attn_mat_skip_gain, trainable, (H,))
      centre_H = layers.gain(self, "centre_attn_gain", m.centre_attn_gain,
                             trainable and m.centre_attn_gain != 0, (H,))
    attn_args = dict(resid_gain=resid_H, skip_gain=skip_H, centre_gain=centre_H,
                     logit_soft_cap=30.0 if m.dot_norm_type == "tanh" else None)
    if cache_index is not None:
      out_BTHd = self._attend_cached(q_BTHd, k_BTHd, v_BTHd, attn_args, impl,
                                     index_B=cache_index, lengths_B=lengths)
    else:
      explicit = impl == "explicit" and not with_sum_squares   # which alone can return A
      out_BTHd = attention.shaped_attention(
          q_BTHd, k_BTHd, v_BTHd, **attn_args, causal=self.causal, key_mask=key_mask,
          segment_ids=segment_ids, impl=impl, return_probs=explicit, out_gain=out_gain,
          addend=None if addend is None else addend.reshape(B, T, H, D // H),
          return_sum_squares=with_sum_squares)
      if explicit:
        out_BTHd, probs_BHTT = out_BTHd
        self.sow("intermediates", "attn_probs", probs_BHTT)
      if with_sum_squares:
        if valproj.proj_settings(m, self.layer).form != "identity":
          raise ValueError("with_sum_squares needs the identity projection.")
        out_BTHd, sum_squares_BT = out_BTHd
        return out_BTHd.reshape(B, T, D), sum_squares_BT
    return layers.ReparamLinear(valproj.proj_settings(m, self.layer), self.dtype, name="proj")(
        out_BTHd.reshape(B, T, D), anchors.get("proj"))

  def _impl(self) -> str:
    """`model.attention_impl`'s path here; "auto" is explicit while diagnostics collect A."""
    m = self.cfg
    collecting = self.is_mutable_collection("intermediates") and not self.is_initializing()
    if m.attention_impl == "auto" and collecting:
      return "explicit"
    return attention_kernels.resolve_impl(m.attention_impl, dtype=self.dtype,
                                          soft_capped=m.dot_norm_type == "tanh")

  def _attend_cached(self, q_BTHd, k_BTHd, v_BTHd, attn_args, impl, *, index_B, lengths_B):
    """Attends to the cache and appends the new keys and values (not while initialising)."""
    B, T, H, d = k_BTHd.shape
    shape = (B, H, T, d)   # [B, H, Tmax, d]: created by the init call, whose T is Tmax
    templates = {"keys": (shape, k_BTHd.dtype), "values": (shape, v_BTHd.dtype),
                 "value_sum": ((B, H, d), jnp.float32)}
    centred = attn_args["centre_gain"] is not None
    cache = {name: self.variable("cache", name, jnp.zeros, *templates[name])
             for name in kv_cache.cache_names(impl, centred)}
    out_BTHd, new = kv_cache.cached_shaped_attention(
        q_BTHd, k_BTHd, v_BTHd, {name: var.value for name, var in cache.items()}, index_B,
        lengths_B, **attn_args, impl=impl)
    if not self.is_initializing():
      for name, var in cache.items():
        var.value = new[name]
    return out_BTHd


class Block(nn.Module):
  """One block, sequential or parallel (Eqs. (1) and (2)), x [B, T, D] -> [B, T, D]. The
  parallel form reads only `norm1`; `norm2` is still created there, as in the authors'
  code, so that parameter counts and converted checkpoints line up with theirs.
  """
  cfg: Any
  layer: int
  causal: bool
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, anchors, *, key_mask=None, segment_ids=None, train=False,
               cache_index=None, lengths=None):
    """`cache_index` / `lengths`: decoding against the `cache` collection (AttentionSubBlock)."""
    m = self.cfg
    norm_type = "ln" if (m.norm_type == "none" and self.layer == 0) else m.norm_type
    norm1 = layers.make_norm(norm_type, m.norm_eps, self.dtype, "norm1")
    norm2 = layers.make_norm(m.norm_type, m.norm_eps, self.dtype, "norm2")
    attn = AttentionSubBlock(m, self.layer, self.causal, self.dtype, name="attn")
    mlp = mlp_lib.MLP(m, self.dtype, name="mlp")
    drop = nn.Dropout(m.dropout_rate, deterministic=not train)
    block_gain = lambda name, kind: layers.gain(self, name, m[name],
                                                m[f"trainable_{kind}_block_gains"])
    attn_resid = block_gain("attn_block_resid_gain", "attn")
    mlp_resid = block_gain("mlp_block_resid_gain", "mlp")
    B, T, D = x_BTD.shape
    combine_kernels = attn._impl() == "fused" and attention.takes_combine_kernels(
        (B, T, m.n_head, D // m.n_head), centred=m.centre_attn,
        simple_causal=self.causal and key_mask is None and segment_ids is None)
    # Where nothing lies between the attention and its block gain (no projection, no dropout,
    # no cache), the sub-block applies the gain itself under the combine rule: the fused
    # form's kernels then fold it into theirs, so that the backward reads the block's
    # gradient, not a scaled copy of it. A parallel block gives it its sum as well. On a TPU
    # only into its kernels: the product taken by XLA over [B, T, H, d] moved 3.6% more bytes.
    fold = (cache_index is None and (m.dropout_rate == 0 or not train)
            and valproj.proj_settings(m, self.layer).form == "identity"
            and grad_rules.enabled("combine")
            and (combine_kernels or target_platform.current() != "tpu"))
    attn_fn = lambda h, addend=None: drop(attn(
        h, anchors, key_mask=key_mask, segment_ids=segment_ids, cache_index=cache_index,
        lengths=lengths, out_gain=attn_resid if fold else None, addend=addend))
    # On GPUs the MLP's gain goes into W_proj (mlp.GAIN_IN_KERNEL_PLATFORMS): the backward
    # then reads the block's gradient, not a scaled copy of it, and the gain's gradient is a
    # sum over W_proj, not over the MLP's output. On TPUs, with the fused kernels, the `out_gain`
    # rule keeps a trainable gain on the output without keeping the output (grad_rules.py).
    mlp_takes_gain = mlp_lib.gain_in_kernel() or (
        m.trainable_mlp_block_gains and combine_kernels and grad_rules.enabled("out_gain"))
    mlp_fn = lambda h: drop(mlp(h, out_gain=mlp_resid if mlp_takes_gain else None))
    attn_resid_outside = 1.0 if fold else attn_resid
    mlp_resid_outside = 1.0 if mlp_takes_gain else mlp_resid
    if m.parallel_layers:   # Eq. (2)
      return self._parallel(x_BTD, norm1, norm2, attn_fn, mlp_fn, fold,
                            attn_resid_outside, mlp_resid_outside)
    # Where the attention's output is the combine kernels' own (fold and the kernels) and
    # norm2 reads it (no attention skip, the norm before the MLP): SAS.
    kernels_feed_norm2 = (fold and combine_kernels and m.attn_block_skip_gain == 0
                          and m.norm_position == "pre")
    return self._sequential(x_BTD, norm1, norm2, attn_fn, mlp_fn, block_gain,
                            attn_resid_outside, mlp_resid_outside, kernels_feed_norm2,
                            lambda h: attn(h, anchors, with_sum_squares=True,
                                           out_gain=attn_resid))

  @nn.nowrap
  def _parallel(self, x_BTD, norm1, norm2, attn_fn, mlp_fn, fold, attn_resid, mlp_resid):
    """Eq. (2): x + attn(norm1(x)) + mlp(norm1(x)), the gains outside the branches given."""
    m = self.cfg
    h_BTD = norm1(x_BTD)
    if m.norm_type != "none":
      norm2(h_BTD)   # created, unread: see the class docstring
    mlp_BTD = mlp_resid * mlp_fn(h_BTD)
    if fold:   # the sum too: the combine's kernels then take it in theirs (one write),
      # the branch in the block's dtype (as on GPUs, whose gain is in W_proj; a float32 branch
      # doubled the kernel's reads of it on a TPU, where the gain stays on the output).
      out_BTD = attn_fn(h_BTD, addend=mlp_BTD.astype(self.dtype))
    else:
      out_BTD = mlp_BTD + attn_resid * attn_fn(h_BTD)
    if m.mlp_block_skip_gain == 0:
      # Held on GPUs: the next norm's backward then reads the block's output, not both
      # branches again (-0.19 ms for SAS-P on an H200 at the paper shape; TPUs unmeasured).
      return layers.in_dtype(out_BTD, self.dtype, platforms=("gpu",))
    out_BTD = out_BTD + m.mlp_block_skip_gain * x_BTD   # never trainable in this form
    return layers.in_dtype(out_BTD, self.dtype)

  @nn.nowrap
  def _sequential(self, x_BTD, norm1, norm2, attn_fn, mlp_fn, block_gain, attn_resid,
                  mlp_resid, kernels_feed_norm2, attn_with_sums_fn):
    """Eq. (1), with the norm placed per norm_position; a zero skip is omitted."""
    m = self.cfg
    assert m.norm_position in ("pre", "post"), m.norm_position
    # A trainable MLP skip gain whose input is the combine kernels' output itself takes the
    # `skip` rule: its gradient's sums then join those of norm2's weight gradient (-0.19 ms
    # for SAS on an H200 at the paper shape). After a GEMM or the explicit form XLA keeps
    # them apart (+0.19 ms there).
    skip_rule = kernels_feed_norm2 and m.trainable_mlp_block_gains
    # An RMS norm2 reading the kernels' output takes its sums of squares from them (the
    # `norm_stats` rule): no reduction kernel of its own then reads the whole output again.
    norm_stats = (kernels_feed_norm2 and m.norm_type == "rmsnorm"
                  and grad_rules.enabled("norm_stats"))
    sum_squares_BT = None   # of the attention's output, for norm2 (norm_stats)
    for kind, norm, branch, resid in (("attn", norm1, attn_fn, attn_resid),
                                      ("mlp", norm2, mlp_fn, mlp_resid)):
      if m.norm_position == "post":
        x_BTD = norm(x_BTD)
      if kind == "attn" and norm_stats:   # fold: no gain, dropout or projection after it
        x_BTD, sum_squares_BT = attn_with_sums_fn(norm(x_BTD))
        continue
      if m.norm_position == "pre":
        h_BTD = norm(x_BTD) if sum_squares_BT is None else norm(x_BTD, sum_squares_BT)
      out_BTD = resid * branch(h_BTD if m.norm_position == "pre" else x_BTD)
      if m[f"{kind}_block_skip_gain"] == 0:
        x_BTD = out_BTD.astype(self.dtype)   # a lone branch: XLA may fuse the cast onwards
        continue
      skip = block_gain(f"{kind}_block_skip_gain", kind)
      if kind == "mlp" and skip_rule:
        out_BTD = out_BTD + grad_rules.scaled_skip(skip, x_BTD)
      else:
        out_BTD = out_BTD + skip * x_BTD
      x_BTD = layers.in_dtype(out_BTD, self.dtype)   # a residual sum: held in the dtype
    return x_BTD
