"""Parts of the block (docs/model.md): norms, gains and the linear layers. A gain whose trainable
flag is off is a constant, never in the parameter tree.
"""
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import quantize

NORM_TYPES = ("ln", "rmsnorm", "dyt", "derf", "none")
NORM_POSITIONS = ("pre", "post", "peri")   # where a block's norms sit (model/block.py)
INIT_TYPES = ("normal", "orth", "id")
ACTIVATIONS = ("leaky_relu", "gelu")
PLAIN_STD = 0.02   # N(0, 0.02): every plain weight (GPT-2), no depth rescaling
DYT_ALPHA_INIT = 0.5   # DyT's alpha_0 (Zhu et al. 2025, Sec. 4: 0.5 for every non-LLM model);
                       # configs set it per norm (model.alpha_init_{attn,mlp,final}_norm)


def gain(module: nn.Module, name: str, value: float, trainable: bool, shape=()) -> jax.Array:
  """A gain initialised to `value`: a parameter named `name` if trainable, else a constant."""
  if trainable:
    return module.param(name, nn.initializers.constant(value), shape, jnp.float32)
  return jnp.full(shape, value, jnp.float32)


class RMSNorm(nn.Module):
  """`scale * x / (sqrt(mean(x^2)) + eps)` over the last axis (eps outside the root), in `dtype`."""
  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    return rms_norm(x, scale, self.eps, self.dtype)


def rms_norm(x, scale, eps: float, dtype) -> jax.Array:
  """RMSNorm of x [..., D] with scale [D], computed in float32, returned in `dtype`."""
  x32 = x.astype(jnp.float32)
  rms = jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True))
  return (scale * x32 / (rms + eps)).astype(dtype)


class DyT(nn.Module):
  """Dynamic Tanh (Zhu, Chen, He, LeCun, Liu, "Transformers without Normalization", CVPR 2025,
  Eq. (1)): `gamma * tanh(alpha * x) + beta` over the last axis, in place of a norm; alpha a
  learnable scalar initialised to `alpha_init`, gamma [D] ones, beta [D] zeros."""
  alpha_init: float = DYT_ALPHA_INIT
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    D = x.shape[-1]
    # A gain by name: never weight-decayed, logged with the gains (diagnostics.gain_metrics).
    alpha = self.param("alpha_gain", nn.initializers.constant(self.alpha_init), (), jnp.float32)
    gamma_D = self.param("scale", nn.initializers.ones, (D,), jnp.float32)
    beta_D = self.param("bias", nn.initializers.zeros, (D,), jnp.float32)
    return (gamma_D * self.squash(alpha * x.astype(jnp.float32)) + beta_D).astype(self.dtype)

  def squash(self, z):
    return jnp.tanh(z)


class Derf(DyT):
  """Dynamic erf (Chen, Lu, Zhu, Sun, Liu, "Stronger Normalization-Free Transformers", arXiv
  2512.10938): `gamma * erf(alpha * x + s) + beta`, DyT with erf and a learnable scalar shift
  s from 0, named as a gain (`shift_gain`) as alpha is; alpha_0 as DyT's."""

  def squash(self, z):
    shift = self.param("shift_gain", nn.initializers.zeros, (), jnp.float32)
    return jax.scipy.special.erf(z + shift)


def make_norm(norm_type: str, eps: float, dtype, name: str,
              alpha_init: float = DYT_ALPHA_INIT) -> Callable:
  """A norm module ("rmsnorm", "ln", "dyt", "derf"), or the identity for "none"; `alpha_init`:
  DyT's and Derf's alpha_0 (the other norms have none)."""
  if norm_type == "rmsnorm":
    return RMSNorm(eps=eps, dtype=dtype, name=name)
  if norm_type == "ln":
    return nn.LayerNorm(epsilon=eps, dtype=dtype, name=name)
  if norm_type == "dyt":
    return DyT(alpha_init=alpha_init, dtype=dtype, name=name)
  if norm_type == "derf":
    return Derf(alpha_init=alpha_init, dtype=dtype, name=name)
  assert norm_type == "none", norm_type
  return lambda x: x


