"""The block's speed form: `block.Block` (model/block.py) with the same parameters, under the same
names, computing the same values where `plan.choose` verified the config; it differs only in
where gains, norms and kernels meet (docs/fast.md, "Block-level fusions").
"""
import functools
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.fast import attention as fast_attention
from simplified_flax.fast import attention_kernels
from simplified_flax.fast import grad_rules
from simplified_flax.fast import layers as fast_layers
from simplified_flax.fast import mlp as fast_mlp
from simplified_flax.fast.plan import Plan
from simplified_flax.model import block
from simplified_flax.model import kv_cache
from simplified_flax.model import layers
from simplified_flax.model import valproj

# The fewest tokens per device for which the attention sub-block makes q and k as GEMMs of
# their own (`grad_rules.biased_halves`). The copies that saves grow with the tokens; the
# second weight-gradient GEMM it costs (XLA gives each a split-K pass) does not. H200
# roofline estimates at the paper's shape, batch 128 over 4 GPUs (4,096 tokens a device):
# Pre-LN 7.92 -> 7.82 ms, SAS-P 7.15 -> 6.86; over 8 (2,048): Pre-LN 5.01 -> 5.08, SAS-P
# 4.52 -> 4.43.
SEPARATE_QK_MIN_TOKENS = 4096


