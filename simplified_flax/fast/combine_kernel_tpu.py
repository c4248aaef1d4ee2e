"""The causal combine's kernels for a TPU (Pallas on Mosaic): the sums of combine_kernel.py,

    out = beta * (A v) + alpha * v - gamma * (C v),   (C v)_t = mean of v over times <= t,

where A v, v and their gradients stay in the layout of the splash attention kernel, [B, H, T,
d] (A v read as splash writes it, v as splash reads it, d(A v) and dv written as splash's
backward reads them: no layout copy by XLA), and the result, a parallel block's MLP branch
and the block's gradient g in the residual stream's [B, T, D] (a form wholly in [B, T, D]
cost a layout copy of A v and v each way; one wholly in [B, H, T, d] a float32 transpose of
the result). A TPU block's last two dimensions are whole (8, 128) tiles, so each program owns
one chunk of CHUNK times of k heads of one sequence: [k, CHUNK, d] and [CHUNK, k d], k heads
filling 128 lanes (`heads_per_program`). The grid is (B, H / k, T / CHUNK), time sequential:
the forward carries the sum of v over earlier chunks in VMEM, the backward walks the chunks
from the last and carries the sum of g_t / t over later ones.

Within a chunk the prefix sums are matmuls on the MXU with a 0/1 triangle (bfloat16 products
exact, float32 sums; float32 operands at full precision), where XLA's TPU cumulative sum moves
[B, T, H, d] in float32 through layout copies (experiments/results/compiled/tpu_log.md). The
backward's gain gradients are per-lane sums [B, H, 1, d] that the caller folds to [H].

`forward_local` and `backward_local` are combine_kernel's per-shard calls: [B, T, H, d] in and
out, gains [H, d], sums [B, H, d]. `interpret=True` runs them on any backend (tests).
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

CHUNK = 128   # times per step: one MXU pass, and splash attention's tile (T % 128 == 0)
TILE = (8, 128)   # a TPU's tile of the last two dimensions


def supported(v_BTHd) -> bool:
  """Whether the kernels take values of this shape: CHUNK divides T."""
  return v_BTHd.shape[1] % CHUNK == 0


def _triangle(c, *, lower: bool, dtype):
  """[c, c] 0/1: ones where row >= column (lower) or row <= column (upper)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  return (rows >= cols if lower else rows <= cols).astype(dtype)


