"""Shaped attention (SPEC §2, §8) as pure functions.

Shaped attention replaces the attention matrix A = softmax(q k^T / sqrt(Dh) + mask) by

    A' = resid * A + skip * I - centre * C,

where C is the value A takes when every logit is zero: each row spreads its mass evenly over
the keys that row may see. C is therefore the row-normalised attention mask, whatever the mask
is (causal, padded, packed, offset queries), and the functions below derive it that way.

Two exact forms:
  * `impl="explicit"` forms A' as a [B, H, Tq, Tk] matrix (and can return A for diagnostics);
  * `impl="fused"` never forms C: `A' v = resid * (A v) + skip * v_self - centre * (C v)` where
    `A v` comes from `jax.nn.dot_product_attention` and `C v` is a (segment-wise) cumulative
    mean for causal attention or a masked mean for bidirectional attention, O(T * D).

Layout: q [B, Tq, H, Dh], k and v [B, Tk, H, Dh] (that of `jax.nn.dot_product_attention`);
per-head gains [H]. Queries sit at absolute positions `query_offset .. query_offset + Tq - 1`
of the key sequence (Tq == Tk and offset 0 in training); a [B] offset gives each row its own
(a KV cache whose rows hold sequences of different lengths). Packed `segment_ids` must be
contiguous runs (as sequence packing produces); they index the key sequence, [B, Tk].
"""
import functools
from typing import Literal

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

from simplified_flax.model import attention_kernels

Impl = Literal["explicit", "fused"]
IMPLS = ("explicit", "fused")


# ----------------------------------------------------------------------------- masks and C

def query_positions(num_queries: int, query_offset=0) -> jax.Array:
  """Absolute position of each query in the key sequence: [Tq], or [B, Tq] for a [B] offset."""
  return jnp.arange(num_queries) + jnp.asarray(query_offset)[..., None]


def attention_mask(num_queries: int, num_keys: int, *, causal: bool, query_offset=0,
                   key_mask=None, segment_ids=None) -> jax.Array:
  """Boolean [B or 1, 1, Tq, Tk]: True where query i may attend to key j."""
  k_pos = jnp.arange(num_keys)
  mask_BHQK = jnp.ones((1, 1, num_queries, num_keys), bool)
  if causal:
    causal_QK = k_pos <= query_positions(num_queries, query_offset)[..., None]   # or [B, Tq, Tk]
    mask_BHQK = mask_BHQK & causal_QK[..., None, :, :]
  if key_mask is not None:
    mask_BHQK = mask_BHQK & key_mask[:, None, None, :]
  if segment_ids is not None:
    q_seg_BQ = _take_queries(segment_ids, num_queries, query_offset)
    mask_BHQK = mask_BHQK & (q_seg_BQ[:, None, :, None] == segment_ids[:, None, None, :])
  return mask_BHQK


def centering_matrix_from_mask(mask) -> jax.Array:
  """C = the mask with each row normalised to sum 1 (rows with no visible key are 0)."""
  mask = mask.astype(jnp.float32)
  return mask / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)


def causal_centering_matrix(length: int, *, query_offset: int = 0, num_queries=None):
  """[Tq, T]: C[i, j] = 1 / (p + 1) for j <= p, where p = query_offset + i is the absolute position."""
  num_queries = length if num_queries is None else num_queries
  mask = attention_mask(num_queries, length, causal=True, query_offset=query_offset)
  return centering_matrix_from_mask(mask)[0, 0]


def bidirectional_centering_matrix(key_mask_BT) -> jax.Array:
  """[B, T, T]: every row is 1/n on the n real (non-padding) keys of its sequence."""
  T = key_mask_BT.shape[1]
  return centering_matrix_from_mask(attention_mask(T, T, causal=False, key_mask=key_mask_BT))[:, 0]


def packed_centering_matrix(segment_ids_BT, *, causal: bool, key_mask_BT=None) -> jax.Array:
  """[B, T, T]: block diagonal, each block the causal or bidirectional C of its own segment."""
  T = segment_ids_BT.shape[1]
  mask = attention_mask(T, T, causal=causal, key_mask=key_mask_BT, segment_ids=segment_ids_BT)
  return centering_matrix_from_mask(mask)[:, 0]


# ------------------------------------------------------------------------------ explicit

def _take_queries(x_BK_, num_queries: int, query_offset):
  """Rows of x [B, Tk, ...] at the query positions, [B, Tq, ...]."""
  if jnp.ndim(query_offset) == 0:
    return jax.lax.dynamic_slice_in_dim(x_BK_, query_offset, num_queries, axis=1)
  return _gather_time(x_BK_, query_positions(num_queries, query_offset))   # one offset per row


def _self_values(v_BKHD, num_queries: int, query_offset):
  """The value at each query's own position: what the identity term I picks."""
  return _take_queries(v_BKHD, num_queries, query_offset)


