"""Token cross-entropy losses as *sums*, so that batches, micro-batches and devices add.

    sums = loss_sums(logits_BTV, batch, kind="decoder")   # {"loss_sum", "weight_sum"}
    mean_loss = sums["loss_sum"] / sums["weight_sum"]

Decoder (causal LM): position t predicts `inputs[t + 1]`, scored only when the target is a real
token of the input's document (packed rows: `segment_ids` 1.. per document, 0 padding).
Encoder (MLM): position t predicts `targets[t]` with weight `weights[t]` (0 on unmasked tokens).
"correct_sum" (`with_correct`) counts weighted positions whose arg-max is the target. All float32.
`hidden_loss_sums` gives the same sums from the final hidden states through `chunked_loss`.
"""
import functools

import jax
import jax.numpy as jnp

from simplified_flax.fast import layers as fast_layers
from simplified_flax.training import chunked_loss


def cross_entropy_BT(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """float32[B, T]: -log softmax(logits)[target] at every position."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BTV, axis=-1) - picked_BT


def targets_and_weights_BT(batch: dict, kind: str) -> tuple[jax.Array, jax.Array]:
  """(int targets [B, T], float32 weights [B, T]) of a batch of `kind`; a decoder's last
  position has weight 0 (no next token)."""
  if kind == "decoder":
    inputs_BT, segment_ids_BT = batch["inputs"], batch.get("segment_ids")
    if segment_ids_BT is None:
      weights_BT = jnp.ones((inputs_BT.shape[0], inputs_BT.shape[1] - 1), jnp.float32)
    else:   # the target is a real token of the input's document
      weights_BT = ((segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1])
                    & (segment_ids_BT[:, 1:] > 0)).astype(jnp.float32)
    return jnp.roll(inputs_BT, -1, axis=1), jnp.pad(weights_BT, ((0, 0), (0, 1)))
  if kind == "encoder":
    return batch["targets"], batch["weights"].astype(jnp.float32)
  raise ValueError(f"model.kind={kind!r} is unknown: use 'decoder' or 'encoder'.")


def _sums(ce, weights, targets, argmax=None) -> dict[str, jax.Array]:
  sums = {"loss_sum": jnp.sum(ce * weights), "weight_sum": jnp.sum(weights)}
  if argmax is not None:
    sums["correct_sum"] = jnp.sum((argmax == targets).astype(jnp.float32) * weights)
  return sums


def loss_sums(logits_BTV: jax.Array, batch: dict, kind: str,
              with_correct: bool = False) -> dict[str, jax.Array]:
  """{"loss_sum", "weight_sum"} (+ "correct_sum") of `kind` ("decoder" or "encoder")."""
  targets_BT, weights_BT = targets_and_weights_BT(batch, kind)
  argmax_BT = jnp.argmax(logits_BTV, axis=-1) if with_correct else None
  return _sums(cross_entropy_BT(logits_BTV, targets_BT), weights_BT, targets_BT, argmax_BT)


def hidden_loss_sums(hidden_BTD: jax.Array, embedding_VD: jax.Array, batch: dict, kind: str,
                     head: chunked_loss.HeadSpec, with_correct: bool = False,
                     table_copies: fast_layers.TableCopies | None = None) -> dict[str, jax.Array]:
  """`loss_sums` of the logits `hidden @ embedding^T`, computed chunk by chunk
  (`with_correct` is for evaluation: it is not differentiable). With `table_copies` (of
  `embedding_VD`, fast_layers.table_copies), each device's tokens against its copy: the same
  values, and the gradient through the copies (why: `fast_layers.table_copies`)."""
  targets_BT, weights_BT = targets_and_weights_BT(batch, kind)
  B, T, D = hidden_BTD.shape
  hidden_ND, targets_N = hidden_BTD.reshape(B * T, D), targets_BT.reshape(B * T)
  weights_N = weights_BT.reshape(B * T)
  if not with_correct:
    cross_entropy_N = functools.partial(chunked_loss.cross_entropy_N, head=head)
    if table_copies is None:
      ce_N = cross_entropy_N(hidden_ND, embedding_VD, targets_N)
    else:   # row b * T + t of hidden_ND is batch row b's: split as the batch is
      ce_N = table_copies.map(lambda table_VD, h_ND, t_N: cross_entropy_N(h_ND, table_VD, t_N),
                              hidden_ND, targets_N)
    return _sums(ce_N, weights_N, targets_N)
  stats = chunked_loss.chunk_statistics(hidden_ND, embedding_VD, targets_N, head,
                                        with_argmax=True)
  return _sums(stats["lse"] - stats["picked"], weights_N, targets_N, stats["argmax"])


def mlm_accuracy(sums: dict) -> float:
  """correct_sum / weight_sum of summed eval metrics (0 when nothing was scored)."""
  weight = float(sums["weight_sum"])
  return float(sums["correct_sum"]) / weight if weight > 0 else 0.0