class AttentionSubBlock(nn.Module):
  """`block.AttentionSubBlock` under `plan`; for the block's fusions it may also take the
  block gain (`out_gain`), add a branch (`addend`) and return its sums of squares."""
  cfg: Any
  layer: int
  causal: bool
  dtype: Any = jnp.float32
  plan: Plan = None

  @nn.compact
  def __call__(self, x_BTD, anchors: Dict[str, jax.Array], *, key_mask=None, segment_ids=None,
               cache_index=None, lengths=None, out_gain=None, addend=None,
               with_sum_squares=False):
    """With the identity projection only: `out_gain` (a scalar), the output times it;
    `addend` [B, T, D], added to the output; `with_sum_squares`, (output, its sum of squares
    over D [B, T], float32, for `fast.layers.RMSNorm`; not with a cache)."""
    m, plan = self.cfg, self.plan
    B, T, D = x_BTD.shape
    H = m.n_head
    impl = self.impl()
    # The fused path's kernels take q and k as arrays of their own: cut out of one GEMM's
    # output they are copies, so there they are made apart (grad_rules' `split` rule), where
    # each device has the tokens for the copies to outweigh a second weight-gradient GEMM.
    separate = (impl == "fused" and plan.applies("split") and
                attention_kernels.tokens_per_device(B, T, H) >= SEPARATE_QK_MIN_TOKENS)
    q_BTD, k_BTD = fast_layers.QKDense(plan, self.dtype, block.qk_kernel_init(m),
                                       separate=separate, name="c_attn")(x_BTD)
    product = functools.partial(fast_layers.matmul, plan)
    v_BTD = layers.ReparamLinear(valproj.value_settings(m, self.layer), self.dtype, product,
                                 name="value")(x_BTD, anchors.get("value"))
    q_BTHd, k_BTHd, v_BTHd = (a.reshape(B, T, H, D // H) for a in (q_BTD, k_BTD, v_BTD))
    if m.qk_norm_type == "rmsnorm":
      q_BTHd = layers.RMSNorm(m.norm_eps, self.dtype, name="q_norm")(q_BTHd)
      k_BTHd = layers.RMSNorm(m.norm_eps, self.dtype, name="k_norm")(k_BTHd)

    # The reference's gains, passed on unread: a shaping term new to them reaches the
    # reference's terms (fast_attention.shaped_attention) with no change here.
    attn_args = dict(block.attention_gains(self, m),
                     logit_soft_cap=30.0 if m.dot_norm_type == "tanh" else None)
    if cache_index is not None:
      out_BTHd = kv_cache.attend(self, q_BTHd, k_BTHd, v_BTHd, attn_args, impl,
                                 index_B=cache_index, lengths_B=lengths)
    else:
      explicit = impl == "explicit" and not with_sum_squares   # which alone can return A
      out_BTHd = fast_attention.shaped_attention(
          plan, q_BTHd, k_BTHd, v_BTHd, **attn_args, causal=self.causal, key_mask=key_mask,
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
    return layers.ReparamLinear(valproj.proj_settings(m, self.layer), self.dtype, product,
                                name="proj")(out_BTHd.reshape(B, T, D), anchors.get("proj"))

  @nn.nowrap
  def impl(self) -> str:
    """The plan's attention form; explicit where `model.attention_impl="auto"` and the caller
    collects the attention matrices (diagnostics), which only that form has."""
    collecting = self.is_mutable_collection("intermediates") and not self.is_initializing()
    if self.cfg.attention_impl == "auto" and collecting:
      return "explicit"
    return self.plan.attention_impl


class Block(nn.Module):
  """`block.Block` (Eqs. (1) and (2)) under `plan`, x [B, T, D] -> [B, T, D]."""
  cfg: Any
  layer: int
  causal: bool
  dtype: Any = jnp.float32
  plan: Plan = None

  @nn.compact
  def __call__(self, x_BTD, anchors, *, key_mask=None, segment_ids=None, train=False,
               cache_index=None, lengths=None):
    m, plan = self.cfg, self.plan
    norm1_type = "ln" if (m.norm_type == "none" and self.layer == 0) else m.norm_type
    norm1 = fast_layers.make_norm(norm1_type, m.norm_eps, self.dtype, "norm1")
    norm2 = fast_layers.make_norm(m.norm_type, m.norm_eps, self.dtype, "norm2")
    attn = AttentionSubBlock(m, self.layer, self.causal, self.dtype, plan, name="attn")
    mlp = fast_mlp.MLP(m, plan, self.dtype, name="mlp")
    drop = nn.Dropout(m.dropout_rate, deterministic=not train)
    block_gain = lambda name, kind: layers.gain(self, name, m[name],
                                                m[f"trainable_{kind}_block_gains"])
    attn_resid = block_gain("attn_block_resid_gain", "attn")
    mlp_resid = block_gain("mlp_block_resid_gain", "mlp")
    B, T, D = x_BTD.shape
    # Whether the sub-block's attention runs as the combine kernels, for the speed choices
    # below. A shaping term they lack keeps the sub-block on the XLA form however this reads
    # (fast_attention.kernels_take_terms); each choice has an XLA form of the same values.
    combine_kernels = attn.impl() == "fused" and fast_attention.takes_combine_kernels(
        plan, (B, T, m.n_head, D // m.n_head), centred=m.centre_attn,
        simple_causal=self.causal and key_mask is None and segment_ids is None)
    # Where nothing lies between the attention and its block gain (no projection, no dropout,
    # no cache), the sub-block applies the gain itself under the combine rule: the fused
    # form's kernels then fold it into theirs, so that the backward reads the block's
    # gradient, not a scaled copy of it. A parallel block gives it its sum as well. On a TPU
    # only into its kernels: the product taken by XLA over [B, T, H, d] moved 3.6% more bytes.
    fold = (cache_index is None and (m.dropout_rate == 0 or not train)
            and valproj.proj_settings(m, self.layer).form == "identity"
            and plan.applies("combine")
            and (combine_kernels or plan.platform != "tpu"))
    attn_fn = lambda h, addend=None: drop(attn(
        h, anchors, key_mask=key_mask, segment_ids=segment_ids, cache_index=cache_index,
        lengths=lengths, out_gain=attn_resid if fold else None, addend=addend))
    # On GPUs the MLP's gain goes into W_proj (fast_mlp.GAIN_IN_KERNEL_PLATFORMS): the
    # backward then reads the block's gradient, not a scaled copy of it, and the gain's
    # gradient is a sum over W_proj, not over the MLP's output. On TPUs, with the fused
    # kernels, the `out_gain` rule keeps a trainable gain on the output without keeping the
    # output (grad_rules.py).
    mlp_takes_gain = fast_mlp.gain_in_kernel(plan) or (
        m.trainable_mlp_block_gains and combine_kernels and plan.applies("out_gain"))
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
    m, plan = self.cfg, self.plan
    h_BTD = norm1(x_BTD)
    if m.norm_type != "none":
      norm2(h_BTD)   # created, unread: see block.Block's docstring
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
      return fast_layers.in_dtype(plan, out_BTD, self.dtype, platforms=("gpu",))
    out_BTD = out_BTD + m.mlp_block_skip_gain * x_BTD   # never trainable in this form
    return fast_layers.in_dtype(plan, out_BTD, self.dtype)

  @nn.nowrap
  def _sequential(self, x_BTD, norm1, norm2, attn_fn, mlp_fn, block_gain, attn_resid,
                  mlp_resid, kernels_feed_norm2, attn_with_sums_fn):
    """Eq. (1), pre-norm (the verified placement); a zero skip is omitted."""
    m, plan = self.cfg, self.plan
    assert m.norm_position == "pre", m.norm_position   # verified values only (plan.py)
    # A trainable MLP skip gain whose input is the combine kernels' output itself takes the
    # `skip` rule: its gradient's sums then join those of norm2's weight gradient (-0.19 ms
    # for SAS on an H200 at the paper shape). After a GEMM or the explicit form XLA keeps
    # them apart (+0.19 ms there).
    skip_rule = kernels_feed_norm2 and m.trainable_mlp_block_gains and plan.applies("skip")
    # An RMS norm2 reading the kernels' output takes its sums of squares from them (the
    # `norm_stats` rule): no reduction kernel of its own then reads the whole output again.
    norm_stats = (kernels_feed_norm2 and m.norm_type == "rmsnorm"
                  and plan.applies("norm_stats"))
    sum_squares_BT = None   # of the attention's output, for norm2 (norm_stats)
    for kind, norm, branch, resid in (("attn", norm1, attn_fn, attn_resid),
                                      ("mlp", norm2, mlp_fn, mlp_resid)):
      if kind == "attn" and norm_stats:   # fold: no gain, dropout or projection after it
        x_BTD, sum_squares_BT = attn_with_sums_fn(norm(x_BTD))
        continue
      h_BTD = norm(x_BTD) if sum_squares_BT is None else norm(x_BTD, sum_squares_BT)
      out_BTD = resid * branch(h_BTD)
      if m[f"{kind}_block_skip_gain"] == 0:
        x_BTD = out_BTD.astype(self.dtype)   # a lone branch: XLA may fuse the cast onwards
        continue
      skip = block_gain(f"{kind}_block_skip_gain", kind)
      if kind == "mlp" and skip_rule:
        out_BTD = out_BTD + grad_rules.scaled_skip(skip, x_BTD)
      else:
        out_BTD = out_BTD + skip * x_BTD
      x_BTD = fast_layers.in_dtype(plan, out_BTD, self.dtype)   # a residual sum: held
    return x_BTD
