"""Token cross-entropy losses, returned as *sums* so that batches, micro-batches and devices add.

    sums = loss_sums(logits_BTV, batch, kind="decoder")   # {"loss_sum", "weight_sum"}
    mean_loss = sums["loss_sum"] / sums["weight_sum"]

Decoder (causal LM): position t predicts `inputs[t + 1]`. With packed rows (`segment_ids`,
1.. per document, 0 padding) a prediction is scored only when the target is a real token of
the same document as the input, so nothing is learnt across a document boundary or on padding.
Encoder (MLM): position t predicts `targets[t]` with weight `weights[t]` (0 on unmasked tokens).
All arithmetic is float32 whatever the compute dtype of the logits.

`hidden_loss_sums` gives the same sums from the final hidden states and the tied embedding
through `chunked_loss` (the training and evaluation default), never holding the logits.
"""
import jax
import jax.numpy as jnp

from simplified_flax.training import chunked_loss


def cross_entropy_BT(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """float32[B, T]: -log softmax(logits)[target] at every position."""
  logits_BTV = logits_BTV.astype(jnp.float32)
  picked_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_BTV, axis=-1) - picked_BT


def next_token_weights_BT(segment_ids_BT: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
  """float32[B, T-1]: 1 where predicting token t+1 from token t is scored."""
  if segment_ids_BT is None:
    return jnp.ones((shape[0], shape[1] - 1), jnp.float32)
  same_doc = segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]
  real_target = segment_ids_BT[:, 1:] > 0
  return (same_doc & real_target).astype(jnp.float32)


def next_token_sums(logits_BTV: jax.Array, inputs_BT: jax.Array,
                    segment_ids_BT: jax.Array | None = None) -> dict[str, jax.Array]:
  """Summed next-token loss and the number of scored predictions (float32 scalars)."""
  ce_BT = cross_entropy_BT(logits_BTV[:, :-1], inputs_BT[:, 1:])
  weights_BT = next_token_weights_BT(segment_ids_BT, inputs_BT.shape)
  return {"loss_sum": jnp.sum(ce_BT * weights_BT), "weight_sum": jnp.sum(weights_BT)}


def mlm_sums(logits_BTV: jax.Array, targets_BT: jax.Array,
             weights_BT: jax.Array) -> dict[str, jax.Array]:
  """Summed masked-LM loss over the weighted (masked) positions and the sum of weights."""
  weights_BT = weights_BT.astype(jnp.float32)
  ce_BT = cross_entropy_BT(logits_BTV, targets_BT)
  return {"loss_sum": jnp.sum(ce_BT * weights_BT), "weight_sum": jnp.sum(weights_BT)}


def loss_sums(logits_BTV: jax.Array, batch: dict, kind: str) -> dict[str, jax.Array]:
  """The loss sums of `kind` ("decoder" or "encoder") for a batch of that kind."""
  if kind == "decoder":
    return next_token_sums(logits_BTV, batch["inputs"], batch.get("segment_ids"))
  if kind == "encoder":
    return mlm_sums(logits_BTV, batch["targets"], batch["weights"])
  raise ValueError(f"model.kind={kind!r} is unknown: use 'decoder' or 'encoder'.")


def targets_and_weights_BT(batch: dict, kind: str) -> tuple[jax.Array, jax.Array]:
  """(int targets [B, T], float32 weights [B, T]) of every position of a batch of `kind`; a
  decoder's last position has weight 0 (it has no next token), so all T positions line up
  with the model's T hidden states."""
  if kind == "decoder":
    inputs_BT = batch["inputs"]
    weights_BT = next_token_weights_BT(batch.get("segment_ids"), inputs_BT.shape)
    return (jnp.roll(inputs_BT, -1, axis=1),
            jnp.pad(weights_BT, ((0, 0), (0, 1))))
  if kind == "encoder":
    return batch["targets"], batch["weights"].astype(jnp.float32)
  raise ValueError(f"model.kind={kind!r} is unknown: use 'decoder' or 'encoder'.")


def hidden_loss_sums(hidden_BTD: jax.Array, embedding_VD: jax.Array, batch: dict, kind: str,
                     head: chunked_loss.HeadSpec, with_correct: bool = False
                     ) -> dict[str, jax.Array]:
  """`loss_sums` of the logits `hidden @ embedding^T`, computed chunk by chunk; with
  `with_correct` (evaluation: not differentiable) also "correct_sum", the weighted count of
  positions whose arg-max logit is the target (mlm_metrics.correct_sums)."""
  targets_BT, weights_BT = targets_and_weights_BT(batch, kind)
  B, T, D = hidden_BTD.shape
  hidden_ND, targets_N = hidden_BTD.reshape(B * T, D), targets_BT.reshape(B * T)
  weights_N = weights_BT.reshape(B * T)
  if not with_correct:
    ce_N = chunked_loss.cross_entropy_N(hidden_ND, embedding_VD, targets_N, head)
    return {"loss_sum": jnp.sum(ce_N * weights_N), "weight_sum": jnp.sum(weights_N)}
  stats = chunked_loss.chunk_statistics(hidden_ND, embedding_VD, targets_N, head,
                                        with_argmax=True)
  hit_N = (stats["argmax"] == targets_N).astype(jnp.float32)
  return {"loss_sum": jnp.sum((stats["lse"] - stats["picked"]) * weights_N),
          "weight_sum": jnp.sum(weights_N), "correct_sum": jnp.sum(hit_N * weights_N)}