def normal_init(std: float):
  """N(0, std); std 0 gives zeros."""
  return nn.initializers.zeros if std == 0 else nn.initializers.normal(std)


def kernel_init(init_type: str, std: Optional[float] = None):
  """Initialiser of a plain [D_in, D_out] kernel: N(0, std) if `std` is set, else by
  `init_type`: N(0, 0.02), orthogonal or identity."""
  if std is not None or init_type == "normal":
    return normal_init(PLAIN_STD if std is None else std)
  if init_type == "orth":
    return nn.initializers.orthogonal()
  assert init_type == "id", init_type
  return lambda key, shape, dtype=jnp.float32: jnp.eye(*shape, dtype=dtype)


def matmul(x_ND, kernel_DF):
  """x [.., D] @ kernel [D, F]: the product of every linear layer, fake-quantised where
  `quantize.applied` asks for it."""
  return jnp.dot(*quantize.operands(x_ND, kernel_DF))


def dense(features: int, dtype, name: str, kernel_init=normal_init(PLAIN_STD),
          use_bias: bool = False, product: Callable = matmul) -> nn.Dense:
  """`nn.Dense` (float32 `kernel` [D, F], zero `bias`) computing x @ kernel in `dtype` by
  `product` (`matmul` or an exact form of it; Dense's dimension numbers go unread)."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, kernel_init=kernel_init, name=name,
                  dot_general=lambda x_ND, kernel_DF, *_, **__: product(x_ND, kernel_DF))


class ReparamLinear(nn.Module):
  """Value / output projection ([SB] Sec. 4.2), [.., D] -> [.., D], no bias, by `settings.form`:
  the identity (no parameters); plain `x @ W`, W by `init_type` (or N(0, init_std));
  reparameterised `x @ (resid_gain * W + skip_gain * W0)` (Eq. (7)), W zero at init (or N(0,
  init_std)), W0 the fixed `anchor` passed in (`constants`)."""
  settings: Any   # valproj.LinearSettings
  dtype: Any = jnp.float32
  product: Callable = matmul   # x @ kernel: `matmul`, or an exact form of it (the speed package's)

  @nn.compact
  def __call__(self, x_BTD, anchor_DD=None):
    s, D = self.settings, x_BTD.shape[-1]
    if s.form == "identity":
      return x_BTD
    if s.form == "plain":
      return dense(D, self.dtype, "linear", kernel_init(s.init_type, s.init_std),
                   product=self.product)(x_BTD)
    w_DD = self.param("kernel", normal_init(s.init_std or 0.0), (D, D), jnp.float32)
    resid = gain(self, "resid_gain", s.resid_gain, s.trainable_gains)
    skip = gain(self, "skip_gain", s.skip_gain, s.trainable_gains)
    return self.product(x_BTD.astype(self.dtype),
                        (resid * w_DD + skip * anchor_DD).astype(self.dtype))


take_rows = functools.partial(jnp.take, axis=0)   # table [V, D], tokens [...] -> [..., D]


class Embed(nn.Embed):
  """`nn.Embed` (the same "embedding" parameter) reading rows by `lookup(table_VD, tokens)`:
  `take_rows`, or an exact form of it (the speed package's)."""

  def __call__(self, tokens, lookup: Callable = take_rows):
    return lookup(self.embedding, tokens)


def tied_head(x_BTD, embedding_VD, dtype) -> jax.Array:
  """x [B, T, D] @ embedding^T in `dtype` -> float32 logits [B, T, V] (float32 accumulation,
  for a stable softmax cross-entropy); quantised as every linear layer."""
  x_BTD, table_DV = quantize.operands(x_BTD.astype(dtype), embedding_VD.T.astype(dtype))
  return jnp.einsum("btd,dv->btv", x_BTD, table_DV, preferred_element_type=jnp.float32)
