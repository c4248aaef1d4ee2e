"""Rotary position embeddings (Su, Lu, Pan, Murtadha, Wen, Liu, "RoFormer", arXiv 2104.09864,
Eq. (34)), with `model.position_embedding="rope"` in place of the learned position table
(docs/model.md, "Positions"): each head's q and k rotated pairwise by their token's position,
so that q . k depends on positions only through their difference.

    (x_{2i}, x_{2i+1}) <- (x_{2i} cos a - x_{2i+1} sin a,  x_{2i} sin a + x_{2i+1} cos a),
    a = position * theta^(-2i / d),   i = 0 .. d/2 - 1

Pairs are adjacent entries, as RoFormer and nGPT's code pair them (the Hugging Face form pairs
entry i with i + d/2: the same rotation of permuted features, not the same parameters).
"""
import jax
import jax.numpy as jnp

from simplified_flax.model import masks

DEFAULT_THETA = 10_000.0   # RoFormer's base, the one most language models use
POSITION_EMBEDDINGS = ("learned", "rope")


def rotate(x_BTHd, positions_BT, theta: float = DEFAULT_THETA) -> jax.Array:
  """x [B, T, H, d] (d even) with each adjacent pair of entries of each head rotated by
  `positions_BT` [B, T] times its frequency; computed in float32, returned in x's dtype."""
  d = x_BTHd.shape[-1]
  inv_freq_f = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)     # [d/2]
  angle_BTf = positions_BT.astype(jnp.float32)[..., None] * inv_freq_f    # [B, T, d/2]
  cos_BT1f, sin_BT1f = jnp.cos(angle_BTf)[:, :, None], jnp.sin(angle_BTf)[:, :, None]
  x32 = x_BTHd.astype(jnp.float32)
  even_BTHf, odd_BTHf = x32[..., 0::2], x32[..., 1::2]
  rotated = jnp.stack([even_BTHf * cos_BT1f - odd_BTHf * sin_BT1f,
                       even_BTHf * sin_BT1f + odd_BTHf * cos_BT1f], axis=-1)
  return rotated.reshape(x_BTHd.shape).astype(x_BTHd.dtype)


def uses_rope(m) -> bool:
  """Whether `m` (a model config) rotates q and k; configs saved before the field: learned."""
  return m.get("position_embedding", "learned") == "rope"


def rotate_qk(m, q_BTHd, k_BTHd, *, cache_index=None, segment_ids=None):
  """(q, k) rotated by their tokens' positions (`masks.token_positions`: in the row, the
  packed segment, or after the cache) when `m` uses rotary embeddings; else unchanged."""
  if not uses_rope(m):
    return q_BTHd, k_BTHd
  B, T = q_BTHd.shape[:2]
  positions_BT = masks.token_positions(B, T, cache_index=cache_index, segment_ids=segment_ids)
  theta = float(m.get("rope_theta", DEFAULT_THETA))
  return rotate(q_BTHd, positions_BT, theta), rotate(k_BTHd, positions_BT, theta)
