"""The block's MLP, `act(x @ W_fc) @ W_proj` (docs/model.md, "MLP")."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import layers


def activation(h, m) -> jax.Array:
  """The MLP's activation `m.activation`: leaky ReLU of slope `m.lrelu_neg_slope` (0: ReLU,
  derivative 1 at 0 as the authors' `torch.where(x >= 0, x, 0 * x)`), or exact GELU."""
  if m.activation == "gelu":
    return jax.nn.gelu(h, approximate=False)
  assert m.activation == "leaky_relu", m.activation
  return jax.nn.leaky_relu(h, m.lrelu_neg_slope)


class MLP(nn.Module):
  """`act(x @ W_fc) @ W_proj`, [B, T, D] -> [B, T, D], both without bias, N(0, 0.02) (W_proj:
  N(0, mlp_proj_init_std)), W_fc [D, F] with F = mlp_width_mult * D."""
  cfg: Any     # FrozenConfigDict: the model config
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD):
    m, D = self.cfg, x_BTD.shape[-1]
    h_BTF = layers.dense(m.mlp_width_mult * D, self.dtype, "c_fc")(x_BTD)
    return layers.dense(D, self.dtype, "c_proj",
                        layers.kernel_init("normal", m.mlp_proj_init_std))(activation(h_BTF, m))