def attention_logits(q_BQHD, k_BKHD, *, logit_soft_cap=None) -> jax.Array:
  """float32 [B, H, Tq, Tk] = q k^T / sqrt(Dh), optionally soft-capped cap*tanh(x/cap)."""
  scale = q_BQHD.shape[-1] ** -0.5
  logits_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD,
                           preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits_BHQK = logit_soft_cap * jnp.tanh(logits_BHQK / logit_soft_cap)
  return logits_BHQK


def _explicit(q, k, v, mask, resid_gain, skip_gain, centre_gain, query_offset, logit_soft_cap):
  logits_BHQK = attention_logits(q, k, logit_soft_cap=logit_soft_cap)
  logits_BHQK = jnp.where(mask, logits_BHQK, jnp.finfo(jnp.float32).min)
  Tq, Tk, H = q.shape[1], k.shape[1], q.shape[2]
  eye_QK = jnp.arange(Tk) == query_positions(Tq, query_offset)[..., None]   # or [B, Tq, Tk]
  shaped_BHQK, probs_BHQK = _shape_softmax(
      logits_BHQK, _head_vector(resid_gain, H), _head_vector(skip_gain, H),
      _head_vector(centre_gain, H), eye_QK[..., None, :, :].astype(jnp.float32),
      centering_matrix_from_mask(mask), skip_gain is not None, centre_gain is not None)
  out_BQHD = jnp.einsum("bhqk,bkhd->bqhd", shaped_BHQK.astype(v.dtype), v)
  return out_BQHD, probs_BHQK


def _head_vector(gain, num_heads: int) -> jax.Array:
  """A gain (scalar or [H]; None for an absent term) as a float32 [H] vector."""
  if gain is None:
    return jnp.zeros((num_heads,), jnp.float32)
  return jnp.broadcast_to(jnp.asarray(gain, jnp.float32).reshape(-1), (num_heads,))


def _per_head(gain_H):
  """Gains [H] broadcast against [B, H, Tq, Tk]."""
  return gain_H.reshape(-1, 1, 1)


def _shape_softmax_forward(logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK, has_skip,
                           has_centre):
  probs_BHQK = jax.nn.softmax(logits_BHQK, axis=-1)
  shaped_BHQK = _per_head(resid_H) * probs_BHQK
  if has_skip:
    shaped_BHQK = shaped_BHQK + _per_head(skip_H) * eye_QK
  if has_centre:
    shaped_BHQK = shaped_BHQK - _per_head(centre_H) * centre_QK
  return shaped_BHQK, probs_BHQK


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7))
def _shape_softmax(logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK, has_skip,
                   has_centre):
  """(resid * softmax(logits) + skip * I - centre * C, softmax(logits)), both [B, H, Tq, Tk].

  `eye_QK` and `centre_QK` broadcast against the logits ([Tq, Tk], [1, 1, Tq, Tk] or
  [B, 1, Tq, Tk]); they come from the mask and are constants (their tangents are ignored).
  The JVP exists for speed, not for different values: it broadcasts each per-head gain's
  tangent over (B, Tq) first and over Tk last, so in reverse mode every gain gradient is a
  row (last-axis) sum before the (B, Tq) sum. Autodiff's single reduction over (B, Tq, Tk) of
  a [B, H, Tq, Tk] product is a strided loop on XLA:CPU costing a few percent of a SAS step.
  """
  return _shape_softmax_forward(logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK,
                                has_skip, has_centre)


def _per_row(gain_H, like_BHQK):
  """A per-head [H] tangent broadcast to [B, H, Tq, 1] (then over keys by the product)."""
  B, H, Q, _ = like_BHQK.shape
  return jnp.broadcast_to(gain_H[None, :, None], (B, H, Q))[..., None]


def _shape_softmax_jvp(has_skip, has_centre, primals, tangents):
  logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK = primals
  d_logits_BHQK, d_resid_H, d_skip_H, d_centre_H, _, _ = tangents
  shaped_BHQK, probs_BHQK = _shape_softmax_forward(
      logits_BHQK, resid_H, skip_H, centre_H, eye_QK, centre_QK, has_skip, has_centre)
  # Terms whose tangent is a symbolic zero (a constant gain, e.g. Pre-LN's) cost nothing.
  present = lambda tangent: not isinstance(tangent, SymbolicZero)
  d_probs_BHQK = jnp.zeros_like(probs_BHQK)
  if present(d_logits_BHQK):
    d_probs_BHQK = probs_BHQK * (
        d_logits_BHQK - jnp.sum(probs_BHQK * d_logits_BHQK, axis=-1, keepdims=True))
  d_shaped_BHQK = _per_head(resid_H) * d_probs_BHQK
  if present(d_resid_H):
    d_shaped_BHQK = d_shaped_BHQK + _per_row(d_resid_H, probs_BHQK) * probs_BHQK
  if has_skip and present(d_skip_H):
    d_shaped_BHQK = d_shaped_BHQK + _per_row(d_skip_H, probs_BHQK) * eye_QK
  if has_centre and present(d_centre_H):
    d_shaped_BHQK = d_shaped_BHQK - _per_row(d_centre_H, probs_BHQK) * centre_QK
  return (shaped_BHQK, probs_BHQK), (d_shaped_BHQK, d_probs_BHQK)


