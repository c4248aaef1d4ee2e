"""The MLP's ReLU derivative inside the GEMM that makes its input gradient (Pallas on Triton).

The MLP's second product is `relu(h) @ W` (h [B, T, F] the pre-activation, W [F, D]). Its
backward needs `dh = (g @ W^T) * [h >= 0]` (leaky_relu's derivative at slope 0: 1 at h = 0).
XLA:GPU writes the GEMM's result `g @ W^T` [B, T, F] to memory and reads it back with h in a
kernel of its own that writes dh: 302 MB a layer at the paper's shape, 5.4 GB a step on an
H200, in every variant. A select with two computed inputs fuses into no cuBLAS or Triton GEMM
that XLA makes. Here one kernel takes the product tile by tile in float32 and writes dh with
the mask applied: it reads g, W and h and writes dh, and g @ W^T never leaves the chip.

Values: the product is summed in float32 and rounded once to dh's dtype, as the GEMM rounds
its result before the mask; only the order of the float32 sums differs (round-off), and a
masked element is +0 where the select gave -0 for a negative g.

Shapes: g [B, T, D], W [F, D] (the kernel's rows are the GEMM's columns), h [B, T, F] -> dh
[B, T, F]. Off a mesh the kernel runs as it is; on one, `shard_map`ped over the automatic axes
that split the batch (a custom call XLA cannot partition). `interpret=True` runs it on any
backend (tests).

`aot.hlo_costs` counts this kernel as a GEMM (2 M F D FLOPs, from its operands) by its name
scope, NAME: the Triton call carries no cost of its own.
"""
import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from simplified_flax.fast import attention_kernels

NAME = "pallas_gemm_relu_grad"   # the kernel's name scope, read by aot.hlo_costs
TILES = (128, 64, 32, 16)        # rows and columns of dh a program owns, largest that divides
K_TILES = (64, 32, 16)           # the contracted width a step of the sum takes
GPU_DTYPES = (jnp.bfloat16, jnp.float16)   # float32 would be TF32 in Triton's dot: not XLA's


def _largest_dividing(n: int, choices) -> int | None:
  return next((c for c in choices if n % c == 0), None)


def tiles(rows: int, features: int, width: int):
  """(rows, features, width) tiles of a program for dh [rows, features] = g [rows, width] @
  W^T, or None where no power of two from 16 up divides each (Triton's tiles)."""
  found = (_largest_dividing(rows, TILES), _largest_dividing(features, TILES),
           _largest_dividing(width, K_TILES))
  return None if None in found else found


def supported(h_BTF, kernel_FD, *, interpret: bool) -> bool:
  """Whether the kernel takes this pre-activation and kernel: tiles divide each device's rows
  (the batch split over the ambient mesh as `relu_grad_matmul` splits it), F and D; on a GPU
  bfloat16 or float16 operands (interpreted, any float)."""
  if h_BTF.ndim != 3:
    return False
  B, T, F = h_BTF.shape
  _, axes = attention_kernels.ambient_axes()
  split = attention_kernels.ways(axes, attention_kernels.mesh_split(axes, B, 1)[0])
  dtype_ok = interpret or any(h_BTF.dtype == d for d in GPU_DTYPES)
  return (dtype_ok and h_BTF.dtype == kernel_FD.dtype
          and tiles(B // split * T, F, kernel_FD.shape[1]) is not None)


def _kernel(g_ref, w_ref, h_ref, dh_ref, *, width_tile):
  rows, features = dh_ref.shape

  def step(k, acc_RF):
    cols = pl.ds(k * width_tile, width_tile)
    return acc_RF + jax.lax.dot_general(
        g_ref[:, cols], w_ref[:, cols], (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32)

  acc_RF = jax.lax.fori_loop(0, g_ref.shape[1] // width_tile, step,
                             jnp.zeros((rows, features), jnp.float32))
  dh_ref[...] = jnp.where(h_ref[...] >= 0, acc_RF, 0.0).astype(dh_ref.dtype)


def _local(g_BTD, kernel_FD, h_BTF, *, interpret):
  B, T, F = h_BTF.shape
  D = kernel_FD.shape[1]
  row_tile, feature_tile, width_tile = tiles(B * T, F, D)
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton  # pylint: disable=import-outside-toplevel
    params = dict(compiler_params=triton.CompilerParams(num_warps=4, num_stages=3))
  dh_NF = pl.pallas_call(
      functools.partial(_kernel, width_tile=width_tile),
      out_shape=jax.ShapeDtypeStruct((B * T, F), h_BTF.dtype),
      grid=(B * T // row_tile, F // feature_tile),
      in_specs=[pl.BlockSpec((row_tile, D), lambda i, j: (i, 0)),
                pl.BlockSpec((feature_tile, D), lambda i, j: (j, 0)),
                pl.BlockSpec((row_tile, feature_tile), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((row_tile, feature_tile), lambda i, j: (i, j)),
      interpret=interpret, name=NAME, **params,
  )(g_BTD.reshape(B * T, D), kernel_FD, h_BTF.reshape(B * T, F))
  return dh_NF.reshape(B, T, F)


def relu_grad_matmul(g_BTD, kernel_FD, h_BTF, *, interpret: bool) -> jax.Array:
  """dh [B, T, F] = (g @ kernel^T) * [h >= 0] in h's dtype, one kernel (`supported` first)."""
  local = functools.partial(_local, interpret=interpret)
  mesh, axes = attention_kernels.ambient_axes()
  if not axes:
    return local(g_BTD, kernel_FD, h_BTF)
  rows = P(attention_kernels.mesh_split(axes, h_BTF.shape[0], 1)[0] or None, None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(rows, P(None, None), rows), out_specs=rows,
                       axis_names=frozenset(name for name, _ in axes),
                       check_vma=False)(g_BTD, kernel_FD, h_BTF)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def relu_matmul(h_BTF, kernel_FD, interpret: bool):
  """`relu(h) @ kernel` [B, T, D] (relu as `max(h, 0)`: XLA takes it into the GEMM's operand
  read), whose backward makes dh with `relu_grad_matmul` (`supported` first) and the kernel's
  gradient as `relu(h)^T g`. Gradients are leaky_relu's at slope 0, as autodiff's."""
  return jnp.dot(jnp.maximum(h_BTF, jnp.zeros((), h_BTF.dtype)), kernel_FD)


def _forward(h_BTF, kernel_FD, interpret):
  return relu_matmul(h_BTF, kernel_FD, interpret), (h_BTF, kernel_FD)


def _backward(interpret, residuals, g_BTD):
  h_BTF, kernel_FD = residuals
  g_BTD = g_BTD.astype(h_BTF.dtype)
  dh_BTF = relu_grad_matmul(g_BTD, kernel_FD, h_BTF, interpret=interpret)
  relu_BTF = jnp.maximum(h_BTF, jnp.zeros((), h_BTF.dtype))
  dkernel_FD = jnp.einsum("btf,btd->fd", relu_BTF, g_BTD).astype(kernel_FD.dtype)
  return dh_BTF, dkernel_FD


relu_matmul.defvjp(_forward, _backward)
