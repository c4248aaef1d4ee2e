"""The fused form's causal combine as one GPU kernel each way (Pallas on Triton):

    out = beta * (A v) + alpha * v - gamma * (C v),   (C v)_t = mean of v over times <= t

(Eq. (6) with the causal C of Eq. (5)). XLA computes the same sum as several kernels: it writes
the float32 cumulative mean C v to memory, reads it again for the centre gain's gradient, and
takes the three per-head gain gradients and the value gradient in kernels of their own. Here
the forward reads A v and v and writes the result; the backward reads the result's gradient,
A v and v and writes d(A v) (the attention kernel's dO) and dv, with the gain gradients as its
row sums. C v lives in registers only, a running sum carried over chunks of time.

The backward takes the centre gain's gradient as `-<C^T g, v>` (the same sum as `-<g, C v>`):
C^T g is the reverse cumulative sum of g_t / t, which the backward's one pass from the last
chunk to the first carries.

Values agree with the XLA form to float32 round-off (the sums are associated differently); the
result and the activations' gradients are rounded to the inputs' dtype once, as there.
With an `addend` (a parallel block's other branch, its gain already applied) the forward adds
it before its one rounding, and the addend's gradient is g itself: the block's sum then costs
no kernel of its own, which would read the combine's result and the addend and write the
block's output (-0.9 GB per step for SAS-P at the paper's shape on an H200).

With `sum_squares` the forward also writes each token's sum of squares of the rounded result,
per head ([B, H, T] float32, 0.8 MB at the paper's shape): an RMS norm that reads the result
next (SAS's norm2, `layers.rms_norm`) then needs no reduction kernel of its own, which would
read the whole result again (-25 MB a layer, -0.09 ms a step for SAS on an H200). The sums
are a statistic, not differentiated (`stop_gradient`): the norm that takes them
differentiates as if it had made them itself.

q/k/v layout [B, T, H, d]; gains [H]. `interpret=True` runs the kernels on any backend (tests).
`backend="tpu"` takes the same sums as Mosaic kernels laid out for a TPU's tiles
(combine_kernel_tpu.py); the custom VJP, the gains' folding and the mesh split are shared.
"""
import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from simplified_flax.fast import attention_kernels
from simplified_flax.fast import combine_kernel_tpu

CHUNK = 32   # times per step of the running sum: [CHUNK, d] float32 tiles stay in registers
# The fewest (sequence, head) programs that take the kernels: each program walks its times one
# chunk after another, so a few long sequences (batch 1 at T = 16,384: 12 programs) would leave
# most of a GPU idle where XLA's cumulative sum spreads the times over it. 264 = 2 per SM of
# an H100 or H200 (the paper's shape has 128 x 12 = 1,536).
MIN_PROGRAMS = 264


def chunk_of(T: int) -> int | None:
  """The running sum's step for T times: CHUNK, or T itself when shorter (a power of two,
  Triton's tiles); None when neither divides T."""
  if T % CHUNK == 0:
    return CHUNK
  return T if T < CHUNK and T & (T - 1) == 0 else None


def supported(v_BTHd, *, min_programs: int = MIN_PROGRAMS) -> bool:
  """Whether the kernels take these values (the plain causal mean: no padding, packing or
  offset queries, which the caller checks): a chunk of times divides T, d is a power of two
  (Triton's tiles) and there are at least `min_programs` (sequence, head) pairs (1 where the
  kernels are interpreted: occupancy is a GPU's concern)."""
  B, T, H, d = v_BTHd.shape
  return chunk_of(T) is not None and d & (d - 1) == 0 and B * H >= min_programs


def _chunk_positions(i, chunk):
  """float32 [chunk, 1]: the 1-based times of chunk i (C's row counts)."""
  times_c1 = i * chunk + 1 + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
  return times_c1.astype(jnp.float32)


