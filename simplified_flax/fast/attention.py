"""Shaped attention's speed form: `attention.shaped_attention` (model/attention.py), the same values,
with the platform's attention kernel for A v (attention_kernels.py), the combine kernels for the
causal combine (combine_kernel.py), the `gains` rule's gradient on the explicit form, and three
extras a fast block asks for: the result times a gain (`out_gain`), plus a branch (`addend`),
and with its sums of squares (`return_sum_squares`). The shaping terms are the reference's
(`attention.shaping_terms`, `attention.fused_terms`), whose gains pass through unread; only
the combine kernels fix them to (alpha, I) and (gamma, C), and they apply only where those are
the only terms and the plan was verified (plan.py).
"""
import functools

import jax
import jax.numpy as jnp

from simplified_flax.fast import attention_kernels
from simplified_flax.fast import combine_kernel
from simplified_flax.fast import combine_kernel_tpu
from simplified_flax.fast import grad_rules
from simplified_flax.fast.plan import Plan
from simplified_flax.model import attention
from simplified_flax.model import masks

PREFIX_CHUNK = 128   # the prefix sums' tile along time: one MXU pass on a TPU
# Where the fused form's prefix sums are chunk matmuls: TPUs, whose XLA otherwise moves
# [B, T, H, d] in float32 through layout copies (experiments/results/compiled/tpu_log.md).
# Other platforms keep the cumulative sum.
TPU_LAYOUT_PLATFORMS = ("tpu",)
# Where the combine's narrow result is held in its dtype (an optimization barrier; values
# unchanged): TPUs (the layout copies above) and GPUs, whose XLA otherwise folds the combine
# into the next norm's statistics, so that C v is written in float32 and read again there and
# A v, v and C v are each read twice (-0.85 GB a step for SAS-P at the paper's shape on an
# H200; experiments/results/compiled/optimisation_log.md, third pass).
HELD_COMBINE_PLATFORMS = ("tpu", "gpu")

# The shaping terms the combine kernels compute, by their gains' keywords: alpha I and gamma C.
KERNEL_TERMS = ("skip_gain", "centre_gain")

_fast_shape_attention_matrix = grad_rules.fast_gain_gradients(attention.shape_attention_matrix)


def causal_prefix_sums(v_BTHd, *, by_chunks: bool) -> jax.Array:
  """`attention.cumulative_sum(v)`: float32 [B, T, H, d]. `by_chunks`, where T is a multiple
  of PREFIX_CHUNK: as matmuls, each chunk of times by a lower-triangular 0/1 matrix (its
  products exact, the sums in float32), plus the earlier chunks' totals. XLA's TPU cumulative
  sum instead reduces over windows with time minor-most, through float32 layout copies."""
  B, T, H, d = v_BTHd.shape
  if T % PREFIX_CHUNK or not by_chunks:
    return attention.cumulative_sum(v_BTHd)
  c, N = PREFIX_CHUNK, T // PREFIX_CHUNK
  lower_cc = (jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]).astype(v_BTHd.dtype)
  sums_BNcHd = jnp.einsum("ij,bnjhd->bnihd", lower_cc, v_BTHd.reshape(B, N, c, H, d),
                          preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)
  if N > 1:   # add each chunk's earlier chunks: an exclusive cumulative sum of N totals
    totals_BNHd = sums_BNcHd[:, :, -1]
    sums_BNcHd = sums_BNcHd + (jnp.cumsum(totals_BNHd, axis=1) - totals_BNHd)[:, :, None]
  return sums_BNcHd.reshape(B, T, H, d)


def combine_fused_terms(plan: Plan, attended_BQHd, resid, terms):
  """`attention.combine_fused_terms`, its narrow result held in its dtype on
  HELD_COMBINE_PLATFORMS: XLA would drop the rounding where the block casts it back up and
  carry float32 [B, T, H, d] onwards (the same maths at more bytes)."""
  out_BQHd = attention.combine_fused_terms(attended_BQHd, resid, terms)
  if out_BQHd.dtype == jnp.float32 or plan.platform not in HELD_COMBINE_PLATFORMS:
    return out_BQHd
  return jax.lax.optimization_barrier(out_BQHd)


