"""The speed forms of the model's layers (model/layers.py): the same parameters and values, taken in
forms a compiler lowers better where `Plan` says so. Each cites the rule it applies.
"""
import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from simplified_flax.fast import attention_kernels
from simplified_flax.fast import grad_rules
from simplified_flax.fast.plan import Plan
from simplified_flax.model import layers
from simplified_flax.model import quantize


def matmul(plan: Plan, x_ND, kernel_DF):
  """`layers.matmul` (quantised where asked), with the `dense` rule's gradient where it applies."""
  return product(plan, *quantize.operands(x_ND, kernel_DF))


def product(plan: Plan, x_ND, kernel_DF):
  """`x @ kernel` of operands already quantised, with the `dense` rule where it applies."""
  return grad_rules.dense(x_ND, kernel_DF) if plan.applies("dense") else jnp.dot(x_ND, kernel_DF)


def dense(plan: Plan, features: int, dtype, name: str, **kwargs) -> nn.Dense:
  """`layers.dense` (the same parameters) through `matmul`."""
  return layers.dense(features, dtype, name, product=functools.partial(matmul, plan), **kwargs)


class RMSNorm(nn.Module):
  """`layers.RMSNorm` (the same `scale`), which may take its sums of squares from the writer of
  its input (the `norm_stats` rule)."""
  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, sum_squares=None):
    """`sum_squares` (optional, float32 x.shape[:-1]): sum(x^2) over the last axis, made by
    whoever wrote x (the combine kernels)."""
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    if sum_squares is None:
      return layers.rms_norm(x, scale, self.eps, self.dtype)
    return _rms_norm_given_sums(x, scale, sum_squares, self.eps, self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rms_norm_given_sums(x, scale, sum_squares, eps, dtype):
  """`layers.rms_norm` with the root mean square taken from `sum_squares`; the gradient is the
  plain norm's: the sums' cotangent goes to x, as if the norm had made them (the caller vouches
  that they are x's)."""
  rms = jnp.sqrt(sum_squares[..., None] / x.shape[-1])
  return (scale * x.astype(jnp.float32) / (rms + eps)).astype(dtype)


def _given_sums_forward(x, scale, sum_squares, eps, dtype):
  return _rms_norm_given_sums(x, scale, sum_squares, eps, dtype), (x, scale, sum_squares)


def _given_sums_backward(eps, dtype, residuals, g):
  # The plain norm's backward, which takes the sums again from x: XLA makes them in the
  # reduction over x and g that the backward has anyway, so that costs no pass of its own.
  x, scale, sum_squares = residuals
  _, plain_vjp = jax.vjp(functools.partial(layers.rms_norm, eps=eps, dtype=dtype), x, scale)
  return (*plain_vjp(g), jnp.zeros_like(sum_squares))


_rms_norm_given_sums.defvjp(_given_sums_forward, _given_sums_backward)


def make_norm(norm_type: str, eps: float, dtype, name: str) -> Callable:
  """`layers.make_norm`, with this module's RMSNorm (which can take given sums)."""
  if norm_type == "rmsnorm":
    return RMSNorm(eps=eps, dtype=dtype, name=name)
  return layers.make_norm(norm_type, eps, dtype, name)


def in_dtype(plan: Plan, x, dtype, *, platforms=None) -> jax.Array:
  """`x.astype(dtype)`, held there: a narrower `dtype` is really stored. XLA's excess-precision
  rewrite would otherwise drop the rounding of a value that is cast back up (the residual
  stream into the next norm) and move it, forward and backward, in float32: the same maths at
  twice the bytes. The barrier keeps the rounding the code asks for; in float32 it is a no-op.
  `platforms`: hold it only when compiling for one of these (None: everywhere)."""
  x = x.astype(dtype)
  if x.dtype == jnp.float32 or (platforms and plan.platform not in platforms):
    return x
  return jax.lax.optimization_barrier(x)


class QKDense(nn.Module):
  """The attention's c_attn (`layers.dense`'s float32 `kernel` [D, 2D] and zero `bias` [2D]):
  x [.., D] -> (q, k), [.., D] each, as `grad_rules.biased_halves` forms them: `separate` (the
  block decides) as two GEMMs, the kernel and bias made whole on every device first."""
  plan: Plan
  dtype: Any = jnp.float32
  kernel_init: Callable = layers.normal_init(layers.PLAIN_STD)
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
    quantised_product = functools.partial(product, self.plan)   # operands quantised above
    if not self.plan.applies("split"):
      return tuple(jnp.split(quantised_product(x_ND, kernel_DF) + bias_F, 2, axis=-1))
    return grad_rules.biased_halves(x_ND, kernel_DF, bias_F, separate=self.separate,
                                    product=quantised_product)


def embedding_lookup(table_VD, tokens_BT) -> jax.Array:
  """table [V, D] rows at int tokens [B, T] -> [B, T, D]: `layers.take_rows`, `shard_map`ped
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
    return layers.take_rows(table_VD, tokens_BT)
  rows = P(batch_axes)
  return jax.shard_map(layers.take_rows, mesh=mesh, in_specs=(P(), rows), out_specs=rows,
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

  def lookup(self, table_VD, tokens_BT) -> jax.Array:
    """The token lookup through the copies (`table_VD`, the same table, goes unread)."""
    del table_VD
    return self.map(layers.take_rows, tokens_BT)


def table_copies(table_VD, batch: int) -> Optional[TableCopies]:
  """The tied table's copies over the mesh axes that split a batch of `batch` rows, for its two
  uses in training, the token lookup and the head (training/losses.py); None where no axis
  splits the batch (one device, `jax.pmap`). For a table that is whole on every device (no
  FSDP): the copies move no data.

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
