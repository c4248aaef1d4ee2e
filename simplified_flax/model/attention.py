"""Shaped attention (He & Hofmann 2024, Sec. 4.1; docs/model.md, "Attention") as pure functions:

    A' = alpha * I + beta * A - gamma * C,       A = softmax(q k^T / sqrt(d) + mask)

(Eqs. (4) and (3)), per-head gains alpha = `skip_gain`, beta = `resid_gain`, gamma =
`centre_gain`; a None alpha or gamma omits its term. C is the row-normalised mask (Eq. (5)),
whatever the mask is (causal, padded, packed, offset queries: masks.py). Two exact forms:
`impl="explicit"` forms A' [B, H, Q, K] (and can return A); `impl="fused"` computes Eq. (6),
`A' v = beta * (A v) + alpha * v - gamma * (C v)`, with a fused kernel for `A v` and C v a
cumulative or masked mean. q [B, Q, H, d], k and v [B, K, H, d], gains [H] or scalars.
"""
from typing import Literal

import jax
import jax.numpy as jnp

from simplified_flax.model import attention_kernels
from simplified_flax.model import combine_kernel
from simplified_flax.model import combine_kernel_tpu
from simplified_flax.model import grad_rules
from simplified_flax.model import masks
from simplified_flax.model import target_platform

Impl = Literal["explicit", "fused"]
IMPLS = ("explicit", "fused")


def centering_matrix_from_mask(mask) -> jax.Array:
  """C = the mask with each row normalised to sum 1, rows with no visible key 0 (Eq. (5))."""
  mask = mask.astype(jnp.float32)
  return mask / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)


def causal_centering_matrix(length: int, *, query_offset: int = 0, num_queries=None):
  """[Q, T] causal C: C[i, j] = 1 / (p + 1) for j <= p = query_offset + i."""
  mask = masks.attention_mask(length if num_queries is None else num_queries, length,
                              causal=True, query_offset=query_offset)
  return centering_matrix_from_mask(mask)[0, 0]


def bidirectional_centering_matrix(key_mask_BT) -> jax.Array:
  """[B, T, T] bidirectional C: every row 1/n on the n real keys of its sequence."""
  no_segments_BT = jnp.zeros(key_mask_BT.shape, jnp.int32)
  return packed_centering_matrix(no_segments_BT, causal=False, key_mask_BT=key_mask_BT)


def packed_centering_matrix(segment_ids_BT, *, causal: bool, key_mask_BT=None) -> jax.Array:
  """[B, T, T] packed C: block diagonal, each block the C of its own segment."""
  T = segment_ids_BT.shape[1]
  mask = masks.attention_mask(T, T, causal=causal, key_mask=key_mask_BT,
                              segment_ids=segment_ids_BT)
  return centering_matrix_from_mask(mask)[:, 0]


def attention_logits(q_BQHd, k_BKHd, *, logit_soft_cap=None) -> jax.Array:
  """float32 [B, H, Q, K] = q k^T / sqrt(d) (Eq. (3), before the mask), optionally soft-capped
  as cap * tanh(x / cap)."""
  scale = q_BQHd.shape[-1] ** -0.5
  logits_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHd, k_BKHd,
                           preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits_BHQK = logit_soft_cap * jnp.tanh(logits_BHQK / logit_soft_cap)
  return logits_BHQK


def shape_attention_matrix(logits_BHQK, resid_H, terms):
  """(A', A = softmax(logits)), both [B, H, Q, K]: A' = resid * A + the sum of gain * matrix
  over the (gain [H], matrix) `terms`, each matrix broadcasting against the logits. Eq. (4)
  with the terms (alpha, I) and (gamma, -C); Eq. (3) for A.
  """
  probs_BHQK = jax.nn.softmax(logits_BHQK, axis=-1)
  shaped_BHQK = resid_H.reshape(-1, 1, 1) * probs_BHQK
  for gain_H, matrix in terms:
    shaped_BHQK = shaped_BHQK + gain_H.reshape(-1, 1, 1) * matrix
  return shaped_BHQK, probs_BHQK