def takes_combine_kernels(plan: Plan, v_shape, *, centred: bool, simple_causal: bool) -> bool:
  """Whether the fused form's combine runs as the combine kernels for values of `v_shape`
  [B, T, H, d]: a centred attention, the plain causal mask (`simple_causal`: no padding,
  packing or offset queries), the `combine` rule, and shapes the kernels of the plan's
  platform take (a TPU's own; elsewhere the GPU's, interpreted off a GPU)."""
  if not (centred and simple_causal and plan.applies("combine")):
    return False
  v = jax.ShapeDtypeStruct(tuple(v_shape), jnp.float32)
  if plan.platform == "tpu":
    return combine_kernel_tpu.supported(v)
  on_gpu = plan.platform == "gpu" and not plan.interpret
  return combine_kernel.supported(v, min_programs=combine_kernel.MIN_PROGRAMS if on_gpu else 1)


def kernels_take_terms(term_gains) -> bool:
  """Whether the combine kernels compute every shaping term of `term_gains` (the keywords of
  `attention.shaping_terms` and `attention.fused_terms`): they fix the terms to alpha I and
  gamma C (KERNEL_TERMS), gamma present; a term of any other gain takes the XLA form, which
  computes the reference's terms."""
  return term_gains.get("centre_gain") is not None and all(
      gain is None for name, gain in term_gains.items() if name not in KERNEL_TERMS)


def shaped_attention(plan: Plan, q, k, v, *, resid_gain, causal: bool, key_mask=None,
                     segment_ids=None, query_offset=0, impl="explicit", logit_soft_cap=None,
                     return_probs: bool = False, out_gain=None, addend=None,
                     return_sum_squares: bool = False, **term_gains):
  """`attention.shaped_attention` under `plan` (arguments and result as there). `term_gains`:
  the shaping terms' gains besides beta's (`skip_gain`, `centre_gain`, any term the reference
  adds), handed to the reference's `shaping_terms` and `fused_terms` unread. `out_gain`: the
  result times it. `addend` [B, Q, H, d]: added to the result (a parallel block's sum), by
  the combine kernels before their one rounding where they apply. `return_sum_squares` (not
  with `return_probs`): also `sum_squares(result)` [B, Q], for the RMS norm that reads the
  result next; the GPU's combine kernels write it with the result."""
  if return_sum_squares and return_probs:
    raise ValueError("return_sum_squares and return_probs cannot both be set.")
  if impl == "fused" and (return_probs or logit_soft_cap is not None):
    raise ValueError("impl='fused' cannot return attention probabilities or soft-cap logits; "
                     "use impl='explicit'.")
  Tq, Tk = q.shape[1], k.shape[1]
  where = dict(causal=causal, key_mask=key_mask, segment_ids=segment_ids)
  if impl == "explicit":
    out = _explicit(plan, q, k, v, resid_gain, term_gains, query_offset, where, logit_soft_cap)
  else:
    mask, is_causal = attention.fused_mask(Tq, Tk, query_offset=query_offset, **where)
    if kernels_take_terms(term_gains) and takes_combine_kernels(
        plan, v.shape, centred=True, simple_causal=is_causal):
      out = _combined_by_kernels(plan, q, k, v, resid_gain, term_gains.get("skip_gain"),
                                 term_gains["centre_gain"], out_gain, addend,
                                 return_sum_squares)
      if return_sum_squares and not isinstance(out, tuple):
        return out, sum_squares(out)
      return out
    attended_BQHd = attention_kernels.dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, backend=plan.platform,
        interpret=plan.interpret)
    by_chunks = plan.platform in TPU_LAYOUT_PLATFORMS
    terms = attention.fused_terms(
        v, **term_gains, num_queries=Tq, query_offset=query_offset, **where,
        prefix_sums=functools.partial(causal_prefix_sums, by_chunks=by_chunks))
    out = (combine_fused_terms(plan, attended_BQHd, resid_gain, terms), None)
  out_BQHd, probs_BHQK = out
  out_BQHd = _plus(addend, _times(out_gain, out_BQHd))
  if return_sum_squares:
    return out_BQHd, sum_squares(out_BQHd)
  return (out_BQHd, probs_BHQK) if return_probs else out_BQHd


