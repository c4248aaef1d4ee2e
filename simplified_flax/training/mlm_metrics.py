"""Masked-LM accuracy as a sum, so that batches, micro-batches and devices add (like losses.py).

    sums = correct_sums(logits_BTV, batch)          # {"correct_sum"}
    mlm_accuracy = sums["correct_sum"] / loss_sums["weight_sum"]

A masked position is correct when the arg-max of its logits is the original token; positions
are weighted by `batch["weights"]` (1 where a token was selected for masking, else 0), the
same weights the MLM loss uses, so accuracy and loss are over the same tokens.
"""
import jax
import jax.numpy as jnp


def correct_sums(logits_BTV: jax.Array, batch: dict) -> dict[str, jax.Array]:
  """{"correct_sum": float32[]}: weighted count of masked positions predicted exactly."""
  hit_BT = (jnp.argmax(logits_BTV, axis=-1) == batch["targets"]).astype(jnp.float32)
  return {"correct_sum": jnp.sum(hit_BT * batch["weights"].astype(jnp.float32))}


def mlm_accuracy(sums: dict) -> float:
  """correct_sum / weight_sum of summed eval metrics (0 when nothing was scored)."""
  weight = float(sums["weight_sum"])
  return float(sums["correct_sum"]) / weight if weight > 0 else 0.0