def _forward_kernel(av_ref, v_ref, resid_ref, skip_ref, centre_ref, *refs, has_skip,
                    has_addend, has_sum_squares=False):
  refs = (None,) * (not has_addend) + refs + (None,) * (not has_sum_squares)
  addend_ref, out_ref, sum_squares_ref = refs
  chunk = chunk_of(v_ref.shape[0])
  resid_d, centre_d = resid_ref[...], centre_ref[...]
  skip_d = skip_ref[...] if has_skip else None
  d = v_ref.shape[-1]

  def step(i, running_d):
    rows = pl.ds(i * chunk, chunk)
    v_cd = v_ref[rows, :].astype(jnp.float32)
    mean_cd = (running_d[None, :] + jnp.cumsum(v_cd, axis=0)) / _chunk_positions(i, chunk)
    out_cd = resid_d[None, :] * av_ref[rows, :].astype(jnp.float32)
    if has_skip:
      out_cd = out_cd + skip_d[None, :] * v_cd
    out_cd = out_cd + centre_d[None, :] * -mean_cd
    if has_addend:
      out_cd = out_cd + addend_ref[rows, :].astype(jnp.float32)
    out_cd = out_cd.astype(out_ref.dtype)
    out_ref[rows, :] = out_cd
    if has_sum_squares:   # of the result as stored: what a norm reading it would sum
      rounded_cd = out_cd.astype(jnp.float32)
      sum_squares_ref[rows] = jnp.sum(rounded_cd * rounded_cd, axis=1)
    return running_d + jnp.sum(v_cd, axis=0)

  jax.lax.fori_loop(0, v_ref.shape[0] // chunk, step, jnp.zeros((d,), jnp.float32))


def _backward_kernel(g_ref, av_ref, v_ref, resid_ref, skip_ref, centre_ref,
                     dav_ref, dv_ref, dresid_ref, dskip_ref, dcentre_ref, *, has_skip):
  chunk = chunk_of(v_ref.shape[0])
  resid_d, centre_d = resid_ref[...], centre_ref[...]
  skip_d = skip_ref[...] if has_skip else None
  num_chunks, d = v_ref.shape[0] // chunk, v_ref.shape[-1]

  def step(j, carry):
    later_d, dresid_d, dskip_d, dcentre_d = carry   # later_d: sum of g_t / t over later chunks
    i = num_chunks - 1 - j
    rows = pl.ds(i * chunk, chunk)
    g_cd = g_ref[rows, :].astype(jnp.float32)
    v_cd = v_ref[rows, :].astype(jnp.float32)
    av_cd = av_ref[rows, :].astype(jnp.float32)
    w_cd = g_cd / _chunk_positions(i, chunk)
    # (C^T g)_s = sum over t >= s of g_t / t: this chunk's part as its total minus the
    # exclusive prefix (Triton's scan runs forwards only).
    total_d = jnp.sum(w_cd, axis=0)
    ctg_cd = later_d[None, :] + total_d[None, :] - jnp.cumsum(w_cd, axis=0) + w_cd
    dv_cd = -centre_d[None, :] * ctg_cd
    if has_skip:
      dv_cd = skip_d[None, :] * g_cd + dv_cd
      dskip_d = dskip_d + jnp.sum(g_cd * v_cd, axis=0)
    dav_ref[rows, :] = (resid_d[None, :] * g_cd).astype(dav_ref.dtype)
    dv_ref[rows, :] = dv_cd.astype(dv_ref.dtype)
    return (later_d + total_d, dresid_d + jnp.sum(g_cd * av_cd, axis=0), dskip_d,
            dcentre_d - jnp.sum(ctg_cd * v_cd, axis=0))

  zeros_d = jnp.zeros((d,), jnp.float32)
  _, dresid_d, dskip_d, dcentre_d = jax.lax.fori_loop(0, num_chunks, step, (zeros_d,) * 4)
  dresid_ref[...] = dresid_d
  dskip_ref[...] = dskip_d
  dcentre_ref[...] = dcentre_d


def _call(local, inputs, out_shapes):
  """`local(*inputs)` (the kernels on one shard: [B, T, H, d] arrays, [H, d] gains, [B, H, n]
  sums), `shard_map`ped over the ambient mesh's automatic axes, which split the batch, else
  the heads (a custom call XLA cannot partition)."""
  B, _, H, _ = inputs[0].shape
  mesh, spec, axis_names = _mesh_specs(B, H)
  if mesh is None:
    return local(*inputs)
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec[x.ndim] for x in inputs),
                       out_specs=tuple(spec[len(s.shape)] for s in out_shapes),
                       axis_names=axis_names, check_vma=False)(*inputs)