_fast_shape_attention_matrix = grad_rules.fast_gain_gradients(shape_attention_matrix)


def centred_values(v_BKHd, *, causal: bool, num_queries: int, query_offset=0, key_mask=None,
                   segment_ids=None) -> jax.Array:
  """C v (Eq. (6)) without forming C: float32 [B, Q, H, d] in O(T * H * d)."""
  B, T = v_BKHd.shape[:2]
  valid_BT = jnp.ones((B, T), jnp.float32) if key_mask is None else key_mask.astype(jnp.float32)
  if key_mask is not None:   # zeroes the padding keys, in v's dtype (exact)
    v_BKHd = v_BKHd * valid_BT.astype(v_BKHd.dtype)[:, :, None, None]
  if causal:
    sum_BKHd = causal_prefix_sums(v_BKHd)
    v_BKHd = v_BKHd.astype(jnp.float32)
    count_BT = jnp.cumsum(valid_BT, axis=1)
    if segment_ids is not None:
      # Sum over the run so far = inclusive prefix at t - exclusive prefix at the run's start.
      starts_BT = masks.segment_run_starts(segment_ids)
      sum_BKHd = sum_BKHd - masks.gather_time(sum_BKHd - v_BKHd, starts_BT)
      count_BT = count_BT - masks.gather_time(count_BT - valid_BT, starts_BT)
  else:
    v_BKHd = v_BKHd.astype(jnp.float32)
    seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    flat_ids = (jnp.arange(B)[:, None] * T + seg_BT).reshape(-1)   # one bucket per (row, segment)
    sums = jax.ops.segment_sum(v_BKHd.reshape(B * T, -1), flat_ids, num_segments=B * T)
    counts = jax.ops.segment_sum(valid_BT.reshape(-1), flat_ids, num_segments=B * T)
    sum_BKHd = sums[flat_ids].reshape(v_BKHd.shape)
    count_BT = counts[flat_ids].reshape(B, T)
  mean_BKHd = sum_BKHd / jnp.maximum(count_BT, 1.0)[:, :, None, None]
  return masks.take_queries(mean_BKHd, num_queries, query_offset)


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


def _tpu_layouts() -> bool:
  return target_platform.current() in TPU_LAYOUT_PLATFORMS


def causal_prefix_sums(v_BTHd, *, by_chunks: bool | None = None) -> jax.Array:
  """float32 [B, T, H, d]: the sum of v over times <= t, at each t (a cumulative sum).
  `by_chunks` (default: on TPU_LAYOUT_PLATFORMS), where T is a multiple of PREFIX_CHUNK: as
  matmuls, each chunk of times by a lower-triangular 0/1 matrix (its products exact, the sums
  in float32), plus the earlier chunks' totals. XLA's TPU cumulative sum instead reduces over
  windows with time minor-most, through float32 layout copies of [B, T, H, d]."""
  B, T, H, d = v_BTHd.shape
  if T % PREFIX_CHUNK or not (_tpu_layouts() if by_chunks is None else by_chunks):
    return jnp.cumsum(v_BTHd.astype(jnp.float32), axis=1)
  c, N = PREFIX_CHUNK, T // PREFIX_CHUNK
  lower_cc = (jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]).astype(v_BTHd.dtype)
  sums_BNcHd = jnp.einsum("ij,bnjhd->bnihd", lower_cc, v_BTHd.reshape(B, N, c, H, d),
                          preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)
  if N > 1:   # add each chunk's earlier chunks: an exclusive cumulative sum of N totals
    totals_BNHd = sums_BNcHd[:, :, -1]
    sums_BNcHd = sums_BNcHd + (jnp.cumsum(totals_BNHd, axis=1) - totals_BNHd)[:, :, None]
  return sums_BNcHd.reshape(B, T, H, d)


