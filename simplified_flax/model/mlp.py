"""The block's MLP, `act(x @ W_fc) @ W_proj` (docs/model.md), and where its gain and its ReLU
meet the GEMMs: a block gain goes into W_proj on GPUs (`gain_in_kernel`), and at slope 0 the
ReLU's derivative goes inside the input-gradient GEMM (`fuses_relu`, the `relu_matmul` rule).
"""
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import grad_rules
from simplified_flax.model import layers
from simplified_flax.model import quantize
from simplified_flax.model import relu_matmul_kernel
from simplified_flax.model import target_platform

# Where a block takes its MLP gain into W_proj (`MLP`'s `out_gain`): GPUs, where XLA otherwise
# writes a scaled copy of the block's gradient (-0.19 ms a step for SAS on an H200 at the
# paper's shape). On a v5e-8 the same change moved 12% more bytes for SAS-P (cost_analysis
# 28.4 -> 31.8 GB a chip), so elsewhere the block multiplies the MLP's output.
GAIN_IN_KERNEL_PLATFORMS = ("gpu",)


def gain_in_kernel() -> bool:
  """Whether the block's MLP gain goes into W_proj on the platform compiled for."""
  return target_platform.current() in GAIN_IN_KERNEL_PLATFORMS


class GainDense(nn.Module):
  """`gain * (x @ kernel)`, [.., D] -> [.., F], no bias: `layers.dense`'s layer (the same
  float32 `kernel` [D, F], computing in `dtype`) with a scalar gain, taken into its kernel
  where `gain_in_kernel()` (GPUs: a gain on the output costs a scaled copy of the output's
  gradient in the backward, where this costs a product over the kernel), else on its output
  (`grad_rules.gained_matmul`: on TPUs its gradient from the input's, not the output)."""
  features: int
  dtype: Any = jnp.float32
  kernel_init: Callable = layers.normal_init(layers.PLAIN_STD)

  @nn.compact
  def __call__(self, x_ND, gain=None, relu_input: bool = False):
    """`relu_input`: x is the pre-activation, the product `relu(x) @ kernel` taken by
    `relu_matmul_kernel.relu_matmul` (the caller checks `fuses_relu`)."""
    kernel_DF = self.param("kernel", self.kernel_init, (x_ND.shape[-1], self.features),
                           jnp.float32)
    if gain is not None and not gain_in_kernel():
      return grad_rules.gained_matmul(
          gain, *quantize.operands(x_ND.astype(self.dtype), kernel_DF.astype(self.dtype)))
    if gain is not None:
      kernel_DF = gain * kernel_DF
    x_ND, kernel_DF = x_ND.astype(self.dtype), kernel_DF.astype(self.dtype)
    if relu_input:
      return relu_matmul_kernel.relu_matmul(x_ND, kernel_DF, target_platform.current() != "gpu")
    return layers.matmul(x_ND, kernel_DF)


class MLP(nn.Module):
  """`act(x @ W_fc) @ W_proj`, both without bias, N(0, 0.02) (W_proj: N(0, mlp_proj_init_std)),
  F = mlp_width_mult * D; with `out_gain` (a scalar), the result times it (`GainDense`)."""
  cfg: Any     # FrozenConfigDict: the model config
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, out_gain=None):
    m, D = self.cfg, x_BTD.shape[-1]
    h_BTF = layers.dense(m.mlp_width_mult * D, self.dtype, "c_fc")(x_BTD)
    assert m.activation in ("gelu", "leaky_relu"), m.activation
    relu_input = m.activation == "leaky_relu" and fuses_relu(h_BTF, D, m.lrelu_neg_slope,
                                                               out_gain)
    if m.activation == "gelu":
      h_BTF = jax.nn.gelu(h_BTF, approximate=False)
    elif not relu_input:
      h_BTF = grad_rules.leaky_relu(h_BTF, m.lrelu_neg_slope)   # fusable at slope 0
    return GainDense(D, self.dtype, layers.kernel_init("normal", m.mlp_proj_init_std),
                     name="c_proj")(h_BTF, out_gain, relu_input=relu_input)


def fuses_relu(h_BTF, features: int, negative_slope: float, out_gain) -> bool:
  """Whether the MLP's ReLU and c_proj run as `relu_matmul_kernel.relu_matmul` (the
  `relu_matmul` rule): slope 0, the gain (if any) inside the kernel, no fake quantisation
  (which rounds the activation itself), and shapes the kernel takes."""
  if not (negative_slope == 0 and grad_rules.enabled("relu_matmul")
          and (out_gain is None or gain_in_kernel()) and not quantize.is_applied()):
    return False
  kernel_FD = jax.ShapeDtypeStruct((h_BTF.shape[-1], features), h_BTF.dtype)
  return relu_matmul_kernel.supported(h_BTF, kernel_FD,
                                      interpret=target_platform.current() != "gpu")
