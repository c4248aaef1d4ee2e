"""Shaped attention against a key/value cache, for incremental decoding (Eqs. (5) and (6)).

Row b holds its sequence at slots 0 .. index[b]-1; a chunk of new tokens is written from
index[b] on, its first `lengths[b]` real. The index advances past real tokens only (the next
chunk overwrites the padding) and a query at p sees keys 0..p: every token is computed as in
the full pass of its row alone, with no key mask. The fused form keeps C v as a running
float32 sum of the real values, O(H * d) per token. A cache: "keys" and "values" [B, H, Tmax,
d] (heads before time: [B, T, H, d] made XLA copy the cache at every step, half the decoding
speed), plus "value_sum" [B, H, d] (float32) when fused and centred.
"""
from typing import Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import attention
from simplified_flax.model import masks

Cache = Dict[str, jax.Array]


def cache_names(impl: str, centred: bool) -> Tuple[str, ...]:
  """The arrays one attention layer caches."""
  return ("keys", "values") + (("value_sum",) if impl == "fused" and centred else ())


def write(cache_BHKd, new_BQHd, index_B) -> jax.Array:
  """The cache with row b's `new` written at time slots index[b] .. index[b]+Tq-1."""
  B, Tq = new_BQHd.shape[:2]
  rows_BQ, slots_BQ = jnp.arange(B)[:, None], masks.query_positions(Tq, index_B)
  return cache_BHKd.at[rows_BQ, :, slots_BQ].set(new_BQHd.astype(cache_BHKd.dtype),
                                                  mode="drop")


def running_centred_values(sum_BHd, v_BQHd, index_B, lengths_B):
  """(C v at each new query, float32 [B, Q, H, d] (Eq. (6), causal C); the running sum after
  the real tokens), from `sum_BHd`, the sum of the row's values at positions 0 .. index[b]-1."""
  Tq = v_BQHd.shape[1]
  v_BQHd = v_BQHd.astype(jnp.float32)
  inclusive_BQHd = sum_BHd[:, None] + jnp.cumsum(v_BQHd, axis=1)
  count_BQ = masks.query_positions(Tq, index_B) + 1   # the query at p averages p+1 values
  mean_BQHd = inclusive_BQHd / count_BQ[:, :, None, None].astype(jnp.float32)
  real_BQ = jnp.arange(Tq) < lengths_B[:, None]
  new_sum_BHd = sum_BHd + jnp.sum(jnp.where(real_BQ[:, :, None, None], v_BQHd, 0.0), axis=1)
  return mean_BQHd, new_sum_BHd


def cached_shaped_attention(q_BQHd, k_BQHd, v_BQHd, cache: Cache, index_B, lengths_B, *,
                            resid_gain, skip_gain, centre_gain, impl: attention.Impl,
                            logit_soft_cap=None) -> Tuple[jax.Array, Cache]:
  """(out [B, Q, H, d], new cache): causal shaped attention of Tq new tokens per row against
  the cache, at every real token what `attention.shaped_attention` gives in the full sequence
  of its row (to float32 round-off). Gains as there."""
  new = dict(cache, keys=write(cache["keys"], k_BQHd, index_B),
             values=write(cache["values"], v_BQHd, index_B))
  # Views in the attention layout; XLA folds the transposes into the matrix products.
  k_BKHd, v_BKHd = (jnp.swapaxes(new[name], 1, 2) for name in ("keys", "values"))
  if impl != "fused" or centre_gain is None:
    out_BQHd = attention.shaped_attention(
        q_BQHd, k_BKHd, v_BKHd, resid_gain=resid_gain, skip_gain=skip_gain,
        centre_gain=centre_gain, causal=True, query_offset=index_B, impl=impl,
        logit_soft_cap=logit_soft_cap)
    return out_BQHd, new

  # Fused and centred: C v from the running sum; the identity term takes the new values as
  # they are (gathering them from the cache view would make XLA transpose the whole cache).
  attended_BQHd = attention.shaped_attention(   # A v (a gain of 1 is exact)
      q_BQHd, k_BKHd, v_BKHd, resid_gain=1.0, skip_gain=None, centre_gain=None, causal=True,
      query_offset=index_B, impl="fused")
  mean_BQHd, new["value_sum"] = running_centred_values(cache["value_sum"], v_BQHd, index_B,
                                                       lengths_B)
  terms = [] if skip_gain is None else [(skip_gain, v_BQHd)]
  terms.append((centre_gain, -mean_BQHd))
  return attention.combine_fused_terms(attended_BQHd, resid_gain, terms), new


def attend(module: nn.Module, q_BTHd, k_BTHd, v_BTHd, attn_args, impl, *, index_B, lengths_B):
  """`cached_shaped_attention` against `module`'s "cache" collection (an attention sub-block's),
  which it updates with the new keys and values (not while initialising)."""
  B, T, H, d = k_BTHd.shape
  shape = (B, H, T, d)   # [B, H, Tmax, d]: created by the init call, whose T is Tmax
  templates = {"keys": (shape, k_BTHd.dtype), "values": (shape, v_BTHd.dtype),
               "value_sum": ((B, H, d), jnp.float32)}
  centred = attn_args["centre_gain"] is not None
  cache = {name: module.variable("cache", name, jnp.zeros, *templates[name])
           for name in cache_names(impl, centred)}
  out_BTHd, new = cached_shaped_attention(
      q_BTHd, k_BTHd, v_BTHd, {name: var.value for name, var in cache.items()}, index_B,
      lengths_B, **attn_args, impl=impl)
  if not module.is_initializing():
    for name, var in cache.items():
      var.value = new[name]
  return out_BTHd


def advance_index(module: nn.Module, B: int, T: int, lengths) -> Tuple[jax.Array, jax.Array]:
  """(cache index [B] where this chunk of T tokens starts, lengths [B], default T), from
  `module`'s "cache" collection (the model's), whose index moves past the chunk's real tokens."""
  index = module.variable("cache", "index", jnp.zeros, (B,), jnp.int32)
  lengths_B = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  start_B = index.value
  if not module.is_initializing():
    index.value = start_B + lengths_B
  return start_B, lengths_B
