"""Building blocks of the block (docs/model.md): norms, gains, the reparameterised linear, the MLP.

A gain whose trainable flag is off is a plain constant, not a variable, so no optimiser can
move it and it never appears in the parameter tree.
"""
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import grad_rules as grad_rules_lib

NORM_TYPES = ("ln", "rmsnorm", "none")
INIT_TYPES = ("normal", "orth", "id")
ACTIVATIONS = ("leaky_relu", "gelu")
PLAIN_STD = 0.02   # N(0, 0.02): every plain weight (GPT-2), no depth rescaling


def gain(module: nn.Module, name: str, value: float, trainable: bool, shape=()) -> jax.Array:
  """A gain initialised to `value`: a parameter named `name` if trainable, else a constant."""
  if trainable:
    return module.param(name, nn.initializers.constant(value), shape, jnp.float32)
  return jnp.full(shape, value, jnp.float32)


class RMSNorm(nn.Module):
  """`scale * x / (sqrt(mean(x^2)) + eps)` over the last axis (eps outside the root)."""
  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True))
    return (scale * x32 / (rms + self.eps)).astype(self.dtype)


def make_norm(norm_type: str, eps: float, dtype, name: str) -> Callable:
  """A norm module, or the identity for "none"."""
  if norm_type == "rmsnorm":
    return RMSNorm(eps=eps, dtype=dtype, name=name)
  if norm_type == "ln":
    return nn.LayerNorm(epsilon=eps, dtype=dtype, name=name)
  if norm_type == "none":
    return lambda x: x
  raise ValueError(f"Unknown norm_type {norm_type!r}; expected one of {NORM_TYPES}.")


def normal_init(std: float):
  """N(0, std); std 0 gives zeros."""
  return nn.initializers.zeros if std == 0 else nn.initializers.normal(std)


def kernel_init(init_type: str, std: Optional[float] = None):
  """Initialiser of a plain [D_in, D_out] kernel: normal(0.02), orthogonal or identity."""
  if std is not None:
    return normal_init(std)
  if init_type == "normal":
    return normal_init(PLAIN_STD)
  if init_type == "orth":
    return nn.initializers.orthogonal()
  if init_type == "id":
    return lambda key, shape, dtype=jnp.float32: jnp.eye(*shape, dtype=dtype)
  raise ValueError(f"Unknown init type {init_type!r}; expected one of {INIT_TYPES}.")


def anchor_matrix(key, init_type: str, dim: int) -> jax.Array:
  """The fixed W0 of a reparameterised linear (Eq. (7)): identity, random orthogonal or
  N(0, 1/D)."""
  if init_type == "id":
    return jnp.eye(dim, dtype=jnp.float32)
  if init_type == "orth":
    return nn.initializers.orthogonal()(key, (dim, dim), jnp.float32)
  if init_type == "normal":
    return jax.random.normal(key, (dim, dim), jnp.float32) * dim ** -0.5
  raise ValueError(f"Unknown init type {init_type!r}; expected one of {INIT_TYPES}.")


def linear_form(resid_gain, skip_gain, init_type) -> str:
  """Which of the three forms (docs/model.md, "Value and Proj") a Value/Proj takes."""
  if skip_gain is None:
    return "plain"
  if skip_gain == 1 and resid_gain == 0 and init_type == "id":
    return "identity"
  return "reparam"


class Projection(nn.Module):
  """A module whose matrix product is `project(x, kernel_DF)`: the one place every linear layer
  (Linear, ReparamLinear, the tied head) multiplies by its weight, so that an evaluation can
  rewrite all of them from outside (model/quantize.py, a Flax method interceptor). Subclasses
  define `dtype` and `grad_rules`."""

  def project(self, x_BTD, kernel_DF):
    """x [.., D] @ kernel [D, F] in the compute dtype."""
    matmul = grad_rules_lib.matmul(self.grad_rules)
    return matmul(x_BTD.astype(self.dtype), kernel_DF.astype(self.dtype))


