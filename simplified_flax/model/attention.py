"""Shaped attention (He & Hofmann 2024, Sec. 4.1; docs/model.md, "Attention") as pure functions:

    A' = alpha * I + beta * A - gamma * C,       A = softmax(q k^T / sqrt(d) + mask)

(Eqs. (4) and (3)), per-head gains alpha = `skip_gain`, beta = `resid_gain`, gamma =
`centre_gain`; a None alpha or gamma omits its term. C is the row-normalised mask (Eq. (5)),
whatever the mask is (causal, padded, packed, offset queries: masks.py). Two exact forms:
`impl="explicit"` forms A' [B, H, Q, K] (and can return A); `impl="fused"` computes Eq. (6),
`A' v = beta * (A v) + alpha * v - gamma * (C v)`, with `jax.nn.dot_product_attention` for
`A v` and C v a cumulative or masked mean. q [B, Q, H, d], k and v [B, K, H, d], gains [H] or
scalars. Each shaping term is listed once, in `shaping_terms` (explicit) and `fused_terms`
(fused): a new term goes into both.
"""
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from simplified_flax.model import masks

Impl = Literal["explicit", "fused"]
IMPLS = ("explicit", "fused")


def centering_matrix_from_mask(mask) -> jax.Array:
  """C = the mask with each row normalised to sum 1, rows with no visible key 0 (Eq. (5))."""
  mask = mask.astype(jnp.float32)
  return mask / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)


def centering_matrix(num_queries: int, num_keys: int, **where) -> jax.Array:
  """C [B or 1, Q, K] of the mask `masks.attention_mask(num_queries, num_keys, **where)` (its
  causal, query_offset, key_mask and segment_ids): row i averages the keys query i sees."""
  return centering_matrix_from_mask(masks.attention_mask(num_queries, num_keys, **where))[:, 0]


def attention_logits(q_BQHd, k_BKHd, *, logit_soft_cap=None) -> jax.Array:
  """float32 [B, H, Q, K] = q k^T / sqrt(d) (Eq. (3), before the mask), optionally soft-capped
  as cap * tanh(x / cap)."""
  scale = q_BQHd.shape[-1] ** -0.5
  logits_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHd, k_BKHd,
                           preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits_BHQK = logit_soft_cap * jnp.tanh(logits_BHQK / logit_soft_cap)
  return logits_BHQK


def shaping_terms(mask, *, num_queries: int, num_keys: int, query_offset, skip_gain,
                  centre_gain, num_heads: int):
  """The explicit form's (gain [H], matrix) terms of A' besides beta * A (Eq. (4)): (alpha, I)
  and (gamma, -C), each matrix broadcasting against [B, H, Q, K]; a None gain omits its term."""
  head_vector = lambda g: jnp.broadcast_to(   # scalar or [H] -> [H]
      jnp.asarray(g, jnp.float32).reshape(-1), (num_heads,))
  eye_QK = jnp.arange(num_keys) == masks.query_positions(num_queries, query_offset)[..., None]
  terms = []
  if skip_gain is not None:
    terms.append((head_vector(skip_gain), eye_QK[..., None, :, :].astype(jnp.float32)))
  if centre_gain is not None:
    terms.append((head_vector(centre_gain), -centering_matrix_from_mask(mask)))
  return terms


def shape_attention_matrix(logits_BHQK, resid_H, terms):
  """(A', A = softmax(logits)), both [B, H, Q, K]: A' = resid * A + the sum of gain * matrix
  over the (gain [H], matrix) `terms` (Eq. (4); Eq. (3) for A)."""
  probs_BHQK = jax.nn.softmax(logits_BHQK, axis=-1)
  shaped_BHQK = resid_H.reshape(-1, 1, 1) * probs_BHQK
  for gain_H, matrix in terms:
    shaped_BHQK = shaped_BHQK + gain_H.reshape(-1, 1, 1) * matrix
  return shaped_BHQK, probs_BHQK


def cumulative_sum(v_BTHd) -> jax.Array:
  """float32 [B, T, H, d]: the sum of v over times <= t, at each t."""
  return jnp.cumsum(v_BTHd.astype(jnp.float32), axis=1)


def centred_values(v_BKHd, *, causal: bool, num_queries: int, query_offset=0, key_mask=None,
                   segment_ids=None, prefix_sums: Callable = cumulative_sum) -> jax.Array:
  """C v (Eq. (6)) without forming C: float32 [B, Q, H, d] in O(T * H * d). `prefix_sums`
  takes the causal cumulative sum along time (any exact form of `cumulative_sum`)."""
  B, T = v_BKHd.shape[:2]
  valid_BT = jnp.ones((B, T), jnp.float32) if key_mask is None else key_mask.astype(jnp.float32)
  if key_mask is not None:   # zeroes the padding keys, in v's dtype (exact)
    v_BKHd = v_BKHd * valid_BT.astype(v_BKHd.dtype)[:, :, None, None]
  if causal:
    sum_BKHd = prefix_sums(v_BKHd)
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