_shape_softmax.defjvp(_shape_softmax_jvp, symbolic_zeros=True)


# ------------------------------------------------------------------------------- fused

def segment_run_starts(segment_ids_BT):
  """Index of the first position of each position's contiguous segment run, [B, T]."""
  T = segment_ids_BT.shape[1]
  pos = jnp.arange(T)
  new_run = jnp.concatenate(
      [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]],
      axis=1)
  return jax.lax.cummax(jnp.where(new_run, pos, 0), axis=1)


def _gather_time(x_BT_, index_BT):
  """x[b, index[b, t], ...] for every (b, t)."""
  index = index_BT.reshape(index_BT.shape + (1,) * (x_BT_.ndim - 2))
  return jnp.take_along_axis(x_BT_, index, axis=1)


def centred_values(v_BKHD, *, causal: bool, num_queries: int, query_offset=0, key_mask=None,
                   segment_ids=None) -> jax.Array:
  """C v without forming C: [B, Tq, H, Dh], computed in float32 in O(T * H * Dh)."""
  B, T = v_BKHD.shape[:2]
  valid_BT = jnp.ones((B, T), jnp.float32) if key_mask is None else key_mask.astype(jnp.float32)
  v_BKHD = v_BKHD.astype(jnp.float32) * valid_BT[:, :, None, None]
  if causal:
    sum_BKHD = jnp.cumsum(v_BKHD, axis=1)
    count_BT = jnp.cumsum(valid_BT, axis=1)
    if segment_ids is not None:
      # Sum over the run so far = inclusive prefix at t - exclusive prefix at the run's start.
      starts_BT = segment_run_starts(segment_ids)
      sum_BKHD = sum_BKHD - _gather_time(sum_BKHD - v_BKHD, starts_BT)
      count_BT = count_BT - _gather_time(count_BT - valid_BT, starts_BT)
  else:
    seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    flat_ids = (jnp.arange(B)[:, None] * T + seg_BT).reshape(-1)   # one bucket per (row, segment)
    sums = jax.ops.segment_sum(v_BKHD.reshape(B * T, -1), flat_ids, num_segments=B * T)
    counts = jax.ops.segment_sum(valid_BT.reshape(-1), flat_ids, num_segments=B * T)
    sum_BKHD = sums[flat_ids].reshape(v_BKHD.shape)
    count_BT = counts[flat_ids].reshape(B, T)
  mean_BKHD = sum_BKHD / jnp.maximum(count_BT, 1.0)[:, :, None, None]
  return _take_queries(mean_BKHD, num_queries, query_offset)


def _fused(q, k, v, *, causal, key_mask, segment_ids, query_offset, resid_gain, skip_gain,
           centre_gain):
  Tq, Tk = q.shape[1], k.shape[1]
  simple_causal = (causal and key_mask is None and segment_ids is None and Tq == Tk
                   and jnp.ndim(query_offset) == 0)
  mask = None
  if not simple_causal and (causal or key_mask is not None or segment_ids is not None):
    mask = attention_mask(Tq, Tk, causal=causal, query_offset=query_offset, key_mask=key_mask,
                          segment_ids=segment_ids)
  attended_BQHD = attention_kernels.dot_product_attention(q, k, v, mask=mask,
                                                         is_causal=simple_causal)
  gain = lambda g: jnp.asarray(g, jnp.float32).reshape(-1, 1)   # [H] -> broadcast over [.., H, Dh]
  out_BQHD = gain(resid_gain) * attended_BQHD.astype(jnp.float32)
  if skip_gain is not None:
    out_BQHD = out_BQHD + gain(skip_gain) * _self_values(v, Tq, query_offset).astype(jnp.float32)
  if centre_gain is not None:
    out_BQHD = out_BQHD - gain(centre_gain) * centred_values(
        v, causal=causal, num_queries=Tq, query_offset=query_offset, key_mask=key_mask,
        segment_ids=segment_ids)
  return out_BQHD.astype(v.dtype)


# -------------------------------------------------------------------------------- public

def shaped_attention(q, k, v, *, resid_gain, skip_gain, centre_gain, causal: bool,
                     key_mask=None, segment_ids=None, query_offset=0, impl: Impl = "explicit",
                     logit_soft_cap=None, return_probs: bool = False):
  """Shaped attention `(resid * A + skip * I - centre * C) v`, [B, Tq, H, Dh].

  `skip_gain` / `centre_gain` None omit that term (plain attention). `key_mask` [B, Tk] is
  True on real tokens. With `return_probs` (explicit only) also returns the float32 softmax
  A [B, H, Tq, Tk] for diagnostics. Both impls agree to float32 round-off.
  """
  if impl == "explicit":
    mask = attention_mask(q.shape[1], k.shape[1], causal=causal, query_offset=query_offset,
                          key_mask=key_mask, segment_ids=segment_ids)
    out, probs = _explicit(q, k, v, mask, resid_gain, skip_gain, centre_gain, query_offset,
                           logit_soft_cap)
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