class ReparamLinear(Projection):
  """Value / output projection (He & Hofmann 2024, Sec. 4.2), [.., D] -> [.., D], no bias.

  * identity: no parameters;
  * plain: `x @ W`, W initialised by `init_type` (or N(0, init_std));
  * reparam: `x @ (resid_gain * W + skip_gain * W0)`, the W_eff of docs/model.md, Eq. (7);
    W trainable and zero at init (or N(0, init_std)), W0 the fixed `anchor` passed in (it
    lives in the `constants` collection).
  """
  resid_gain: float
  skip_gain: Optional[float]
  init_type: str
  trainable_gains: bool
  init_std: Optional[float] = None
  dtype: Any = jnp.float32
  grad_rules: str = "auto"   # grad_rules.py

  @nn.compact
  def __call__(self, x_BTD, anchor_DD=None):
    D = x_BTD.shape[-1]
    form = linear_form(self.resid_gain, self.skip_gain, self.init_type)
    if form == "identity":
      return x_BTD
    if form == "plain":
      return Linear(D, kernel_init=kernel_init(self.init_type, self.init_std), dtype=self.dtype,
                    grad_rules=self.grad_rules, name="linear")(x_BTD)
    w_DD = self.param("kernel", normal_init(self.init_std or 0.0), (D, D), jnp.float32)
    resid = gain(self, "resid_gain", self.resid_gain, self.trainable_gains)
    skip = gain(self, "skip_gain", self.skip_gain, self.trainable_gains)
    return self.project(x_BTD, resid * w_DD + skip * anchor_DD)


class Linear(Projection):
  """`x @ kernel (+ bias)`: `nn.Dense`'s parameters (`kernel` [D, F] float32, `bias` zeros)
  and numerics, computed in `dtype`; `grad_rules` may give it a faster kernel gradient on CPU."""
  features: int
  use_bias: bool = False
  kernel_init: Callable = normal_init(PLAIN_STD)
  dtype: Any = jnp.float32
  grad_rules: str = "auto"   # grad_rules.py

  @nn.compact
  def __call__(self, x_BTD):
    kernel_DF = self.param("kernel", self.kernel_init, (x_BTD.shape[-1], self.features),
                           jnp.float32)
    y_BTF = self.project(x_BTD, kernel_DF)
    if self.use_bias:
      bias_F = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
      y_BTF = y_BTF + bias_F.astype(self.dtype)
    return y_BTF


class TiedHead(Projection):
  """The LM head tied to the token embedding: x [B, T, D] @ embedding^T -> float32 logits
  [B, T, V] (float32 accumulation for a stable softmax cross-entropy). No parameters."""
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, embedding_VD):
    return self.project(x_BTD, embedding_VD.T)

  def project(self, x_BTD, kernel_DF):
    return jnp.einsum("btd,dv->btv", x_BTD.astype(self.dtype), kernel_DF.astype(self.dtype),
                      preferred_element_type=jnp.float32)


def activation_fn(name: str, lrelu_neg_slope: float) -> Callable:
  if name == "leaky_relu":
    return lambda x: jax.nn.leaky_relu(x, lrelu_neg_slope)
  if name == "gelu":
    return lambda x: jax.nn.gelu(x, approximate=False)
  raise ValueError(f"Unknown activation {name!r}; expected one of {ACTIVATIONS}.")


class MLP(nn.Module):
  """`act(x @ W_fc) @ W_proj`, both without bias, N(0, 0.02) (W_proj: N(0, proj_init_std))."""
  width_mult: int
  activation: str
  lrelu_neg_slope: float
  proj_init_std: Optional[float] = None
  dtype: Any = jnp.float32
  grad_rules: str = "auto"   # grad_rules.py

  @nn.compact
  def __call__(self, x_BTD):
    D = x_BTD.shape[-1]
    h_BTF = Linear(self.width_mult * D, dtype=self.dtype, grad_rules=self.grad_rules,
                   name="c_fc")(x_BTD)
    h_BTF = activation_fn(self.activation, self.lrelu_neg_slope)(h_BTF)
    return Linear(D, kernel_init=kernel_init("normal", self.proj_init_std), dtype=self.dtype,
                  grad_rules=self.grad_rules, name="c_proj")(h_BTF)