def _gpu_local(kernel, out_shapes, *, interpret):
  """The GPU kernels on one shard: `kernel` over the grid (B, H), each program owning one
  sequence of one head ([T, d] arrays, [d] gains, [n] sums of [B, H, n])."""
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton  # pylint: disable=import-outside-toplevel
    params = dict(compiler_params=triton.CompilerParams(num_warps=2, num_stages=1))

  def local(*local_inputs):
    B_local, T, H_local, d = local_inputs[0].shape
    block = lambda shape: {
        4: pl.BlockSpec((None, T, None, d), lambda b, h: (b, 0, h, 0)),           # [B, T, H, d]
        2: pl.BlockSpec((None, d), lambda b, h: (h, 0)),                          # gains [H, d]
        3: pl.BlockSpec((None, None, shape[-1]), lambda b, h: (b, h, 0))}[len(shape)]  # sums
    local_shape = lambda s: local_inputs[0].shape if len(s.shape) == 4 else (
        B_local, H_local, s.shape[-1])
    local_outs = [jax.ShapeDtypeStruct(local_shape(s), s.dtype) for s in out_shapes]
    return pl.pallas_call(kernel, out_shape=tuple(local_outs), grid=(B_local, H_local),
                          in_specs=[block(x.shape) for x in local_inputs],
                          out_specs=tuple(block(s.shape) for s in local_outs),
                          interpret=interpret, **params)(*local_inputs)
  return local


def _mesh_specs(B, H):
  """(mesh, {rank: PartitionSpec}, the mesh's automatic axis names) of the kernels'
  shard_map, or (None, None, None) off a mesh."""
  mesh, axes = attention_kernels.ambient_axes()
  if not axes:
    return None, None, None
  batch_axes, head_axes = attention_kernels.mesh_split(axes, B, H)
  b, h = batch_axes or None, head_axes or None
  return (mesh, {4: P(b, None, h, None), 2: P(h, None), 3: P(b, h, None)},
          frozenset(name for name, _ in axes))


def split_as_the_kernels(*arrays_BTHd):
  """The arrays constrained to the kernels' split over the ambient mesh (unchanged off one).
  Under FSDP, XLA would otherwise give q and k another sharding than v, and cuDNN's
  partitioner refuses q, k and v split differently."""
  mesh, specs, _ = _mesh_specs(arrays_BTHd[0].shape[0], arrays_BTHd[0].shape[2])
  if mesh is None:
    return arrays_BTHd
  sharding = jax.sharding.NamedSharding(mesh, specs[4])
  return tuple(jax.lax.with_sharding_constraint(x, sharding) for x in arrays_BTHd)


def _gains_Hd(gains, d):
  return tuple(jnp.broadcast_to(g.reshape(-1, 1), (g.shape[0], d)) for g in gains)


BACKENDS = ("gpu", "tpu")   # whose kernels: Triton's here, Mosaic's in combine_kernel_tpu.py


