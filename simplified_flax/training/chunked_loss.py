"""Cross-entropy of the tied head without ever holding the [tokens, V] logits.

    head = HeadSpec.from_config(config.model, config.dtype)     # None: the chunked loss is off
    ce_N = cross_entropy_N(hidden_ND, embedding_VD, targets_N, head)   # float32[N]

Each of `head.n_chunks` vocabulary chunks (the last padded with -inf logits) has its logits
[N, width] computed in the compute dtype, and float32 per-token statistics (log-sum-exp, the
target's logit) are kept. The backward (a custom VJP) needs each chunk's logits again: with
`head.keep_logits` (`model.loss_keep_logits`, the default) the forward keeps them, in the
compute dtype ([N, V] at 2 bytes a logit in bfloat16: half of the full float32 logits, and no
second head matmul); without, a scan recomputes them chunk by chunk, so that only one chunk's
[N, width] is ever held (one head matmul more: 4 per token instead of 3). Both give the same
values and gradients (the same operations in the same order). Chunking the vocabulary, not
the tokens, keeps the token axis sharded as the batch is. In float32 the value and gradients
equal the full-logits loss to rounding; in bfloat16 each chunk's logits are rounded first (the
tests bound it).
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
  keep_logits: bool = True   # the backward reads the forward's logits (else recomputes them)

  @classmethod
  def layout(cls, vocab_size: int, chunk_size: int, pad_multiple: int, dtype: str,
             keep_logits: bool = True):
    """Equal chunks of at most about `chunk_size` entries, each a multiple of `pad_multiple`."""
    n_chunks = max(1, math.ceil(vocab_size / chunk_size))
    width = pad_multiple * math.ceil(math.ceil(vocab_size / n_chunks) / pad_multiple)
    return cls(vocab_size, width, math.ceil(vocab_size / width), str(jnp.dtype(dtype)),
               keep_logits)

  @classmethod
  def from_config(cls, model_config, dtype: str):
    """The spec of `model_config`; None when model.loss_vocab_chunk_size is 0 (full logits).
    Configs saved before the fields existed get the defaults."""
    chunk_size = model_config.get("loss_vocab_chunk_size", DEFAULT_CHUNK)
    if not chunk_size:
      return None
    return cls.layout(model_config.vocab_size, chunk_size,
                      model_config.get("vocab_pad_multiple", 1), dtype,
                      model_config.get("loss_keep_logits", True))


def _chunks_CWD(embedding_VD: jax.Array, head: HeadSpec) -> jax.Array:
  """The embedding in the compute dtype, zero-padded and cut into [n_chunks, width, D]."""
  padding = head.n_chunks * head.width - head.vocab_size
  padded_VD = jnp.pad(embedding_VD.astype(head.dtype), ((0, padding), (0, 0)))
  return padded_VD.reshape(head.n_chunks, head.width, -1)


def _raw_logits_NW(hidden_ND, chunk_WD, head: HeadSpec) -> jax.Array:
  """One chunk's logits in the compute dtype, as the head's matmul gives them."""
  return jnp.einsum("nd,wd->nw", hidden_ND, chunk_WD, preferred_element_type=head.dtype)


def _chunk_logits_NW(hidden_ND, chunk_WD, start, head: HeadSpec) -> jax.Array:
  """float32 logits of one chunk (computed in the compute dtype); padded columns -inf."""
  return _masked_NW(_raw_logits_NW(hidden_ND, chunk_WD, head), start, head)


def _masked_NW(raw_NW, start, head: HeadSpec) -> jax.Array:
  """`raw_NW` in float32, its padded columns -inf."""
  logits_NW = raw_NW.astype(jnp.float32)
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


def cross_entropy_N(hidden_ND: jax.Array, embedding_VD: jax.Array, targets_N: jax.Array,
                    head: HeadSpec) -> jax.Array:
  """float32[N]: -log softmax(hidden @ embedding^T)[target] of each of N tokens; hidden [N, D]
  (any float dtype), embedding [V, D] (float32), targets int[N]. Differentiable in hidden and
  embedding; the gradients have their dtypes."""
  loss = _kept_cross_entropy_N if head.keep_logits else _recomputed_cross_entropy_N
  return loss(hidden_ND, embedding_VD, targets_N, head)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _recomputed_cross_entropy_N(hidden_ND, embedding_VD, targets_N, head):
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

  def one_chunk(d_hidden_ND, xs):
    chunk_WD, start = xs
    logits_NW = _chunk_logits_NW(h_ND, chunk_WD, start, head)
    return _chunk_backward(d_hidden_ND, logits_NW, chunk_WD, start, h_ND, targets_N, lse_N,
                           d_ce_N, head)

  d_hidden_ND, d_chunks_CWD = jax.lax.scan(
      one_chunk, jnp.zeros(hidden_ND.shape, jnp.float32),
      (_chunks_CWD(embedding_VD, head), starts))
  d_embedding_VD = d_chunks_CWD.reshape(-1, hidden_ND.shape[-1])[:head.vocab_size]
  return (d_hidden_ND.astype(hidden_ND.dtype), d_embedding_VD.astype(embedding_VD.dtype), None)


def _chunk_backward(d_hidden_ND, logits_NW, chunk_WD, start, h_ND, targets_N, lse_N, d_ce_N,
                    head):
  """d_hidden_ND plus this chunk's part, and the chunk's d embedding rows [W, D] (float32)."""
  probs_NW = jnp.exp(logits_NW - lse_N[:, None])
  onehot_NW = _is_target_NW(targets_N, start, head).astype(jnp.float32)
  d_logits_NW = ((probs_NW - onehot_NW) * d_ce_N.astype(jnp.float32)[:, None]).astype(head.dtype)
  d_hidden_ND = d_hidden_ND + jnp.dot(d_logits_NW, chunk_WD, preferred_element_type=jnp.float32)
  d_chunk_WD = jnp.einsum("nw,nd->wd", d_logits_NW, h_ND, preferred_element_type=jnp.float32)
  return d_hidden_ND, d_chunk_WD


_recomputed_cross_entropy_N.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kept_cross_entropy_N(hidden_ND, embedding_VD, targets_N, head):
  # Undifferentiated (an evaluation), nothing is kept: the scan holds one chunk at a time.
  return _forward(hidden_ND, embedding_VD, targets_N, head)[0]


def _kept_forward(hidden_ND, embedding_VD, targets_N, head):
  """As `_forward`, chunk after chunk unrolled (no scan: no stacked [chunks, N, W] buffer to
  write into), each chunk's logits kept in the compute dtype for the backward."""
  h_ND = hidden_ND.astype(head.dtype)
  chunks_CWD = _chunks_CWD(embedding_VD, head)
  raws_CNW, per_chunk = [], {"lse": [], "picked": []}
  for c in range(head.n_chunks):
    raws_CNW.append(_raw_logits_NW(h_ND, chunks_CWD[c], head))
    logits_NW = _masked_NW(raws_CNW[-1], c * head.width, head)
    per_chunk["lse"].append(jax.nn.logsumexp(logits_NW, axis=-1))
    per_chunk["picked"].append(jnp.sum(
        jnp.where(_is_target_NW(targets_N, c * head.width, head), logits_NW, 0.0), axis=-1))
  lse_N = jax.nn.logsumexp(jnp.stack(per_chunk["lse"]), axis=0)
  picked_N = jnp.sum(jnp.stack(per_chunk["picked"]), axis=0)
  return lse_N - picked_N, (hidden_ND, embedding_VD, targets_N, lse_N, raws_CNW)


def _kept_backward(head, residuals, d_ce_N):
  hidden_ND, embedding_VD, targets_N, lse_N, raws_CNW = residuals
  h_ND = hidden_ND.astype(head.dtype)
  chunks_CWD = _chunks_CWD(embedding_VD, head)
  d_hidden_ND, d_chunks = jnp.zeros(hidden_ND.shape, jnp.float32), []
  for c in range(head.n_chunks):
    start = c * head.width
    d_hidden_ND, d_chunk_WD = _chunk_backward(
        d_hidden_ND, _masked_NW(raws_CNW[c], start, head), chunks_CWD[c], start, h_ND,
        targets_N, lse_N, d_ce_N, head)
    d_chunks.append(d_chunk_WD)
  d_embedding_VD = jnp.concatenate(d_chunks)[:head.vocab_size]
  return (d_hidden_ND.astype(hidden_ND.dtype), d_embedding_VD.astype(embedding_VD.dtype), None)


_kept_cross_entropy_N.defvjp(_kept_forward, _kept_backward)
