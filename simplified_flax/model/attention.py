"""Shaped attention (He & Hofmann 2024, Sec. 4.1; docs/model.md, "Attention") as pure functions:

    A' = alpha * I + beta * A - gamma * C,       A = softmax(q k^T / sqrt(d) + mask),

with per-head gains alpha = `skip_gain` (on I), beta = `resid_gain` (on A), gamma =
`centre_gain` (on C). C is the value A takes when every logit is zero, i.e. the row-normalised
mask, whatever the mask is (causal, padded, packed, offset queries: masks.py). Two exact forms:
  * `impl="explicit"` forms A' as a [B, H, Q, K] matrix (and can return A for diagnostics);
  * `impl="fused"` never forms C: `A' v = beta * (A v) + alpha * v - gamma * (C v)`, with
    `A v` from `jax.nn.dot_product_attention` and `C v` a (segment-wise) cumulative mean
    (causal) or masked mean (bidirectional), O(T * D).
Layout: q [B, Q, H, d], k and v [B, K, H, d] (that of `jax.nn.dot_product_attention`), gains
[H]. The speed-only gradient rule of the explicit form lives in grad_rules.py.
"""
from typing import Literal

import jax
import jax.numpy as jnp

from simplified_flax.model import attention_kernels
from simplified_flax.model import grad_rules
from simplified_flax.model import masks

Impl = Literal["explicit", "fused"]
IMPLS = ("explicit", "fused")


# ------------------------------------------------------------------------ centering matrices

def centering_matrix_from_mask(mask) -> jax.Array:
  """C = the mask with each row normalised to sum 1 (rows with no visible key are 0)."""
  mask = mask.astype(jnp.float32)
  return mask / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)


def causal_centering_matrix(length: int, *, query_offset: int = 0, num_queries=None):
  """[Q, T]: C[i, j] = 1 / (p + 1) for j <= p, p = query_offset + i the absolute position."""
  num_queries = length if num_queries is None else num_queries
  mask = masks.attention_mask(num_queries, length, causal=True, query_offset=query_offset)
  return centering_matrix_from_mask(mask)[0, 0]


def bidirectional_centering_matrix(key_mask_BT) -> jax.Array:
  """[B, T, T]: every row is 1/n on the n real (non-padding) keys of its sequence."""
  T = key_mask_BT.shape[1]
  mask = masks.attention_mask(T, T, causal=False, key_mask=key_mask_BT)
  return centering_matrix_from_mask(mask)[:, 0]


def packed_centering_matrix(segment_ids_BT, *, causal: bool, key_mask_BT=None) -> jax.Array:
  """[B, T, T]: block diagonal, each block the causal or bidirectional C of its own segment."""
  T = segment_ids_BT.shape[1]
  mask = masks.attention_mask(T, T, causal=causal, key_mask=key_mask_BT,
                              segment_ids=segment_ids_BT)
  return centering_matrix_from_mask(mask)[:, 0]


# ------------------------------------------------------------------------------ explicit

def attention_logits(q_BQHd, k_BKHd, *, logit_soft_cap=None) -> jax.Array:
  """float32 [B, H, Q, K] = q k^T / sqrt(d), optionally soft-capped cap*tanh(x/cap)."""
  scale = q_BQHd.shape[-1] ** -0.5
  logits_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHd, k_BKHd,
                           preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits_BHQK = logit_soft_cap * jnp.tanh(logits_BHQK / logit_soft_cap)
  return logits_BHQK


def shape_attention_matrix(logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK):
  """(A' = beta * A + alpha * I - gamma * C, A = softmax(logits)), both [B, H, Q, K].

  Gains are per head [H] (beta = resid, alpha = skip, gamma = centre); a None gain omits its
  term. `eye_QK` and `centre_QK` broadcast against the logits.
  """
  probs_BHQK = jax.nn.softmax(logits_BHQK, axis=-1)
  per_head = lambda gain_H: gain_H.reshape(-1, 1, 1)
  shaped_BHQK = per_head(resid_H) * probs_BHQK
  if skip_H is not None:
    shaped_BHQK = shaped_BHQK + per_head(skip_H) * eye_QK
  if centre_H is not None:
    shaped_BHQK = shaped_BHQK - per_head(centre_H) * centre_QK
  return shaped_BHQK, probs_BHQK


_fast_shape_attention_matrix = grad_rules.fast_gain_gradients(shape_attention_matrix)


def _explicit(q, k, v, *, mask, resid_gain, skip_gain, centre_gain, query_offset,
              logit_soft_cap, grad_rules_mode):
  logits_BHQK = attention_logits(q, k, logit_soft_cap=logit_soft_cap)
  logits_BHQK = jnp.where(mask, logits_BHQK, jnp.finfo(jnp.float32).min)
  Tq, Tk, H = q.shape[1], k.shape[1], q.shape[2]
  eye_QK = jnp.arange(Tk) == masks.query_positions(Tq, query_offset)[..., None]   # or [B, Q, K]
  head_vector = lambda g: None if g is None else jnp.broadcast_to(
      jnp.asarray(g, jnp.float32).reshape(-1), (H,))
  shape = (_fast_shape_attention_matrix if grad_rules.enabled(grad_rules_mode)
           else shape_attention_matrix)
  shaped_BHQK, probs_BHQK = shape(
      logits_BHQK=logits_BHQK, resid_H=head_vector(resid_gain), skip_H=head_vector(skip_gain),
      centre_H=head_vector(centre_gain), eye_QK=eye_QK[..., None, :, :].astype(jnp.float32),
      centre_QK=centering_matrix_from_mask(mask))
  out_BQHd = jnp.einsum("bhqk,bkhd->bqhd", shaped_BHQK.astype(v.dtype), v)
  return out_BQHd, probs_BHQK


