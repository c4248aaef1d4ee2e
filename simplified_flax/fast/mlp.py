"""The MLP's speed form (model/mlp.py's parameters and values): where its gain and its ReLU meet the
GEMMs. A block gain goes into W_proj on GPUs (`gain_in_kernel`), and at slope 0 the ReLU's
derivative goes inside the input-gradient GEMM (`fuses_relu`, the `relu_matmul` rule).
"""
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.fast import grad_rules
from simplified_flax.fast import layers as fast_layers
from simplified_flax.fast import relu_matmul_kernel
from simplified_flax.fast.plan import Plan
from simplified_flax.model import layers
from simplified_flax.model import quantize

# Where a block takes its MLP gain into W_proj (`MLP`'s `out_gain`): GPUs, where XLA otherwise
# writes a scaled copy of the block's gradient (-0.19 ms a step for SAS on an H200 at the
# paper's shape). On a v5e-8 the same change moved 12% more bytes for SAS-P (cost_analysis
# 28.4 -> 31.8 GB a chip), so elsewhere the block multiplies the MLP's output.
GAIN_IN_KERNEL_PLATFORMS = ("gpu",)


def gain_in_kernel(plan: Plan) -> bool:
  """Whether the block's MLP gain goes into W_proj on the plan's platform."""
  return plan.platform in GAIN_IN_KERNEL_PLATFORMS


class GainDense(nn.Module):
  """`gain * (x @ kernel)`, [.., D] -> [.., F], no bias: `layers.dense`'s layer (the same
  float32 `kernel` [D, F], computing in `dtype`) with a scalar gain, taken into its kernel
  where `gain_in_kernel` (GPUs: a gain on the output costs a scaled copy of the output's
  gradient in the backward, where this costs a product over the kernel), else on its output
  (the `out_gain` rule where it applies: its gradient from the input's, not the output)."""
  plan: Plan
  features: int
  dtype: Any = jnp.float32
  kernel_init: Callable = layers.normal_init(layers.PLAIN_STD)

  @nn.compact
  def __call__(self, x_ND, gain=None, relu_input: bool = False):
    """`relu_input`: x is the pre-activation, the product `relu(x) @ kernel` taken by
    `relu_matmul_kernel.relu_matmul` (the caller checks `fuses_relu`)."""
    plan = self.plan
    kernel_DF = self.param("kernel", self.kernel_init, (x_ND.shape[-1], self.features),
                           jnp.float32)
    if gain is not None and not gain_in_kernel(plan):
      x_ND, kernel_DF = quantize.operands(x_ND.astype(self.dtype), kernel_DF.astype(self.dtype))
      if plan.applies("out_gain"):
        return grad_rules.gained_matmul(gain, x_ND, kernel_DF)
      return gain * fast_layers.product(plan, x_ND, kernel_DF)
    if gain is not None:
      kernel_DF = gain * kernel_DF
    x_ND, kernel_DF = x_ND.astype(self.dtype), kernel_DF.astype(self.dtype)
    if relu_input:
      return relu_matmul_kernel.relu_matmul(x_ND, kernel_DF, interpret(plan))
    return fast_layers.matmul(plan, x_ND, kernel_DF)


def interpret(plan: Plan) -> bool:
  """Whether the GPU's Pallas kernels run interpreted: off a GPU, or where the plan says so."""
  return plan.interpret or plan.platform != "gpu"


class MLP(nn.Module):
  """`mlp.MLP` (the same parameters, c_fc and c_proj); with `out_gain` (a scalar), the result
  times it (`GainDense`)."""
  cfg: Any     # FrozenConfigDict: the model config
  plan: Plan
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, out_gain=None):
    m, D, plan = self.cfg, x_BTD.shape[-1], self.plan
    h_BTF = fast_layers.dense(plan, m.mlp_width_mult * D, self.dtype, "c_fc")(x_BTD)
    assert m.activation == "leaky_relu", m.activation   # verified values only (plan.py)
    relu_input = fuses_relu(plan, h_BTF, D, m.lrelu_neg_slope, out_gain)
    if not relu_input:
      h_BTF = (grad_rules.leaky_relu(h_BTF, m.lrelu_neg_slope) if plan.applies("relu")
               else jax.nn.leaky_relu(h_BTF, m.lrelu_neg_slope))
    return GainDense(plan, D, self.dtype, layers.kernel_init("normal", m.mlp_proj_init_std),
                     name="c_proj")(h_BTF, out_gain, relu_input=relu_input)


def fuses_relu(plan: Plan, h_BTF, features: int, negative_slope: float, out_gain) -> bool:
  """Whether the MLP's ReLU and c_proj run as `relu_matmul_kernel.relu_matmul` (the
  `relu_matmul` rule): slope 0, the gain (if any) inside the kernel, no fake quantisation
  (which rounds the activation itself), and shapes the kernel takes."""
  if not (negative_slope == 0 and plan.applies("relu_matmul")
          and (out_gain is None or gain_in_kernel(plan)) and not quantize.is_applied()):
    return False
  kernel_FD = jax.ShapeDtypeStruct((h_BTF.shape[-1], features), h_BTF.dtype)
  return relu_matmul_kernel.supported(h_BTF, kernel_FD, interpret=interpret(plan))