def causal_combine(av_BTHd, v_BTHd, resid_H, skip_H, centre_H, has_skip, interpret,
                   addend_BTHd=None, backend="gpu", sum_squares=False):
  """`resid * (A v) + skip * v - centre * (C v)` [B, T, H, d] in A v's dtype, causal C; gains
  float32 [H] (`skip_H` ignored unless `has_skip`). `addend_BTHd` (optional): added before
  the rounding. `backend`: whose kernels (BACKENDS), run as they are or `interpret`ed.
  `sum_squares` (the GPU's kernels only): (out, float32 [B, T] sum over H and d of out^2,
  not differentiated)."""
  if backend not in BACKENDS:
    raise ValueError(f"Unknown combine kernel backend {backend!r}; expected one of {BACKENDS}.")
  if sum_squares and backend != "gpu":
    raise ValueError("Only the GPU's combine kernels write sums of squares.")
  out = _combine(av_BTHd, v_BTHd, resid_H, skip_H, centre_H, addend_BTHd, has_skip, interpret,
                 backend, sum_squares)
  if not sum_squares:
    return out
  out_BTHd, sum_squares_BHT = out
  return out_BTHd, jax.lax.stop_gradient(sum_squares_BHT.sum(axis=1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _combine(av_BTHd, v_BTHd, resid_H, skip_H, centre_H, addend_BTHd, has_skip, interpret,
             backend, sum_squares):
  outs, _ = _forward(av_BTHd, v_BTHd, resid_H, skip_H, centre_H, addend_BTHd, has_skip,
                     interpret, backend, sum_squares)
  return outs


def _forward(av_BTHd, v_BTHd, resid_H, skip_H, centre_H, addend_BTHd, has_skip, interpret,
             backend, sum_squares):
  """(out, or (out, sums [B, H, T]) with `sum_squares`; the backward's residuals)."""
  B, T, H, d = v_BTHd.shape
  addend = () if addend_BTHd is None else (addend_BTHd,)
  out_shapes = [jax.ShapeDtypeStruct(av_BTHd.shape, av_BTHd.dtype)]
  if sum_squares:
    out_shapes.append(jax.ShapeDtypeStruct((B, H, T), jnp.float32))
  if backend == "tpu":
    local = functools.partial(combine_kernel_tpu.forward_local, has_skip=has_skip,
                              interpret=interpret)
  else:
    local = _gpu_local(functools.partial(_forward_kernel, has_skip=has_skip,
                                         has_addend=bool(addend), has_sum_squares=sum_squares),
                       out_shapes, interpret=interpret)
  outs = _call(local, (av_BTHd, v_BTHd) + _gains_Hd((resid_H, skip_H, centre_H), d) + addend,
               out_shapes)
  # The addend rides along for its dtype only: the backward reads no element of it.
  return (tuple(outs) if sum_squares else outs[0],
          (av_BTHd, v_BTHd, resid_H, skip_H, centre_H, addend_BTHd))


def _backward(has_skip, interpret, backend, sum_squares, residuals, g):
  # The sums' cotangent is zero: causal_combine returns them through stop_gradient.
  g_BTHd = g[0] if sum_squares else g
  av_BTHd, v_BTHd, resid_H, skip_H, centre_H, addend_BTHd = residuals
  B, _, H, d = v_BTHd.shape
  sums = jax.ShapeDtypeStruct((B, H, d), jnp.float32)
  out_shapes = [jax.ShapeDtypeStruct(av_BTHd.shape, av_BTHd.dtype),
                jax.ShapeDtypeStruct(v_BTHd.shape, v_BTHd.dtype), sums, sums, sums]
  if backend == "tpu":
    local = functools.partial(combine_kernel_tpu.backward_local, has_skip=has_skip,
                              interpret=interpret)
  else:
    local = _gpu_local(functools.partial(_backward_kernel, has_skip=has_skip), out_shapes,
                       interpret=interpret)
  dav, dv, dresid, dskip, dcentre = _call(
      local, (g_BTHd.astype(av_BTHd.dtype), av_BTHd, v_BTHd)
      + _gains_Hd((resid_H, skip_H, centre_H), d), out_shapes)
  head_sum = lambda s_BHd, like: s_BHd.sum(axis=(0, 2)).astype(like.dtype)
  dskip_H = head_sum(dskip, skip_H) if has_skip else jnp.zeros_like(skip_H)
  d_addend = None if addend_BTHd is None else g_BTHd.astype(addend_BTHd.dtype)
  return dav, dv, head_sum(dresid, resid_H), dskip_H, head_sum(dcentre, centre_H), d_addend


_combine.defvjp(_forward, _backward)
