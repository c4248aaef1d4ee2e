"""A sequence classifier / regressor on the pretrained encoder, for GLUE fine-tuning.

    model = Classifier(encoder=build_model(config.model), num_outputs=3, dropout_rate=0.1)
    outputs_BO = model.apply(variables, tokens_BT, key_mask=key_mask_BT, train=False)
    state = with_pretrained_encoder(state, restore_read_only(workdir, config).state)

The encoder is the MLM model itself (submodule "encoder", its pretraining tree), returning its
final hidden states. The head mean-pools them over the real tokens (`key_mask`), then pooler
Dense(D) + tanh, dropout, Dense(O): O = number of classes, or 1 for regression.
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import layers


def masked_mean_BD(x_BTD: jax.Array, key_mask_BT: jax.Array | None) -> jax.Array:
  """Mean over the real tokens of each row (all tokens without a mask), float32 [B, D]."""
  x_BTD = x_BTD.astype(jnp.float32)
  if key_mask_BT is None:
    return x_BTD.mean(axis=1)
  w_BT1 = key_mask_BT.astype(jnp.float32)[..., None]
  return (x_BTD * w_BT1).sum(axis=1) / jnp.maximum(w_BT1.sum(axis=1), 1.0)


class PooledHead(nn.Module):
  """[B, T, D] hidden states -> [B, O] float32 outputs (mean pool, pooler, dropout, out)."""
  num_outputs: int
  dropout_rate: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, key_mask_BT=None, *, train: bool = False):
    init = layers.normal_init(layers.PLAIN_STD)
    pooled_BD = masked_mean_BD(x_BTD, key_mask_BT).astype(self.dtype)
    h_BD = jnp.tanh(nn.Dense(x_BTD.shape[-1], dtype=self.dtype, kernel_init=init,
                             name="pooler")(pooled_BD))
    h_BD = nn.Dropout(self.dropout_rate, deterministic=not train)(h_BD)
    out_BO = nn.Dense(self.num_outputs, dtype=self.dtype, kernel_init=init, name="output")(h_BD)
    return out_BO.astype(jnp.float32)


class Classifier(nn.Module):
  """Encoder trunk + PooledHead; called like the encoder, returns [B, O] float32."""
  encoder: nn.Module           # transformer.Transformer with causal=False
  num_outputs: int
  dropout_rate: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens_BT, *, segment_ids=None, key_mask=None, train: bool = False):
    x_BTD = self.encoder(tokens_BT, segment_ids=segment_ids, key_mask=key_mask, train=train,
                         return_hidden=True)
    return PooledHead(self.num_outputs, self.dropout_rate, self.dtype, name="head")(
        x_BTD, key_mask, train=train)


def task_loss_B(outputs_BO: jax.Array, labels_B: jax.Array, regression: bool) -> jax.Array:
  """float32[B]: squared error (regression) or softmax cross-entropy (classification)."""
  if regression:
    return jnp.square(outputs_BO[:, 0] - labels_B.astype(jnp.float32))
  log_probs_BO = jax.nn.log_softmax(outputs_BO.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(log_probs_BO, labels_B.astype(jnp.int32)[:, None], axis=-1)[:, 0]


def predictions_B(outputs_BO: jax.Array, regression: bool) -> jax.Array:
  """The predicted score (regression) or class id (classification) of each row."""
  return outputs_BO[:, 0] if regression else jnp.argmax(outputs_BO, axis=-1)


def with_pretrained_encoder(state, pretrained):
  """`state` (of a Classifier) with the encoder's params and constants of `pretrained` (a
  pretraining run's state), and a fresh optimiser state."""
  params = {**state.params, "encoder": pretrained.params}
  constants = {name: {**tree, "encoder": pretrained.constants[name]}
               for name, tree in state.constants.items()}
  for new, old, what in ((params, state.params, "parameters"),
                         (constants, state.constants, "constants")):
    new_shapes = jax.tree.map(jnp.shape, new)
    if new_shapes != jax.tree.map(jnp.shape, old):
      raise ValueError(f"The pretrained encoder's {what} do not fit the classifier's encoder: "
                       f"fine-tune with the pretraining run's config.")
  return state.replace(params=params, constants=constants, opt_state=state.tx.init(params))
