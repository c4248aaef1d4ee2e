"""The fused attention kernel of each backend for the A v term of shaped attention (Eq. (6)):
`softmax(q k^T / sqrt(d) + mask) v` without forming the logits where a kernel exists. TPU:
Pallas splash attention (Tq == Tk, T % 128 == 0, no mask array); GPU: cuDNN flash attention
(float16/bfloat16, shapes cuDNN accepts); otherwise, and for anything a kernel cannot take
(padding or packing masks, a KV cache, float32 on GPU), XLA's `jax.nn.dot_product_attention`,
with the same result. `SIMPLIFIED_FLAX_ATTENTION_KERNEL=xla` forces XLA everywhere.
`resolve_impl` turns `model.attention_impl="auto"` into the path the block takes.
"""
import functools
import math
import os
from typing import Literal, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P


Kernel = Literal["splash", "cudnn", "xla"]
REQUESTS = ("auto", "explicit", "fused")   # the values of model.attention_impl
KERNEL_ENV = "SIMPLIFIED_FLAX_ATTENTION_KERNEL"
SPLASH_BLOCK = 128       # the splash kernel's tile along Tq and Tk; T must be a multiple
_CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)   # what cuDNN's flash attention takes
# "auto" per backend where no rule of `resolve_impl` decides: the path measured fastest there
# (CPU: experiments/paired_settings.py at the benchmark shape; docs/attention.md, "Measured on
# the CPU").
AUTO_IMPL = {"tpu": "fused", "cpu": "explicit"}


def resolve_impl(requested: str, *, dtype, backend: str,
                 soft_capped: bool = False) -> Literal["explicit", "fused"]:
  """The attention path for `model.attention_impl=requested` computing in `dtype`. "auto" is
  explicit where the fused form cannot serve or gains nothing (soft-capped logits; float32 on
  GPU), cuDNN's fused form on GPU, else AUTO_IMPL (explicit where nobody measured)."""
  if requested != "auto":
    return requested
  if soft_capped:
    return "explicit"
  if backend == "gpu":
    return "fused" if _cudnn_takes(dtype) else "explicit"
  return AUTO_IMPL.get(backend, "explicit")


def _cudnn_takes(dtype) -> bool:
  return jnp.dtype(dtype) in map(jnp.dtype, _CUDNN_DTYPES)


def why_no_kernel(requested: str, *, dtype, soft_capped: bool, seq_len: int,
                  backend: str) -> str | None:
  """Why a step compiled for `backend` ("gpu", "tpu") calls no fused kernel (splash, cuDNN),
  by the rules of `resolve_impl` and `choose_kernel`, with the setting that gives it one; None
  where none of them is the reason."""
  if backend not in ("gpu", "tpu"):
    return None
  if requested == "explicit":
    return ("model.attention_impl=explicit forms the T x T scores in XLA; 'auto' or 'fused' "
            "takes the kernel")
  if soft_capped:
    return "model.dot_norm_type=tanh soft-caps the logits, which no fused kernel takes"
  if backend == "gpu" and not _cudnn_takes(dtype):
    return (f"dtype={dtype}: cuDNN's flash attention takes bfloat16 or float16; "
            f"--config.dtype=bfloat16 gives it")
  if backend == "tpu" and seq_len % SPLASH_BLOCK:
    return (f"model.context_length={seq_len} is not a multiple of splash's block "
            f"({SPLASH_BLOCK})")
  return None


def choose_kernel(q_BTHd, k_BTHd, *, mask, backend: str) -> Kernel:
  """The kernel `dot_product_attention` uses for these shapes on `backend` (the platform the
  step is compiled for: `Plan.platform`)."""
  if os.environ.get(KERNEL_ENV, "auto") == "xla":
    return "xla"
  Tq, Tk = q_BTHd.shape[1], k_BTHd.shape[1]
  if backend == "tpu" and mask is None and Tq == Tk and Tq % SPLASH_BLOCK == 0:
    return "splash"
  if backend == "gpu" and _cudnn_takes(q_BTHd.dtype):
    return "cudnn"
  return "xla"