def _matmul(a_cc, x_cD):
  """float32 a @ x: bfloat16 operands exact in the MXU's float32 sums; float32 at full
  precision (the MXU's default passes would round them to bfloat16)."""
  precision = (jax.lax.Precision.HIGHEST if x_cD.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  return jnp.dot(a_cc, x_cD, preferred_element_type=jnp.float32, precision=precision)


def _positions(chunk_index, c):
  """float32 [c, 1]: the 1-based times of the chunk (C's row counts)."""
  times_c1 = chunk_index * c + 1 + jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  return times_c1.astype(jnp.float32)


def _forward_kernel(av_ref, v_ref, resid_ref, skip_ref, centre_ref, *refs, has_skip,
                    has_addend):
  """One chunk of k heads: A v and v [k, c, d], gains [k, 1, d], the addend and the result
  [c, k d] (the heads side by side, as [B, T, D] lays them); the running sums [k, 1, d]."""
  addend_ref, out_ref, earlier_ref = refs if has_addend else (None,) + refs
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    earlier_ref[...] = jnp.zeros_like(earlier_ref)

  heads, c, d = v_ref.shape
  outs = []
  for h in range(heads):
    v_cd = v_ref[h]
    sums_cd = _matmul(_triangle(c, lower=True, dtype=v_cd.dtype), v_cd) + earlier_ref[h]
    v_cd = v_cd.astype(jnp.float32)
    earlier_ref[h] += jnp.sum(v_cd, axis=0, keepdims=True)
    out_cd = resid_ref[h] * av_ref[h].astype(jnp.float32)
    if has_skip:
      out_cd = out_cd + skip_ref[h] * v_cd
    outs.append(out_cd + centre_ref[h] * -(sums_cd / _positions(n, c)))
  out_cD = outs[0] if heads == 1 else jnp.concatenate(outs, axis=-1)
  if has_addend:
    out_cD = out_cD + addend_ref[...].astype(jnp.float32)
  out_ref[...] = out_cD.astype(out_ref.dtype)


def _backward_kernel(g_ref, av_ref, v_ref, resid_ref, skip_ref, centre_ref,
                     dav_ref, dv_ref, dresid_ref, dskip_ref, dcentre_ref, later_ref, *,
                     has_skip):
  """One chunk of k heads: g [c, k d], A v and v [k, c, d] in, d(A v) and dv [k, c, d] out,
  the gain gradients' running sums [k, 1, d] and the later chunks' sum of g_t / t."""
  j = pl.program_id(2)
  i = pl.num_programs(2) - 1 - j   # this chunk: the last first

  @pl.when(j == 0)
  def _():
    for ref in (later_ref, dresid_ref, dskip_ref, dcentre_ref):
      ref[...] = jnp.zeros_like(ref)

  heads, c, d = v_ref.shape
  g_cD = g_ref[...].astype(jnp.float32)
  for h in range(heads):
    g_cd = g_cD[:, h * d:(h + 1) * d]
    v_cd = v_ref[h].astype(jnp.float32)
    w_cd = g_cd / _positions(i, c)
    # (C^T g)_s = sum over t >= s of g_t / t: this chunk's part, then the later chunks'.
    ctg_cd = _matmul(_triangle(c, lower=False, dtype=jnp.float32), w_cd) + later_ref[h]
    later_ref[h] += jnp.sum(w_cd, axis=0, keepdims=True)
    dv_cd = -centre_ref[h] * ctg_cd
    if has_skip:
      dv_cd = skip_ref[h] * g_cd + dv_cd
      dskip_ref[h] += jnp.sum(g_cd * v_cd, axis=0, keepdims=True)
    dav_ref[h] = (resid_ref[h] * g_cd).astype(dav_ref.dtype)
    dv_ref[h] = dv_cd.astype(dv_ref.dtype)
    dresid_ref[h] += jnp.sum(g_cd * av_ref[h].astype(jnp.float32), axis=0, keepdims=True)
    dcentre_ref[h] -= jnp.sum(ctg_cd * v_cd, axis=0, keepdims=True)


def _padded_bytes(shape, dtype):
  """Bytes of a [..., m, n] array in HBM, its last two dimensions padded to whole tiles."""
  *rest, m, n = shape
  tiles = -(-m // TILE[0]) * TILE[0] * -(-n // TILE[1]) * TILE[1]
  size = tiles
  for r in rest:
    size *= r
  return size * jnp.dtype(dtype).itemsize


def heads_per_program(H, d):
  """k: the fewest heads whose values fill whole lanes (k d a multiple of 128) where H has
  them, else all H (a [c, k d] block is then the whole of D, which a TPU also takes)."""
  k = 1 if d % TILE[1] == 0 else (TILE[1] // d if TILE[1] % d == 0 else H)
  return k if H % k == 0 else H


def _pallas(kernel, inputs, out_shapes, *, reverse: bool, interpret: bool):
  """`kernel` over the grid (B, H / k, T / CHUNK): each program one chunk of times of k heads
  of one sequence (the last chunk first where `reverse`); [B, H, T, d] arrays as [k, c, d]
  blocks, [B, T, D] ones as [c, k d], gains [H, 1, d] and sums [B, H, 1, d] by head."""
  B, H, T, d = next(x.shape for x in inputs if x.ndim == 4)
  k, num_chunks = heads_per_program(H, d), T // CHUNK
  time = (lambda j: num_chunks - 1 - j) if reverse else (lambda j: j)
  specs = {
      "BHTd": pl.BlockSpec((None, k, CHUNK, d), lambda b, g, j: (b, g, time(j), 0)),
      "BTD": pl.BlockSpec((None, CHUNK, k * d), lambda b, g, j: (b, time(j), g)),
      "gains": pl.BlockSpec((k, 1, d), lambda b, g, j: (g, 0, 0)),
      "sums": pl.BlockSpec((None, k, 1, d), lambda b, g, j: (b, g, 0, 0))}
  kind = lambda x: ("BTD" if x.ndim == 3 and x.shape[1] == T else "gains" if x.ndim == 3
                    else "sums" if x.shape[2] == 1 else "BHTd")
  cost = pl.CostEstimate(   # what the kernel reads and writes once, tiles padded; its matmuls
      flops=2 * B * H * T * CHUNK * d, transcendentals=0,
      bytes_accessed=sum(_padded_bytes(x.shape, x.dtype) for x in list(inputs) + out_shapes))
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shapes), grid=(B, H // k, num_chunks),
      in_specs=[specs[kind(x)] for x in inputs],
      out_specs=tuple(specs[kind(s)] for s in out_shapes),
      scratch_shapes=[pltpu.VMEM((k, 1, d), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=cost, name=f"shaped_combine_{'backward' if reverse else 'forward'}",
      interpret=interpret)(*inputs)


def _heads_first(x_BTHd):
  """[B, H, T, d]: splash's layout (XLA cancels it against splash's own transposes)."""
  return jnp.swapaxes(x_BTHd, 1, 2)


def _flat(x_BTHd):
  """[B, T, D]: a free reshape."""
  B, T, H, d = x_BTHd.shape
  return x_BTHd.reshape(B, T, H * d)


def _by_head(*gains_Hd):
  """Gains [H, d] as [H, 1, d]."""
  return [g[:, None, :] for g in gains_Hd]


def forward_local(av_BTHd, v_BTHd, resid_Hd, skip_Hd, centre_Hd, *addend_BTHd, has_skip,
                  interpret):
  """(out [B, T, H, d] in A v's dtype,): combine_kernel's forward on one shard."""
  kernel = functools.partial(_forward_kernel, has_skip=has_skip, has_addend=bool(addend_BTHd))
  inputs = ([_heads_first(av_BTHd), _heads_first(v_BTHd)]
            + _by_head(resid_Hd, skip_Hd, centre_Hd) + [_flat(a) for a in addend_BTHd])
  out_BTD = _pallas(kernel, inputs, [jax.ShapeDtypeStruct(_flat(av_BTHd).shape, av_BTHd.dtype)],
                    reverse=False, interpret=interpret)[0]
  return (out_BTD.reshape(av_BTHd.shape),)


def backward_local(g_BTHd, av_BTHd, v_BTHd, resid_Hd, skip_Hd, centre_Hd, *, has_skip,
                   interpret):
  """(d(A v), dv [B, T, H, d], d resid, d skip, d centre [B, H, d] per-lane sums):
  combine_kernel's backward on one shard."""
  B, T, H, d = v_BTHd.shape
  kernel = functools.partial(_backward_kernel, has_skip=has_skip)
  inputs = ([_flat(g_BTHd), _heads_first(av_BTHd), _heads_first(v_BTHd)]
            + _by_head(resid_Hd, skip_Hd, centre_Hd))
  sums = jax.ShapeDtypeStruct((B, H, 1, d), jnp.float32)
  outs = _pallas(kernel, inputs,
                 [jax.ShapeDtypeStruct((B, H, T, d), av_BTHd.dtype),
                  jax.ShapeDtypeStruct((B, H, T, d), v_BTHd.dtype), sums, sums, sums],
                 reverse=True, interpret=interpret)
  return tuple(_heads_first(x) for x in outs[:2]) + tuple(s[:, :, 0] for s in outs[2:])
