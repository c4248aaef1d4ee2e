"""Generation with a key/value cache: prefill, one-token steps, sampling filters, the loop.

    model = transformer.build_model(config.model)
    prompts_BT, lengths_B = decode.pad_prompts([tok.encode(p) for p in texts], tok.pad_id)
    out = decode.generate(model, variables, prompts_BT, lengths_B, jax.random.key(0),
                          max_new_tokens=64, sampling=decode.Sampling(temperature=0.8, top_p=0.95),
                          eod_id=tok.eod_id)
    continuation_b = out.tokens[b, :out.num_tokens[b]]

Prompts are right-padded (row b in slots 0 .. lengths[b]-1; kv_cache.py). `generate` is one
jitted prefill and a `lax.while_loop` of one-token steps, compiled once per prompt shape,
`max_new_tokens`, `Sampling` and `eod_id`.
"""
import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a token is drawn from the next-token logits (static under jit)."""
  temperature: float = 1.0   # 0: greedy (argmax); otherwise logits / temperature
  top_k: int = 0             # keep the k most likely tokens; 0: all
  top_p: float = 1.0         # keep the smallest set whose probability reaches p; 1: all

  def __post_init__(self):
    if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"Bad sampling settings {self}: need temperature >= 0, top_k >= 0 and "
                       "0 < top_p <= 1.")


class Generation(NamedTuple):
  tokens: jax.Array       # int32 [B, N]: new tokens; after a row's eod (kept) only pad_id
  num_tokens: jax.Array   # int32 [B]: tokens each row generated, its eod included


def init_cache(model, batch_size: int, max_length: int):
  """A zero cache for `batch_size` rows of up to `max_length` tokens (prompt + generated)."""
  shapes = jax.eval_shape(functools.partial(model.init, decode=True), jax.random.key(0),
                          jnp.zeros((batch_size, max_length), jnp.int32))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def apply_cached(model, variables, cache, tokens_BT, lengths_B=None):
  """(logits [B, T, V], new cache): T tokens per row appended at each row's cache index."""
  logits_BTV, state = model.apply({**variables, "cache": cache}, tokens_BT, decode=True,
                                  lengths=lengths_B, mutable=["cache"])
  return logits_BTV, state["cache"]


def top_k_filter(logits_BV, k: int) -> jax.Array:
  """-inf below each row's k-th largest logit (ties with it are kept)."""
  kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
  return jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)


def top_p_filter(logits_BV, p: float) -> jax.Array:
  """-inf outside the smallest most-likely set of probability >= p (nucleus; top-1 kept)."""
  sorted_BV = -jnp.sort(-logits_BV, axis=-1)
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_B1 = jnp.sum(mass_before_BV < p, axis=-1, keepdims=True)   # >= 1: mass before top is 0
  threshold_B1 = jnp.take_along_axis(sorted_BV, keep_B1 - 1, axis=-1)
  return jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)


def sample(rng, logits_BV, sampling: Sampling) -> jax.Array:
  """int32 [B] next tokens: argmax at temperature 0, else a draw from the filtered softmax."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
  if sampling.top_k:
    logits_BV = top_k_filter(logits_BV, min(sampling.top_k, logits_BV.shape[-1]))
  if sampling.top_p < 1:
    logits_BV = top_p_filter(logits_BV, sampling.top_p)
  return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "sampling", "eod_id",
                                             "pad_id"))
def generate(model, variables, prompts_BT, lengths_B, rng, *, max_new_tokens: int,
             sampling: Sampling = Sampling(), eod_id: Optional[int] = None,
             pad_id: int = 0) -> Generation:
  """Continues each right-padded prompt (`lengths_B` >= 1 tokens) by up to `max_new_tokens`
  tokens; a row stops after it emits `eod_id` (None: never). Token t is drawn with
  `fold_in(rng, t)`, so a seed fixes the output."""
  B, T = prompts_BT.shape
  max_length = T + max_new_tokens - 1   # the last token is sampled, never fed back
  if max_length > model.cfg.max_position_embeddings:
    raise ValueError(f"Prompt length {T} + max_new_tokens {max_new_tokens} - 1 exceeds "
                     f"model.max_position_embeddings={model.cfg.max_position_embeddings}.")
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  is_eod = (lambda tok_B: tok_B == eod_id) if eod_id is not None else (
      lambda tok_B: jnp.zeros_like(tok_B, bool))

  logits_BTV, cache = apply_cached(model, variables, init_cache(model, B, max_length),
                                   prompts_BT, lengths_B)
  # The logits after each row's last prompt token.
  logits_BV = jnp.take_along_axis(logits_BTV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  first_B = sample(jax.random.fold_in(rng, 0), logits_BV, sampling)
  tokens_BN = jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_B)
  state = (jnp.int32(1), cache, tokens_BN, is_eod(first_B), jnp.ones((B,), jnp.int32))

  def not_finished(state):
    t, _, _, done_B, _ = state
    return (t < max_new_tokens) & ~jnp.all(done_B)

  def next_token(state):
    t, cache, tokens_BN, done_B, count_B = state
    logits_B1V, cache = apply_cached(model, variables, cache, tokens_BN[:, t - 1, None])
    logits_BV = logits_B1V[:, 0]
    tok_B = jnp.where(done_B, pad_id, sample(jax.random.fold_in(rng, t), logits_BV, sampling))
    tokens_BN = jax.lax.dynamic_update_index_in_dim(tokens_BN, tok_B, t, axis=1)
    return (t + 1, cache, tokens_BN, done_B | is_eod(tok_B), count_B + ~done_B)

  _, _, tokens_BN, _, count_B = jax.lax.while_loop(not_finished, next_token, state)
  return Generation(tokens_BN, count_B)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0,
                multiple: int = 1) -> Tuple[np.ndarray, np.ndarray]:
  """(int32 [B, T] right-padded prompts, int32 [B] lengths); T rounds up to `multiple` (prompts
  of nearby lengths share one compilation)."""
  lengths_B = np.array([len(p) for p in prompts], np.int32)
  if lengths_B.min(initial=1) < 1 or not len(prompts):
    raise ValueError("Every prompt needs at least one token.")
  T = -(-int(lengths_B.max()) // multiple) * multiple
  prompts_BT = np.full((len(prompts), T), pad_id, np.int32)
  for b, p in enumerate(prompts):
    prompts_BT[b, :len(p)] = p
  return prompts_BT, lengths_B
