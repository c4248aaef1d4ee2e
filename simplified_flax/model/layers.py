"""Parts of the block (docs/model.md): norms, gains, the linear layers and their one product (the
MLP: mlp.py). A gain whose trainable flag is off is a constant, never in the parameter tree.
"""
import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from simplified_flax.model import attention_kernels
from simplified_flax.model import grad_rules
from simplified_flax.model import quantize
from simplified_flax.model import target_platform

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
  def __call__(self, x, sum_squares=None):
    """`sum_squares` (optional, float32 x.shape[:-1]): sum(x^2) over the last axis, made by
    whoever wrote x (`rms_norm`)."""
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    return rms_norm(x, scale, self.eps, self.dtype, sum_squares)


def rms_norm(x, scale, eps: float, dtype, sum_squares=None) -> jax.Array:
  """RMSNorm of x [..., D] with scale [D], in `dtype`. With `sum_squares` [...] (sum(x^2) over
  D, float32; the combine kernels write it with their result, combine_kernel.py) the root
  mean square is taken from it, and the gradient is that of the plain norm: the sums'
  cotangent goes to x, as if the norm had made them (the caller vouches that they are x's)."""
  if sum_squares is None:
    return _plain_rms_norm(x, scale, eps, dtype)
  return _rms_norm_given_sums(x, scale, sum_squares, eps, dtype)


def _plain_rms_norm(x, scale, eps, dtype):
  x32 = x.astype(jnp.float32)
  rms = jnp.sqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True))
  return (scale * x32 / (rms + eps)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rms_norm_given_sums(x, scale, sum_squares, eps, dtype):
  rms = jnp.sqrt(sum_squares[..., None] / x.shape[-1])
  return (scale * x.astype(jnp.float32) / (rms + eps)).astype(dtype)


def _given_sums_forward(x, scale, sum_squares, eps, dtype):
  return _rms_norm_given_sums(x, scale, sum_squares, eps, dtype), (x, scale, sum_squares)


def _given_sums_backward(eps, dtype, residuals, g):
  # The plain norm's backward, which takes the sums again from x: XLA makes them in the
  # reduction over x and g that the backward has anyway, so that costs no pass of its own.
  x, scale, sum_squares = residuals
  _, plain_vjp = jax.vjp(functools.partial(_plain_rms_norm, eps=eps, dtype=dtype), x, scale)
  return (*plain_vjp(g), jnp.zeros_like(sum_squares))


_rms_norm_given_sums.defvjp(_given_sums_forward, _given_sums_backward)


def in_dtype(x, dtype, *, platforms=None) -> jax.Array:
  """`x.astype(dtype)`, held there: a narrower `dtype` is really stored. XLA's excess-precision
  rewrite would otherwise drop the rounding of a value that is cast back up (the residual
  stream into the next norm) and move it, forward and backward, in float32: the same maths at
  twice the bytes. The barrier keeps the rounding the code asks for; in float32 it is a no-op.
  `platforms`: hold it only when compiling for one of these (None: everywhere)."""
  x = x.astype(dtype)
  if x.dtype == jnp.float32 or (platforms and target_platform.current() not in platforms):
    return x
  return jax.lax.optimization_barrier(x)


def make_norm(norm_type: str, eps: float, dtype, name: str) -> Callable:
  """A norm module ("rmsnorm", "ln"), or the identity for "none"."""
  if norm_type == "rmsnorm":
    return RMSNorm(eps=eps, dtype=dtype, name=name)
  if norm_type == "ln":
    return nn.LayerNorm(epsilon=eps, dtype=dtype, name=name)
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
  """x [.., D] @ kernel [D, F]: the product of every linear layer, where two choices made
  outside the block code act: `quantize.applied` fake-quantises the operands, `grad_rules`
  picks the CPU gradient."""
  x_ND, kernel_DF = quantize.operands(x_ND, kernel_DF)
  return grad_rules.matmul(x_ND, kernel_DF)


def dense(features: int, dtype, name: str, kernel_init=normal_init(PLAIN_STD),
          use_bias: bool = False) -> nn.Dense:
  """`nn.Dense` (float32 `kernel` [D, F], zero `bias`) computing in `dtype` through `matmul`
  (Dense contracts x's last axis with the kernel's first: the dimension numbers go unread)."""
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, kernel_init=kernel_init, name=name,
                  dot_general=lambda x_ND, kernel_DF, *_, **__: matmul(x_ND, kernel_DF))


