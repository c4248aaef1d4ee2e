"""Token cross-entropy losses, returned as *sums* so that batches, micro-batches and devices add.

    sums = loss_sums(logits_BTV, batch, kind="decoder")   # {"loss_sum", "weight_sum"}
    mean_loss = sums["loss_sum"] / sums["weight_sum"]

Decoder (causal LM): position t predicts `inputs[t + 1]`. With packed rows (`segment_ids`,
1.. per document, 0 padding) a prediction is scored only when the target is a real token of
the same document as the input, so nothing is learnt across a document boundary or on padding.
Encoder (MLM): position t predicts `targets[t]` with weight `weights[t]` (0 on unmasked tokens).
All arithmetic is float32 whatever the compute dtype of the logits.
"""
import jax
import jax.numpy as jnp


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