def combine_fused_terms(attended_BQHd, resid, terms):
  """`resid * (A v) + the sum of gain * values` over the (gain, values [B, Q, H, d]) `terms`:
  the fused form's sum (Eq. (6), with the terms (alpha, v at the queries) and (gamma, -C v);
  also the KV cache's), in float32 in this order, cast to attended's (v's) dtype. Gains [H]
  or scalars."""
  gain = lambda g: jnp.asarray(g, jnp.float32).reshape(-1, 1)   # [H] -> broadcast over [.., H, d]
  out_BQHd = gain(resid) * attended_BQHd.astype(jnp.float32)
  for g, values_BQHd in terms:
    out_BQHd = out_BQHd + gain(g) * values_BQHd.astype(jnp.float32)
  out_BQHd = out_BQHd.astype(attended_BQHd.dtype)
  if out_BQHd.dtype == jnp.float32 or target_platform.current() not in HELD_COMBINE_PLATFORMS:
    return out_BQHd
  # Held in bfloat16: XLA would drop the rounding where the block casts it back up and carry
  # float32 [B, T, H, d] onwards (HELD_COMBINE_PLATFORMS: the same maths at more bytes).
  return jax.lax.optimization_barrier(out_BQHd)


def takes_combine_kernels(v_shape, *, centred: bool, simple_causal: bool) -> bool:
  """Whether the fused form's combine runs as `combine_kernel`'s kernels for values of
  `v_shape` [B, T, H, d]: a centred attention, the plain causal mask (`simple_causal`: no
  padding, packing or offset queries), the `combine` rule on, and shapes the kernels of the
  platform take (a TPU's own; elsewhere the GPU's, interpreted off a GPU)."""
  if not (centred and simple_causal and grad_rules.enabled("combine")):
    return False
  platform = target_platform.current()
  v = jax.ShapeDtypeStruct(tuple(v_shape), jnp.float32)
  if platform == "tpu":
    return combine_kernel_tpu.supported(v)
  return combine_kernel.supported(
      v, min_programs=combine_kernel.MIN_PROGRAMS if platform == "gpu" else 1)


