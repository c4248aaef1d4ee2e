"""Cross-entropy of the tied head without ever holding the [tokens, V] logits.

    head = HeadSpec.from_config(config.model, config.dtype)     # None: the chunked loss is off
    ce_N = cross_entropy_N(hidden_ND, embedding_VD, targets_N, head)   # float32[N]

Each of `head.n_chunks` vocabulary chunks (the last padded with -inf logits) has its logits
[N, width] computed in the compute dtype, and float32 per-token statistics (log-sum-exp, the
target's logit) are kept, both from one pass over the chunk. The backward (a custom VJP)
needs the logits again: with `head.keep_logits` (`model.loss_keep_logits`, the default) the
forward keeps them, in the compute dtype ([N, V] at 2 bytes a logit in bfloat16: half of the
full float32 logits, and no second head matmul), and since every logit is held then, the
training forward and backward take the whole vocabulary as one chunk; without, a scan
recomputes them chunk by chunk, so that only one chunk's [N, width] is ever held (one head
matmul more: 4 per token instead of 3). Both give the same values and gradients to float32
round-off (only the order of summation differs). Chunking the vocabulary, not the tokens,
keeps the token axis sharded as the batch is. In float32 the value and gradients equal the
full-logits loss to rounding; in bfloat16 each chunk's logits are rounded first (the tests
bound it).
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
  pad_multiple: int = 1      # the head's matmul width is a multiple of it

  @classmethod
  def layout(cls, vocab_size: int, chunk_size: int, pad_multiple: int, dtype: str,
             keep_logits: bool = True):
    """Equal chunks of at most about `chunk_size` entries, each a multiple of `pad_multiple`."""
    n_chunks = max(1, math.ceil(vocab_size / chunk_size))
    width = pad_multiple * math.ceil(math.ceil(vocab_size / n_chunks) / pad_multiple)
    return cls(vocab_size, width, math.ceil(vocab_size / width), str(jnp.dtype(dtype)),
               keep_logits, pad_multiple)

  def whole(self) -> "HeadSpec":
    """The same head as one chunk: the whole (padded) vocabulary at once."""
    return dataclasses.replace(
        self, width=self.pad_multiple * math.ceil(self.vocab_size / self.pad_multiple),
        n_chunks=1)

  @classmethod
  def from_config(cls, model_config, dtype: str):
    """The spec of `model_config`; None when model.loss_vocab_chunk_size is 0 (full logits)
    or for nGPT (`model.ngpt`), whose head scales each logit by its own s_z: the loss then
    reads the model's logits. Configs saved before the fields existed get the defaults."""
    chunk_size = model_config.get("loss_vocab_chunk_size", DEFAULT_CHUNK)
    if not chunk_size or model_config.get("ngpt", False):
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


def _lse_and_picked_N(logits_NW, is_target_NW):
  """float32[N] log-sum-exp of each row of `logits_NW` (float32, -inf where padded) and the
  sum of its entries where `is_target_NW`, in one pass over the logits: a variadic reduction
  carrying (running max, sum of exp(x - running max), picked sum). `jax.nn.logsumexp` reads
  the [N, W] logits twice (a max, then a sum of exponentials), and the chunk is far larger
  than any cache: at the paper's shape that second read is 1.6 GB a step. The value is the
  same up to float32 round-off (the sum is rescaled as the max grows)."""
  def combine(a, b):
    (max_a, sum_a, picked_a), (max_b, sum_b, picked_b) = a, b
    a_larger = max_a >= max_b
    big, small = jnp.maximum(max_a, max_b), jnp.minimum(max_a, max_b)
    # exp(small - big), 0 when small is -inf (also when both are: -inf - -inf is nan).
    scale = jnp.exp(jnp.where(small == -jnp.inf, -jnp.inf, small - big))
    total = (jnp.where(a_larger, sum_a, sum_b)
             + jnp.where(a_larger, sum_b, sum_a) * scale)
    return big, total, picked_a + picked_b

  ones_NW = jnp.ones_like(logits_NW)
  picked_NW = jnp.where(is_target_NW, logits_NW, 0.0)
  zero = jnp.zeros((), jnp.float32)
  max_N, sum_N, picked_N = jax.lax.reduce(
      (logits_NW, ones_NW, picked_NW), (jnp.array(-jnp.inf, jnp.float32), zero, zero),
      combine, (1,))
  return max_N + jnp.log(sum_N), picked_N


def chunk_statistics(hidden_ND, embedding_VD, targets_N, head: HeadSpec,
                     with_argmax: bool = False) -> dict:
  """float32[N] "lse" (log-sum-exp of the logits) and "picked" (the target's logit), and with
  `with_argmax` int32[N] "argmax" (the first index of the largest logit), one chunk at a time."""
  hidden_ND = hidden_ND.astype(head.dtype)
  starts = jnp.arange(head.n_chunks) * head.width

  def one_chunk(_, xs):
    chunk_WD, start = xs
    logits_NW = _chunk_logits_NW(hidden_ND, chunk_WD, start, head)
    lse_N, picked_N = _lse_and_picked_N(logits_NW, _is_target_NW(targets_N, start, head))
    out = {"lse": lse_N, "picked": picked_N}
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
  """As `_forward`, over the whole vocabulary as one chunk, the logits kept in the compute
  dtype for the backward. The kept logits are all held anyway, and one [N, D] x [D, V] matmul
  each way leaves no per-chunk gradient to add up or concatenate: at the paper's shape on an
  H200 the chunks cost 0.15 ms of the step's roofline estimate, and on a v5e-8 7% of its bytes."""
  whole = head.whole()
  h_ND = hidden_ND.astype(whole.dtype)
  raw_NV = _raw_logits_NW(h_ND, _chunks_CWD(embedding_VD, whole)[0], whole)
  lse_N, picked_N = _lse_and_picked_N(_masked_NW(raw_NV, 0, whole),
                                      _is_target_NW(targets_N, 0, whole))
  return lse_N - picked_N, (hidden_ND, embedding_VD, targets_N, lse_N, raw_NV)


def _kept_backward(head, residuals, d_ce_N):
  hidden_ND, embedding_VD, targets_N, lse_N, raw_NV = residuals
  whole = head.whole()
  h_ND = hidden_ND.astype(whole.dtype)
  d_hidden_ND, d_table_VD = _chunk_backward(
      jnp.zeros(hidden_ND.shape, jnp.float32), _masked_NW(raw_NV, 0, whole),
      _chunks_CWD(embedding_VD, whole)[0], 0, h_ND, targets_N, lse_N, d_ce_N, whole)
  d_embedding_VD = d_table_VD[:whole.vocab_size]
  return (d_hidden_ND.astype(hidden_ND.dtype), d_embedding_VD.astype(embedding_VD.dtype), None)


_kept_cross_entropy_N.defvjp(_kept_forward, _kept_backward)