def fused_terms(v_BKHd, *, skip_gain, centre_gain, num_queries: int, query_offset=0,
                prefix_sums: Callable = cumulative_sum, **where):
  """The fused form's (gain, values [B, Q, H, d]) terms besides beta * (A v) (Eq. (6)):
  (alpha, v at the queries) and (gamma, -C v); `where` is the mask's causal, key_mask and
  segment_ids. The same terms as `shaping_terms`, applied to v."""
  terms = []
  if skip_gain is not None:
    terms.append((skip_gain, masks.take_queries(v_BKHd, num_queries, query_offset)))
  if centre_gain is not None:
    terms.append((centre_gain, -centred_values(v_BKHd, num_queries=num_queries,
                                               query_offset=query_offset,
                                               prefix_sums=prefix_sums, **where)))
  return terms


def combine_fused_terms(attended_BQHd, resid, terms):
  """`resid * (A v) + the sum of gain * values` over the (gain, values [B, Q, H, d]) `terms`
  (Eq. (6); also the KV cache's), in float32 in this order, cast to attended's (v's) dtype.
  Gains [H] or scalars."""
  gain = lambda g: jnp.asarray(g, jnp.float32).reshape(-1, 1)   # [H] -> broadcast over [.., H, d]
  out_BQHd = gain(resid) * attended_BQHd.astype(jnp.float32)
  for g, values_BQHd in terms:
    out_BQHd = out_BQHd + gain(g) * values_BQHd.astype(jnp.float32)
  return out_BQHd.astype(attended_BQHd.dtype)


def fused_mask(num_queries: int, num_keys: int, *, causal: bool, key_mask, segment_ids,
               query_offset):
  """(mask or None, is_causal) for `jax.nn.dot_product_attention`: its own causal mask (or
  none) where that suffices, else the boolean mask [B or 1, 1, Q, K] (masks.py)."""
  unmasked = key_mask is None and segment_ids is None
  simple_causal = (causal and unmasked and num_queries == num_keys
                   and jnp.ndim(query_offset) == 0)
  if simple_causal or (unmasked and not causal):
    return None, simple_causal
  return masks.attention_mask(num_queries, num_keys, causal=causal, query_offset=query_offset,
                              key_mask=key_mask, segment_ids=segment_ids), False


def shaped_attention(q, k, v, *, resid_gain, skip_gain, centre_gain, causal: bool,
                     key_mask=None, segment_ids=None, query_offset=0, impl: Impl = "explicit",
                     logit_soft_cap=None, return_probs: bool = False):
  """Shaped attention `A' v` [B, Q, H, d] in v's dtype, in either form; `key_mask` [B, K] is
  True on real tokens. `return_probs` (explicit only) also returns the float32 softmax A
  [B, H, Q, K]. Both forms agree to float32 round-off, gradients included."""
  if impl not in IMPLS:
    raise ValueError(f"Unknown attention impl {impl!r}; expected one of {IMPLS}.")
  if impl == "fused" and (return_probs or logit_soft_cap is not None):
    raise ValueError("impl='fused' cannot return attention probabilities or soft-cap logits; "
                     "use impl='explicit'.")
  Tq, Tk = q.shape[1], k.shape[1]
  where = dict(causal=causal, key_mask=key_mask, segment_ids=segment_ids)
  if impl == "fused":   # Eq. (6)
    mask, is_causal = fused_mask(Tq, Tk, query_offset=query_offset, **where)
    attended_BQHd = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal,
                                                 implementation="xla")
    terms = fused_terms(v, skip_gain=skip_gain, centre_gain=centre_gain, num_queries=Tq,
                        query_offset=query_offset, **where)
    return combine_fused_terms(attended_BQHd, resid_gain, terms)

  mask = masks.attention_mask(Tq, Tk, query_offset=query_offset, **where)
  logits_BHQK = jnp.where(mask, attention_logits(q, k, logit_soft_cap=logit_soft_cap),
                          jnp.finfo(jnp.float32).min)
  H = q.shape[2]
  terms = shaping_terms(mask, num_queries=Tq, num_keys=Tk, query_offset=query_offset,
                        skip_gain=skip_gain, centre_gain=centre_gain, num_heads=H)
  resid_H = jnp.broadcast_to(jnp.asarray(resid_gain, jnp.float32).reshape(-1), (H,))
  shaped_BHQK, probs_BHQK = shape_attention_matrix(logits_BHQK, resid_H, terms)
  out_BQHd = jnp.einsum("bhqk,bkhd->bqhd", shaped_BHQK.astype(v.dtype), v)
  return (out_BQHd, probs_BHQK) if return_probs else out_BQHd