class ReparamLinear(nn.Module):
  """Value / output projection ([SB] Sec. 4.2), [.., D] -> [.., D], no bias, in the form of
  `settings.form`: the identity (no parameters); plain `x @ W`, W initialised by `init_type`
  (or N(0, init_std)); reparameterised `x @ (resid_gain * W + skip_gain * W0)` (Eq. (7)), W
  zero at init (or N(0, init_std)), W0 the fixed `anchor` passed in (`constants`).
  """
  settings: Any   # valproj.LinearSettings
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, anchor_DD=None):
    s, D = self.settings, x_BTD.shape[-1]
    if s.form == "identity":
      return x_BTD
    if s.form == "plain":
      return dense(D, self.dtype, "linear", kernel_init(s.init_type, s.init_std))(x_BTD)
    w_DD = self.param("kernel", normal_init(s.init_std or 0.0), (D, D), jnp.float32)
    resid = gain(self, "resid_gain", s.resid_gain, s.trainable_gains)
    skip = gain(self, "skip_gain", s.skip_gain, s.trainable_gains)
    return matmul(x_BTD.astype(self.dtype), (resid * w_DD + skip * anchor_DD).astype(self.dtype))


take_rows = functools.partial(jnp.take, axis=0)   # table [V, D], tokens [...] -> [..., D]


class Embed(nn.Embed):
  """`nn.Embed` (the same "embedding" parameter) whose lookup is `embedding_lookup`, or, given
  `copies` of the table (`table_copies`), each device's lookup in its copy."""

  def __call__(self, inputs, copies: "TableCopies | None" = None):
    if copies is not None:
      return copies.map(take_rows, inputs)
    return embedding_lookup(self.embedding, inputs)


def embedding_lookup(table_VD, tokens_BT) -> jax.Array:
  """table [V, D] rows at int tokens [B, T] -> [B, T, D]: `nn.Embed`'s `jnp.take`, `shard_map`ped
  over the mesh axes that split the batch (under `jax.pmap` or on one device, as it is).

  Why: its gradient is then each device's rows scatter-added into zeros and summed over those
  axes in one all-reduce, which XLA adds to the tied head's partial [V, D] gradient before
  reducing both at once. Left to XLA's partitioner, the head's gradient is all-reduced first,
  the scatter made into it and the sum all-reduced again (a float32 [V, D] all-reduce more per
  step), and on a pod with FSDP the partitioner gathers whole-batch activations for the layers'
  weight gradients (experiments/results/compiled/tpu_log.md). The training loss does better
  still with `table_copies`."""
  mesh, axes = attention_kernels.ambient_axes()
  batch_axes = attention_kernels.mesh_split(axes, tokens_BT.shape[0], 1)[0]
  if not batch_axes:
    return take_rows(table_VD, tokens_BT)
  rows = P(batch_axes)
  return jax.shard_map(take_rows, mesh=mesh, in_specs=(P(), rows), out_specs=rows,
                       axis_names=frozenset(batch_axes))(table_VD, tokens_BT)


