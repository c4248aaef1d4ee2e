"""Cross-entropy of the tied head without ever holding the [tokens, V] logits.

    head = HeadSpec.from_config(config.model, config.dtype)     # None: the chunked loss is off
    ce_N = cross_entropy_N(hidden_ND, embedding_VD, targets_N, head)   # float32[N]

A scan over `head.n_chunks` vocabulary chunks (the last padded with -inf logits) computes each
chunk's logits [N, width] in the compute dtype and keeps float32 per-token statistics
(log-sum-exp, the target's logit); a custom VJP recomputes them chunk by chunk. Chunking the
vocabulary, not the tokens, keeps the token axis sharded as the batch is. In float32 the value
and gradients equal the full-logits loss to rounding; in bfloat16 each chunk's logits are
rounded first (the tests bound it).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

DEFAULT_CHUNK = 8192   # vocabulary entries per chunk; model.loss_vocab_chunk_size


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """How the chunked head cuts the vocabulary (hashable: static under jit)."""
  vocab_size: int
  width: int           # vocabulary entries per chunk, a multiple of `pad_multiple`
  n_chunks: int        # n_chunks * width >= vocab_size > (n_chunks - 1) * width
  dtype: str           # compute dtype of the logits ("float32", "bfloat16", ...)

  @classmethod
  def layout(cls, vocab_size: int, chunk_size: int, pad_multiple: int, dtype: str):
    """Equal chunks of at most about `chunk_size` entries, each a multiple of `pad_multiple`."""
    n_chunks = max(1, math.ceil(vocab_size / chunk_size))
    width = pad_multiple * math.ceil(math.ceil(vocab_size / n_chunks) / pad_multiple)
    return cls(vocab_size, width, math.ceil(vocab_size / width), str(jnp.dtype(dtype)))

  @classmethod
  def from_config(cls, model_config, dtype: str):
    """The spec of `model_config`; None when model.loss_vocab_chunk_size is 0 (full logits).
    Configs saved before the fields existed get the defaults."""
    chunk_size = model_config.get("loss_vocab_chunk_size", DEFAULT_CHUNK)
    if not chunk_size:
      return None
    return cls.layout(model_config.vocab_size, chunk_size,
                      model_config.get("vocab_pad_multiple", 1), dtype)


def _chunks_CWD(embedding_VD: jax.Array, head: HeadSpec) -> jax.Array:
  """The embedding in the compute dtype, zero-padded and cut into [n_chunks, width, D]."""
  padding = head.n_chunks * head.width - head.vocab_size
  padded_VD = jnp.pad(embedding_VD.astype(head.dtype), ((0, padding), (0, 0)))
  return padded_VD.reshape(head.n_chunks, head.width, -1)


def _chunk_logits_NW(hidden_ND, chunk_WD, start, head: HeadSpec) -> jax.Array:
  """float32 logits of one chunk (computed in the compute dtype); padded columns -inf."""
  logits_NW = jnp.einsum("nd,wd->nw", hidden_ND, chunk_WD,
                         preferred_element_type=head.dtype).astype(jnp.float32)
  if head.n_chunks * head.width == head.vocab_size:
    return logits_NW
  real_W = start + jnp.arange(head.width) < head.vocab_size
  return jnp.where(real_W, logits_NW, -jnp.inf)


def _is_target_NW(targets_N, start, head: HeadSpec) -> jax.Array:
  return targets_N[:, None] == start + jnp.arange(head.width)


def chunk_statistics(hidden_ND, embedding_VD, targets_N, head: HeadSpec,
                     with_argmax: bool = False) -> dict:
  """float32[N] "lse" (log-sum-exp of the logits) and "picked" (the target's logit), and with
  `with_argmax` int32[N] "argmax" (the first index of the largest logit), one chunk at a time."""
  hidden_ND = hidden_ND.astype(head.dtype)
  starts = jnp.arange(head.n_chunks) * head.width

  def one_chunk(_, xs):
    chunk_WD, start = xs
    logits_NW = _chunk_logits_NW(hidden_ND, chunk_WD, start, head)
    out = {"lse": jax.nn.logsumexp(logits_NW, axis=-1),
           "picked": jnp.sum(jnp.where(_is_target_NW(targets_N, start, head), logits_NW, 0.0),
                             axis=-1)}
    if with_argmax:
      out["max"] = jnp.max(logits_NW, axis=-1)
      out["argmax"] = start + jnp.argmax(logits_NW, axis=-1).astype(jnp.int32)
    return None, out

  _, per_chunk = jax.lax.scan(one_chunk, None, (_chunks_CWD(embedding_VD, head), starts))
  stats = {"lse": jax.nn.logsumexp(per_chunk["lse"], axis=0),
           "picked": jnp.sum(per_chunk["picked"], axis=0)}
  if with_argmax:   # the first chunk holding the largest logit: argmax's first-index rule
    best_N = jnp.argmax(per_chunk["max"], axis=0)
    stats["argmax"] = jnp.take_along_axis(per_chunk["argmax"], best_N[None], axis=0)[0]
  return stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def cross_entropy_N(hidden_ND: jax.Array, embedding_VD: jax.Array, targets_N: jax.Array,
                    head: HeadSpec) -> jax.Array:
  """float32[N]: -log softmax(hidden @ embedding^T)[target] of each of N tokens; hidden [N, D]
  (any float dtype), embedding [V, D] (float32), targets int[N]. Differentiable in hidden and
  embedding; the gradients have their dtypes."""
  return _forward(hidden_ND, embedding_VD, targets_N, head)[0]


def _forward(hidden_ND, embedding_VD, targets_N, head):
  stats = chunk_statistics(hidden_ND, embedding_VD, targets_N, head)
  return stats["lse"] - stats["picked"], (hidden_ND, embedding_VD, targets_N, stats["lse"])


def _backward(head, residuals, d_ce_N):
  """d ce / d logits = softmax - onehot(target), one chunk at a time (d hidden accumulated in
  float32; each chunk's rows of d embedding one scan output)."""
  hidden_ND, embedding_VD, targets_N, lse_N = residuals
  h_ND = hidden_ND.astype(head.dtype)
  starts = jnp.arange(head.n_chunks) * head.width
  d_ce_N = d_ce_N.astype(jnp.float32)

  def one_chunk(d_hidden_ND, xs):
    chunk_WD, start = xs
    probs_NW = jnp.exp(_chunk_logits_NW(h_ND, chunk_WD, start, head) - lse_N[:, None])
    onehot_NW = _is_target_NW(targets_N, start, head).astype(jnp.float32)
    d_logits_NW = ((probs_NW - onehot_NW) * d_ce_N[:, None]).astype(head.dtype)
    d_hidden_ND = d_hidden_ND + jnp.dot(d_logits_NW, chunk_WD,
                                        preferred_element_type=jnp.float32)
    d_chunk_WD = jnp.einsum("nw,nd->wd", d_logits_NW, h_ND, preferred_element_type=jnp.float32)
    return d_hidden_ND, d_chunk_WD

  d_hidden_ND, d_chunks_CWD = jax.lax.scan(
      one_chunk, jnp.zeros(hidden_ND.shape, jnp.float32),
      (_chunks_CWD(embedding_VD, head), starts))
  d_embedding_VD = d_chunks_CWD.reshape(-1, hidden_ND.shape[-1])[:head.vocab_size]
  return (d_hidden_ND.astype(hidden_ND.dtype), d_embedding_VD.astype(embedding_VD.dtype), None)


cross_entropy_N.defvjp(_forward, _backward)