def dot_product_attention(q_BTHd, k_BTHd, v_BTHd, *, mask=None, is_causal: bool = False,
                          backend: str, interpret: bool = False):
  """Attention output [B, Tq, H, Dh] in the inputs' dtype, as `jax.nn.dot_product_attention`,
  to the dtype's round-off. `mask`: boolean [B or 1, H or 1, Tq, Tk] (True: attend) or None;
  `is_causal`: the lower-triangular mask (Tq == Tk). `interpret` (the Pallas kernel in
  interpret mode; cuDNN, which has none, gives way to XLA) lets tests on a CPU check a
  backend's path."""
  kernel = choose_kernel(q_BTHd, k_BTHd, mask=mask, backend=backend)
  if kernel == "splash":
    return _splash(q_BTHd, k_BTHd, v_BTHd, is_causal=is_causal, interpret=interpret)
  if kernel == "cudnn" and not interpret:
    try:
      return jax.nn.dot_product_attention(q_BTHd, k_BTHd, v_BTHd, mask=mask,
                                          is_causal=is_causal, implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError) as e:
      # cuDNN's shape/version checks run while tracing; its refusal costs nothing here.
      logging.log_first_n(logging.INFO, "cuDNN attention not taken (%s); using XLA.", 1, e)
  return jax.nn.dot_product_attention(q_BTHd, k_BTHd, v_BTHd, mask=mask, is_causal=is_causal,
                                      implementation="xla")


@functools.lru_cache(maxsize=32)
def _splash_kernel(num_heads: int, seq_len: int, is_causal: bool, interpret: bool):
  """A splash kernel for [H, T, Dh] inputs (built once per shape: its mask tables are static)."""
  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  head_mask = (sm.CausalMask((seq_len, seq_len)) if is_causal
               else sm.FullMask((seq_len, seq_len)))
  block = SPLASH_BLOCK
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  # Concrete mask tables even when first built inside a jit trace (the cache outlives it).
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mha(sm.MultiHeadMask([head_mask] * num_heads), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1, interpret=interpret)


def mesh_split(axes, batch: int, num_heads: int) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
  """(axes splitting the batch, axes splitting the heads) for the splash kernel; `axes` is
  ((name, size), ...) in mesh order. Each goes to the batch while it divides, else to the
  heads, else to neither (the kernel is then repeated along it: correct, only not split)."""
  batch_axes, head_axes, batch_split, head_split = [], [], 1, 1
  for name, size in axes:
    if size == 1:
      continue
    if batch % (batch_split * size) == 0:
      batch_axes.append(name)
      batch_split *= size
    elif num_heads % (head_split * size) == 0:
      head_axes.append(name)
      head_split *= size
  return tuple(batch_axes), tuple(head_axes)


def tokens_per_device(batch: int, seq_len: int, num_heads: int) -> int:
  """The tokens of a [batch, seq_len] batch that each device's attention kernel sees: the
  batch split over the ambient mesh's axes as `mesh_split` splits it (all of them off a mesh,
  or under `jax.pmap`, whose traced batch is the device's own)."""
  axes = ambient_axes()[1]
  batch_axes, _ = mesh_split(axes, batch, num_heads)
  return batch * seq_len // ways(axes, batch_axes)


def ways(axes, names) -> int:
  """Into how many parts the axes `names` of `axes` ((name, size), ...) split an array."""
  return math.prod(size for name, size in axes if name in names)


def _splash(q_BTHd, k_BTHd, v_BTHd, *, is_causal: bool, interpret: bool):
  """The splash kernel (a custom call XLA cannot partition), `shard_map`ped over the ambient
  mesh's automatic axes if any (under `jax.pmap` or on one device it runs as it is)."""
  local = functools.partial(_splash_local, is_causal=is_causal, interpret=interpret)
  mesh, axes = ambient_axes()
  if not axes:
    return local(q_BTHd, k_BTHd, v_BTHd)
  batch_axes, head_axes = mesh_split(axes, q_BTHd.shape[0], q_BTHd.shape[2])
  spec = P(batch_axes or None, None, head_axes or None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       axis_names=frozenset(name for name, _ in axes),
                       check_vma=False)(q_BTHd, k_BTHd, v_BTHd)


def ambient_axes():
  """(the ambient abstract mesh, its automatic axes as ((name, size), ...) in mesh order),
  the axes () when none has size > 1: what a kernel XLA cannot partition is `shard_map`ped
  over (under `jax.pmap` or on one device it runs as it is)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else tuple(
      (name, size) for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                               mesh.axis_types) if kind != AxisType.Manual)
  return mesh, (axes if any(size > 1 for _, size in axes) else ())


def _splash_local(q_BTHd, k_BTHd, v_BTHd, *, is_causal: bool, interpret: bool):
  _, T, H, Dh = q_BTHd.shape
  kernel = _splash_kernel(H, T, bool(is_causal), interpret)
  # The kernel takes [H, T, Dh] per example and does not scale the logits itself.
  to_BHTd = lambda x: jnp.swapaxes(x, 1, 2)
  q_BHTd = to_BHTd(q_BTHd * jnp.asarray(1.0 / np.sqrt(Dh), q_BTHd.dtype))
  out_BHTd = jax.vmap(kernel)(q_BHTd, to_BHTd(k_BTHd), to_BHTd(v_BTHd))
  return jnp.swapaxes(out_BHTd, 1, 2).astype(v_BTHd.dtype)