@dataclasses.dataclass(frozen=True)
class TableCopies:
  """A table [V, D] once per device along the mesh `axes` that split the batch: `copies_CVD`
  [n, V, D], sharded over them, device i's block [1, V, D] the table it holds anyway."""
  copies_CVD: jax.Array
  axes: tuple[str, ...]

  def map(self, fn: Callable, *rows) -> jax.Array:
    """`fn(table_VD, *its_rows)` on each device, with its copy and its rows of each of `rows`
    (split along their first axis over `axes`); the results' rows joined the same way."""
    split = P(self.axes)
    return jax.shard_map(lambda copy_1VD, *local: fn(copy_1VD[0], *local),
                         mesh=jax.sharding.get_abstract_mesh(), in_specs=(split,) * (1 + len(rows)),
                         out_specs=split, axis_names=frozenset(self.axes))(self.copies_CVD, *rows)


def table_copies(table_VD, batch: int) -> Optional[TableCopies]:
  """The tied table's copies over the mesh axes that split a batch of `batch` rows, for its two
  uses in training, the token lookup (`Embed`) and the head (training/losses.py); None where
  no axis splits the batch (one device, `jax.pmap`). For a table that is whole on every
  device (no FSDP): the copies move no data.

  Why: through each device's copy, the lookup's and the head's gradients are that device's
  partial sums, which jax adds before the copies' sum, the one all-reduce. XLA then scatters
  the lookup's rows into the head's gradient in place. Through the shared table (as
  `embedding_lookup`), each use's gradient is summed over the devices on its own; XLA joins
  the two all-reduces into one but scatters the rows into a zeroed [V, D] first: on a v5e-8
  at the paper's shape 0.30 GB a chip more HBM traffic a step, and the head's weight
  gradient held to the end of the backward (+0.43 GiB of temporaries)."""
  _, axes = attention_kernels.ambient_axes()
  batch_axes = attention_kernels.mesh_split(axes, batch, 1)[0]
  if not batch_axes:
    return None
  n = attention_kernels.ways(axes, batch_axes)
  copies_CVD = jax.lax.with_sharding_constraint(
      jnp.broadcast_to(table_VD[None], (n, *table_VD.shape)), P(batch_axes))
  return TableCopies(copies_CVD, batch_axes)


def tied_head(x_BTD, embedding_VD, dtype) -> jax.Array:
  """x [B, T, D] @ embedding^T in `dtype` -> float32 logits [B, T, V] (float32 accumulation,
  for a stable softmax cross-entropy); quantised as every linear layer."""
  x_BTD, table_DV = quantize.operands(x_BTD.astype(dtype), embedding_VD.T.astype(dtype))
  return jnp.einsum("btd,dv->btv", x_BTD, table_DV, preferred_element_type=jnp.float32)


class QKDense(nn.Module):
  """The attention's c_attn: x [.., D] -> (q, k), [.., D] each, the halves of
  `x @ kernel + bias` (`dense`'s float32 `kernel` [D, 2D] and zero `bias` [2D], as nn.Dense
  makes them; computing in `dtype`), as `grad_rules.biased_halves` forms them: `separate`
  (the block decides) as two GEMMs, the kernel and bias made whole on every device first."""
  dtype: Any = jnp.float32
  kernel_init: Callable = normal_init(PLAIN_STD)
  separate: bool = False

  @nn.compact
  def __call__(self, x_ND):
    D = x_ND.shape[-1]
    kernel_DF = self.param("kernel", self.kernel_init, (D, 2 * D), jnp.float32)
    bias_F = self.param("bias", nn.initializers.zeros, (2 * D,), jnp.float32)
    x_ND, kernel_DF = quantize.operands(x_ND.astype(self.dtype), kernel_DF.astype(self.dtype))
    bias_F = bias_F.astype(self.dtype)
    mesh, axes = attention_kernels.ambient_axes()
    if self.separate and axes:
      # Whole on every device before it is cut in halves: cut along its FSDP-split columns,
      # XLA would move the halves between devices (all-to-all) rather than gather them once.
      whole = jax.sharding.NamedSharding(mesh, P())
      kernel_DF, bias_F = (jax.lax.with_sharding_constraint(a, whole) for a in (kernel_DF, bias_F))
    return grad_rules.biased_halves(x_ND, kernel_DF, bias_F, separate=self.separate)