def _explicit(plan, q, k, v, resid_gain, term_gains, query_offset, where, logit_soft_cap):
  """(A' v, A): the reference's explicit form, the gain gradients by the `gains` rule."""
  Tq, Tk, H = q.shape[1], k.shape[1], q.shape[2]
  mask = masks.attention_mask(Tq, Tk, query_offset=query_offset, **where)
  logits_BHQK = jnp.where(mask, attention.attention_logits(q, k, logit_soft_cap=logit_soft_cap),
                          jnp.finfo(jnp.float32).min)
  terms = attention.shaping_terms(mask, num_queries=Tq, num_keys=Tk, query_offset=query_offset,
                                  **term_gains, num_heads=H)
  shape = (_fast_shape_attention_matrix if plan.applies("gains")
           else attention.shape_attention_matrix)
  resid_H = jnp.broadcast_to(jnp.asarray(resid_gain, jnp.float32).reshape(-1), (H,))
  shaped_BHQK, probs_BHQK = shape(logits_BHQK, resid_H, terms)
  return jnp.einsum("bhqk,bkhd->bqhd", shaped_BHQK.astype(v.dtype), v), probs_BHQK


def _combined_by_kernels(plan, q, k, v, resid_gain, skip_gain, centre_gain, out_gain, addend,
                         return_sum_squares):
  """The causal fused form through the platform's kernel and the combine kernels, `out_gain`
  folded into the kernels' gains and `addend` taken in by them."""
  q, k, v = combine_kernel.split_as_the_kernels(q, k, v)
  if addend is not None:
    [addend] = combine_kernel.split_as_the_kernels(addend)
  attended_BQHd = attention_kernels.dot_product_attention(
      q, k, v, mask=None, is_causal=True, backend=plan.platform, interpret=plan.interpret)
  scale = 1.0 if out_gain is None else jnp.asarray(out_gain, jnp.float32)
  head_vector = lambda g: scale * jnp.broadcast_to(
      jnp.asarray(0.0 if g is None else g, jnp.float32).reshape(-1), (q.shape[2],))
  # The TPU's Mosaic kernels or the GPU's Triton ones; elsewhere the GPU's, interpreted.
  backend = "tpu" if plan.platform == "tpu" else "gpu"
  interpret = plan.interpret or plan.platform not in ("gpu", "tpu")
  return combine_kernel.causal_combine(
      attended_BQHd, v, head_vector(resid_gain), head_vector(skip_gain),
      head_vector(centre_gain), skip_gain is not None, interpret, addend, backend=backend,
      sum_squares=return_sum_squares and backend == "gpu")


def sum_squares(out_BQHd) -> jax.Array:
  """float32 [B, Q]: the sum over heads and d of out^2, not differentiated (a statistic for
  `fast.layers.RMSNorm`, whose gradient takes the sums' part through x)."""
  return jax.lax.stop_gradient(jnp.sum(jnp.square(out_BQHd.astype(jnp.float32)), axis=(2, 3)))


def _times(gain, out_BQHd):
  """`gain * out` as the caller would have taken it (float32 for a float32 gain), or out."""
  return out_BQHd if gain is None else gain * out_BQHd


def _plus(addend, out_BQHd):
  """`addend + out`, as the caller would have taken it; or out."""
  return out_BQHd if addend is None else addend + out_BQHd
