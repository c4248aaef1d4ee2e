"""Which keys each query may see, and picking rows by position (used by attention.py). Queries
sit at positions `query_offset .. query_offset + Q - 1` of the keys (a [B] offset: one per row,
as in a KV cache); packed `segment_ids` [B, K] are contiguous runs.
"""
import jax
import jax.numpy as jnp


def query_positions(num_queries: int, query_offset=0) -> jax.Array:
  """Absolute position of each query in the key sequence: [Q], or [B, Q] for a [B] offset."""
  return jnp.arange(num_queries) + jnp.asarray(query_offset)[..., None]


def token_positions(batch: int, num_tokens: int, *, cache_index=None,
                    segment_ids=None) -> jax.Array:
  """Each token's position [B, T] (what learned positions and rotary embeddings read): after
  the row's `cache_index` [B] when decoding, else inside its contiguous segment of packed
  `segment_ids` [B, T], else 0 .. T-1."""
  if cache_index is not None:
    return query_positions(num_tokens, cache_index)
  if segment_ids is None:
    return jnp.broadcast_to(jnp.arange(num_tokens), (batch, num_tokens))
  return jnp.arange(num_tokens) - segment_run_starts(segment_ids)


def attention_mask(num_queries: int, num_keys: int, *, causal: bool, query_offset=0,
                   key_mask=None, segment_ids=None) -> jax.Array:
  """Boolean [B or 1, 1, Q, K]: True where query i may attend to key j."""
  k_pos = jnp.arange(num_keys)
  mask_BHQK = jnp.ones((1, 1, num_queries, num_keys), bool)
  if causal:
    causal_QK = k_pos <= query_positions(num_queries, query_offset)[..., None]   # or [B, Q, K]
    mask_BHQK = mask_BHQK & causal_QK[..., None, :, :]
  if key_mask is not None:
    mask_BHQK = mask_BHQK & key_mask[:, None, None, :]
  if segment_ids is not None:
    q_seg_BQ = take_queries(segment_ids, num_queries, query_offset)
    mask_BHQK = mask_BHQK & (q_seg_BQ[:, None, :, None] == segment_ids[:, None, None, :])
  return mask_BHQK


def segment_run_starts(segment_ids_BT):
  """Index of the first position of each position's contiguous segment run, [B, T]."""
  new_run = jnp.concatenate(
      [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]],
      axis=1)
  return jax.lax.cummax(jnp.where(new_run, jnp.arange(segment_ids_BT.shape[1]), 0), axis=1)


def gather_time(x_BT_, index_BT):
  """x[b, index[b, t], ...] for every (b, t)."""
  index = index_BT.reshape(index_BT.shape + (1,) * (x_BT_.ndim - 2))
  return jnp.take_along_axis(x_BT_, index, axis=1)


def take_queries(x_BK_, num_queries: int, query_offset):
  """Rows of x [B, K, ...] at the query positions, [B, Q, ...]."""
  if jnp.ndim(query_offset) == 0:
    return jax.lax.dynamic_slice_in_dim(x_BK_, query_offset, num_queries, axis=1)
  return gather_time(x_BK_, query_positions(num_queries, query_offset))   # one offset per row