def shaped_attention(q, k, v, *, resid_gain, skip_gain, centre_gain, causal: bool,
                     key_mask=None, segment_ids=None, query_offset=0, impl: Impl = "explicit",
                     logit_soft_cap=None, return_probs: bool = False, out_gain=None,
                     addend=None, return_sum_squares: bool = False):
  """Shaped attention `A' v` [B, Q, H, d] in v's dtype, in either form; `key_mask` [B, K] is
  True on real tokens. `return_probs` (explicit only) also returns the float32 softmax A
  [B, H, Q, K]. Both forms agree to float32 round-off, gradients included. `out_gain`: the
  result times it. `addend` [B, Q, H, d]: added to the result (a parallel block's sum), by
  the combine's kernels before their one rounding where they apply. `return_sum_squares`
  (not with `return_probs`): also `sum_squares(result)` [B, Q], for the RMS norm that reads
  the result next (`layers.rms_norm`); the GPU's combine kernels write it with the result."""
  if return_sum_squares and return_probs:
    raise ValueError("return_sum_squares and return_probs cannot both be set.")
  if impl not in IMPLS:
    raise ValueError(f"Unknown attention impl {impl!r}; expected one of {IMPLS}.")
  if impl == "fused" and (return_probs or logit_soft_cap is not None):
    raise ValueError("impl='fused' cannot return attention probabilities or soft-cap logits; "
                     "use impl='explicit'.")
  Tq, Tk = q.shape[1], k.shape[1]
  where = dict(causal=causal, query_offset=query_offset, key_mask=key_mask,
               segment_ids=segment_ids)
  if impl == "fused":
    # The kernel's own causal mask (or none) where it suffices: TPU's splash takes no array.
    unmasked = key_mask is None and segment_ids is None
    simple_causal = causal and unmasked and Tq == Tk and jnp.ndim(query_offset) == 0
    mask = (None if simple_causal or (unmasked and not causal)
            else masks.attention_mask(Tq, Tk, **where))
    platform = target_platform.current()
    combine_kernels = takes_combine_kernels(v.shape, centred=centre_gain is not None,
                                            simple_causal=simple_causal)
    if combine_kernels:
      q, k, v = combine_kernel.split_as_the_kernels(q, k, v)
      if addend is not None:
        [addend] = combine_kernel.split_as_the_kernels(addend)
    attended_BQHd = attention_kernels.dot_product_attention(q, k, v, mask=mask,
                                                           is_causal=simple_causal)
    if combine_kernels:   # out_gain folded into the kernels' gains
      scale = 1.0 if out_gain is None else jnp.asarray(out_gain, jnp.float32)
      head_vector = lambda g: scale * jnp.broadcast_to(
          jnp.asarray(0.0 if g is None else g, jnp.float32).reshape(-1), (q.shape[2],))
      # The TPU's Mosaic kernels or the GPU's Triton ones; elsewhere the GPU's interpreted.
      backend = "tpu" if platform == "tpu" else "gpu"
      out = combine_kernel.causal_combine(
          attended_BQHd, v, head_vector(resid_gain), head_vector(skip_gain),
          head_vector(centre_gain), skip_gain is not None, platform not in ("gpu", "tpu"),
          addend, backend=backend, sum_squares=return_sum_squares and backend == "gpu")
      if return_sum_squares and backend != "gpu":
        return out, sum_squares(out)
      return out
    terms = []
    if skip_gain is not None:
      terms.append((skip_gain, masks.take_queries(v, Tq, query_offset)))
    if centre_gain is not None:
      terms.append((centre_gain, -centred_values(v, num_queries=Tq, **where)))
    out_BQHd = _plus(addend,
                     _times(out_gain, combine_fused_terms(attended_BQHd, resid_gain, terms)))
    return (out_BQHd, sum_squares(out_BQHd)) if return_sum_squares else out_BQHd

  mask = masks.attention_mask(Tq, Tk, **where)
  logits_BHQK = jnp.where(mask, attention_logits(q, k, logit_soft_cap=logit_soft_cap),
                          jnp.finfo(jnp.float32).min)
  eye_QK = jnp.arange(Tk) == masks.query_positions(Tq, query_offset)[..., None]   # or [B, Q, K]
  head_vector = lambda g: jnp.broadcast_to(   # scalar or [H] -> [H]
      jnp.asarray(g, jnp.float32).reshape(-1), (q.shape[2],))
  terms = []
  if skip_gain is not None:
    terms.append((head_vector(skip_gain), eye_QK[..., None, :, :].astype(jnp.float32)))
  if centre_gain is not None:
    terms.append((head_vector(centre_gain), -centering_matrix_from_mask(mask)))
  shape = _fast_shape_attention_matrix if grad_rules.enabled("gains") else shape_attention_matrix
  shaped_BHQK, probs_BHQK = shape(logits_BHQK, head_vector(resid_gain), terms)
  out_BQHd = _times(out_gain, jnp.einsum("bhqk,bkhd->bqhd", shaped_BHQK.astype(v.dtype), v))
  out_BQHd = _plus(addend, out_BQHd)
  if return_sum_squares:
    return out_BQHd, sum_squares(out_BQHd)
  return (out_BQHd, probs_BHQK) if return_probs else out_BQHd


def sum_squares(out_BQHd) -> jax.Array:
  """float32 [B, Q]: the sum over heads and d of out^2, not differentiated (a statistic for
  `layers.rms_norm`, whose gradient takes the sums' part through x)."""
  return jax.lax.stop_gradient(jnp.sum(jnp.square(out_BQHd.astype(jnp.float32)), axis=(2, 3)))


def _times(gain, out_BQHd):
  """`gain * out` as the caller would have taken it (float32 for a float32 gain), or out."""
  return out_BQHd if gain is None else gain * out_BQHd


def _plus(addend, out_BQHd):
  """`addend + out`, as the caller would have taken it; or out."""
  return out_BQHd if addend is None else addend + out_BQHd


def attention(q, k, v, *, resid_gain=1.0, **kwargs):
  """Plain (unshaped) attention `resid * A v`; keyword arguments as `shaped_attention`."""
  return shaped_attention(q, k, v, resid_gain=resid_gain, skip_gain=None, centre_gain=None,
                          **kwargs)