# ------------------------------------------------------------------------------- fused

def centred_values(v_BKHd, *, causal: bool, num_queries: int, query_offset=0, key_mask=None,
                   segment_ids=None) -> jax.Array:
  """C v without forming C: [B, Q, H, d], computed in float32 in O(T * H * d)."""
  B, T = v_BKHd.shape[:2]
  valid_BT = jnp.ones((B, T), jnp.float32) if key_mask is None else key_mask.astype(jnp.float32)
  v_BKHd = v_BKHd.astype(jnp.float32) * valid_BT[:, :, None, None]
  if causal:
    sum_BKHd = jnp.cumsum(v_BKHd, axis=1)
    count_BT = jnp.cumsum(valid_BT, axis=1)
    if segment_ids is not None:
      # Sum over the run so far = inclusive prefix at t - exclusive prefix at the run's start.
      starts_BT = masks.segment_run_starts(segment_ids)
      sum_BKHd = sum_BKHd - masks.gather_time(sum_BKHd - v_BKHd, starts_BT)
      count_BT = count_BT - masks.gather_time(count_BT - valid_BT, starts_BT)
  else:
    seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    flat_ids = (jnp.arange(B)[:, None] * T + seg_BT).reshape(-1)   # one bucket per (row, segment)
    sums = jax.ops.segment_sum(v_BKHd.reshape(B * T, -1), flat_ids, num_segments=B * T)
    counts = jax.ops.segment_sum(valid_BT.reshape(-1), flat_ids, num_segments=B * T)
    sum_BKHd = sums[flat_ids].reshape(v_BKHd.shape)
    count_BT = counts[flat_ids].reshape(B, T)
  mean_BKHd = sum_BKHd / jnp.maximum(count_BT, 1.0)[:, :, None, None]
  return masks.take_queries(mean_BKHd, num_queries, query_offset)


def _fused(q, k, v, *, causal, key_mask, segment_ids, query_offset, resid_gain, skip_gain,
           centre_gain):
  Tq, Tk = q.shape[1], k.shape[1]
  simple_causal = (causal and key_mask is None and segment_ids is None and Tq == Tk
                   and jnp.ndim(query_offset) == 0)
  mask = None
  if not simple_causal and (causal or key_mask is not None or segment_ids is not None):
    mask = masks.attention_mask(Tq, Tk, causal=causal, query_offset=query_offset,
                                key_mask=key_mask, segment_ids=segment_ids)
  attended_BQHd = attention_kernels.dot_product_attention(q, k, v, mask=mask,
                                                         is_causal=simple_causal)
  gain = lambda g: jnp.asarray(g, jnp.float32).reshape(-1, 1)   # [H] -> broadcast over [.., H, d]
  out_BQHd = gain(resid_gain) * attended_BQHd.astype(jnp.float32)
  if skip_gain is not None:
    v_self_BQHd = masks.take_queries(v, Tq, query_offset)   # what the identity term picks
    out_BQHd = out_BQHd + gain(skip_gain) * v_self_BQHd.astype(jnp.float32)
  if centre_gain is not None:
    out_BQHd = out_BQHd - gain(centre_gain) * centred_values(
        v, causal=causal, num_queries=Tq, query_offset=query_offset, key_mask=key_mask,
        segment_ids=segment_ids)
  return out_BQHd.astype(v.dtype)


# -------------------------------------------------------------------------------- public

def shaped_attention(q, k, v, *, resid_gain, skip_gain, centre_gain, causal: bool,
                     key_mask=None, segment_ids=None, query_offset=0, impl: Impl = "explicit",
                     logit_soft_cap=None, return_probs: bool = False,
                     grad_rules_mode: str = "auto"):
  """Shaped attention `(beta * A + alpha * I - gamma * C) v`, [B, Q, H, d].

  `skip_gain` / `centre_gain` None omit that term (plain attention). `key_mask` [B, K] is
  True on real tokens. With `return_probs` (explicit only) also returns the float32 softmax
  A [B, H, Q, K] for diagnostics. Both impls agree to float32 round-off, and so do their
  gradients whatever `grad_rules_mode` ("auto", "on", "off"; see grad_rules.py).
  """
  if impl == "explicit":
    mask = masks.attention_mask(q.shape[1], k.shape[1], causal=causal,
                                query_offset=query_offset, key_mask=key_mask,
                                segment_ids=segment_ids)
    out, probs = _explicit(q, k, v, mask=mask, resid_gain=resid_gain, skip_gain=skip_gain,
                           centre_gain=centre_gain, query_offset=query_offset,
                           logit_soft_cap=logit_soft_cap, grad_rules_mode=grad_rules_mode)
    return (out, probs) if return_probs else out
  if impl == "fused":
    if return_probs or logit_soft_cap is not None:
      raise ValueError("impl='fused' cannot return attention probabilities or soft-cap logits; "
                       "use impl='explicit'.")
    return _fused(q, k, v, causal=causal, key_mask=key_mask, segment_ids=segment_ids,
                  query_offset=query_offset, resid_gain=resid_gain, skip_gain=skip_gain,
                  centre_gain=centre_gain)
  raise ValueError(f"Unknown attention impl {impl!r}; expected one of {IMPLS}.")


def attention(q, k, v, *, resid_gain=1.0, **kwargs):
  """Plain (unshaped) attention `resid * A v`; keyword arguments as `shaped_attention`."""
  return shaped_attention(q, k, v, resid_gain=resid_gain, skip_gain=None, centre_gain=None,
                          **kwargs)
