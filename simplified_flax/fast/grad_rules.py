"""Hand-written gradient rules that change speed, never values (`model.grad_rules`).

Each gives autodiff's gradients in an order or a form that a compiler lowers better:
  dense  (CPU) the kernel gradient as `(dy^T x)^T` rather than `x^T dy`, a matrix product
         on XLA:CPU, not a strided loop (a fifth of a Pre-LN step at D=768; float32
         round-off);
  gains  (CPU) each per-head gain's gradient of the shaped attention as a row sum before the
         (B, Q) sum (a few percent of a SAS step; float32 round-off);
  relu   (GPU) the zero-slope leaky ReLU as `max(x, 0)` with leaky_relu's own derivative
         (bit for bit, 1 at x = 0, as the authors' `torch.where(x >= 0, x, 0 * x)`): XLA:GPU
         fuses a `max` into the GEMM that reads the activation, but not leaky_relu's select,
         which costs a read and a write of every [B, T, 4D] activation (-3.6 GB per step at
         the paper's shape on an H200, read from the compiled program).
  split  (GPU) c_attn's q and k. Where the attention's kernel takes them as arrays of their
         own (cuDNN: the fused path) and each device has at least 4,096 tokens (`Block`
         decides; with fewer the second weight-gradient GEMM costs more than the copies
         save), as two GEMMs, each taking its bias as one more row of its
         kernel against a column of ones appended to the input (`[x, 1, 0..] @ [W; b; 0..]`),
         kept apart by an optimization barrier on each one's operands (XLA's dot merger would
         join them again). Autodiff's one GEMM for both writes [B, T, 2D] and copies q and k
         out dense for cuDNN with the bias add, and its backward concatenates dq and dk back
         and sums them again for the bias; here the bias's gradient is a row of the weight
         gradient's GEMM. At the paper's shape on an H200: -0.79 ms of Pre-LN's step (its
         value GEMM, merged with c_attn, was sliced out too), -0.60 ms of SAS's and SAS-P's;
         float32 round-off, in bfloat16 q and k rounded once where the bias add rounded twice.
         The ones-column input is kept for the backward (+0.4 GiB a device for Pre-LN).
         Elsewhere (the explicit path, whose score GEMM reads the halves in place) the one
         GEMM's split with an optimization barrier on its tangent, so that the backward
         concatenates dq and dk once: XLA:GPU otherwise makes that concatenation twice, for
         the input's gradient and again for the weight gradient (-0.71 ms of explicit SAS-P's
         step; bit for bit).
  combine (GPU, TPU) the fused form's causal combine `beta A v + alpha v - gamma C v` and
         its backward as one Pallas kernel each (`combine_kernel.py`; Mosaic kernels of their
         own on a TPU, `combine_kernel_tpu.py`): C v and C^T g stay on chip and the gain
         gradients are the backward's row sums, where XLA writes the float32 C v out and
         reads it back in kernels of its own (-2.8 GB per step for SAS-P at the paper's
         shape on an H200, -2.9 GB per chip on a v5e-8; float32 round-off); in a parallel
         block the kernels also take the block's sum with the MLP branch. Where "on"
         applies it on a CPU, the kernels run in Pallas interpret mode (slow; for tests).
  skip   (GPU) a trainable block skip gain's gradient, sum(g * x) over [B, T, D], as a sum
         over B and T held by an optimization barrier, then over D. Where x is the combine
         kernels' output (SAS's MLP skip; `Block` decides), XLA:GPU then computes the
         per-feature sums in the column-reduction kernel that already takes norm2's weight
         gradient from the same g and x, where the single full sum needs a kernel of its own
         that reads both again (-0.9 GB per step for SAS at the paper's shape on an H200;
         float32 round-off). After a GEMM or the explicit form it made a kernel of its own
         (+0.9 GB for Value-SkipInit and explicit SAS), so it is not applied there.
  norm_stats (GPU) where an RMS norm reads the combine kernels' output itself (SAS's norm2:
         no attention skip, the identity projection; `Block` decides), the forward kernel
         also writes each token's sum of squares of its rounded result per head ([B, H, T]
         float32), and the norm takes its root mean square from them, where XLA makes them
         in a reduction kernel that reads the whole output again (-0.45 GB and -0.09 ms a step
         for SAS on an H200 at the paper's shape). The norm's gradient is the plain norm's
         (`layers.rms_norm`): its backward takes the sums from x again, in the reduction over
         x and g that it makes anyway (float32 round-off: the sums are associated otherwise).
  relu_matmul (GPU) the MLP's zero-slope ReLU and c_proj as `relu(h) @ W`, whose backward
         takes leaky_relu's derivative inside the GEMM that makes the input's gradient
         (`relu_matmul_kernel.py`: `dh = (g W^T) * [h >= 0]`, one Pallas kernel), where
         XLA:GPU writes `g W^T` [B, T, 4D] and reads it back with h in a kernel of its own
         (-5.4 GB and -1.13 ms a step in every variant at the paper's shape on an H200;
         float32 round-off of the sum's order). `mlp.fuses_relu` decides (bfloat16 on a
         GPU, the gain inside W, no fake quantisation, shapes the tiles divide).
  out_gain (TPU) a trainable scalar gain on a linear layer's output, `gain * (x @ W)` (the
         MLP's block gain where it stays out of W_proj), with the gain's gradient taken as
         sum(x * (g W^T)) from the layer's input and the input-gradient product the backward
         makes anyway, where autodiff's sum(g * (x @ W)) keeps the layer's output for the
         backward: written to HBM and read back, [B, T, D] each way per layer (-0.11 GB a chip
         for SAS-P on a v5e-8 at the paper's shape; bfloat16 round-off of the products).
         `Block` applies it with the fused form's kernels only (explicit SAS-P: +0.09 GB).

The mode is chosen once per model (`model.grad_rules`): "auto" applies each rule on the platform
named above, where it was measured to help (the platform the step is compiled for); "on"
applies all; "off" none (the reference model, simplified_flax/model). "auto" or "on" may name
rules to leave out, each after a comma and a minus, e.g. "auto,-relu_matmul": the rest as the
mode says, those never (to measure one rule on a device, or to drop one that does not pay
there). `plan.choose` turns the mode into a `Plan`'s rules; the fast modules read the plan
they are given, and the functions here apply their rule unconditionally.
"""
import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

MODES = ("auto", "on", "off")
# Where "auto" applies each rule.
AUTO_PLATFORM = {"dense": ("cpu",), "gains": ("cpu",), "relu": ("gpu",), "split": ("gpu",),
                 "combine": ("gpu", "tpu"), "skip": ("gpu",), "out_gain": ("tpu",),
                 "norm_stats": ("gpu",), "relu_matmul": ("gpu",)}


def mode_of(model_config) -> str:
  """The config's mode ("auto" for configs saved before the field existed)."""
  return model_config.get("grad_rules", "auto")


def parse(mode: str) -> tuple[str, frozenset]:
  """("auto" | "on" | "off", the rules left out) of a mode such as "auto,-relu_matmul"; a
  ValueError names what is wrong and what is allowed."""
  base, *rest = str(mode).split(",")
  if base not in MODES:
    raise ValueError(f"model.grad_rules={mode!r} is unknown: use one of {list(MODES)}, 'auto' "
                     f"and 'on' optionally followed by ',-RULE' for each rule to leave out.")
  items = [item.strip() for item in rest]
  left_out = frozenset(item[1:] for item in items)
  if (rest and base == "off") or any(item[:1] != "-" for item in items) or (
      left_out - AUTO_PLATFORM.keys()):
    raise ValueError(f"model.grad_rules={mode!r}: rules are left out as ',-RULE' after 'auto' "
                     f"or 'on', RULE one of {sorted(AUTO_PLATFORM)}.")
  return base, left_out


def leaky_relu(x, negative_slope: float) -> jax.Array:
  """`jax.nn.leaky_relu(x, negative_slope)`; at slope 0 as `relu` (the `relu` rule)."""
  return relu(x) if negative_slope == 0 else jax.nn.leaky_relu(x, negative_slope)


@jax.custom_jvp
def relu(x):
  """`leaky_relu(x, 0)` computed as `max(x, 0)`, with leaky_relu's own derivative."""
  return jnp.maximum(x, jnp.zeros((), x.dtype))


@relu.defjvp
def _relu_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  return relu(x), jax.jvp(lambda x: jax.nn.leaky_relu(x, 0.0), (x,), (dx,))[1]


def biased_halves(x_ND, kernel_DF, bias_F, *, separate: bool, product=jnp.dot):
  """`jnp.split(x @ kernel + bias, 2, axis=-1)` for x [N.., D], kernel [D, F], bias [F], with
  the `split` rule: `separate`, each half a GEMM (`product`) of its own with its bias inside;
  else the one GEMM's halves, the split's tangent held."""
  if not separate:
    return _held_split(product(x_ND, kernel_DF) + bias_F)
  D = x_ND.shape[-1]
  # One column of ones for the bias, then zeros to a multiple of 8: the tensor cores'
  # bfloat16 granule of the contracted width (769 would leave every row misaligned).
  pad = -(D + 1) % 8
  x_NA = jnp.concatenate([x_ND, jnp.ones(x_ND.shape[:-1] + (1,), x_ND.dtype),
                          jnp.zeros(x_ND.shape[:-1] + (pad,), x_ND.dtype)], axis=-1)
  kernel_AF = jnp.concatenate([kernel_DF, bias_F[None],
                               jnp.zeros((pad, kernel_DF.shape[1]), kernel_DF.dtype)], axis=0)
  halves = []
  for kernel_AH in jnp.split(kernel_AF, 2, axis=-1):
    # Distinct operands per GEMM, else XLA's dot merger makes the two one GEMM again.
    held_x_NA, held_kernel_AH = jax.lax.optimization_barrier((x_NA, kernel_AH))
    halves.append(product(held_x_NA, held_kernel_AH))
  return tuple(halves)


@jax.custom_jvp
def _held_split(x_ND):
  return tuple(jnp.split(x_ND, 2, axis=-1))


@_held_split.defjvp
def _held_split_jvp(primals, tangents):
  (x_ND,), (dx_ND,) = primals, tangents
  return _held_split(x_ND), tuple(jnp.split(jax.lax.optimization_barrier(dx_ND), 2, axis=-1))


@jax.custom_jvp
def scaled_skip(gain, x_BTD):
  """`gain * x` for a scalar gain (float32) and x [..., D], with the `skip` rule; forward and
  reverse mode alike."""
  return gain * x_BTD


def _scaled_skip_jvp(primals, tangents):
  gain, x_BTD = primals
  d_gain, dx_BTD = tangents
  y_BTD = gain * x_BTD
  dy_BTD = jnp.zeros_like(y_BTD)
  if _present(dx_BTD):
    dy_BTD = dy_BTD + gain * dx_BTD
  if _present(d_gain):
    # Transposed, the barrier keeps the sum over B and T apart from the sum over D: XLA would
    # otherwise merge the two into one full reduction.
    d_gain_D = jax.lax.optimization_barrier(jnp.broadcast_to(d_gain, x_BTD.shape[-1:]))
    dy_BTD = dy_BTD + d_gain_D * x_BTD
  return y_BTD, dy_BTD


scaled_skip.defjvp(_scaled_skip_jvp, symbolic_zeros=True)


@jax.custom_jvp
def gained_matmul(gain, x_NF, kernel_FD):
  """`gain * (x @ kernel)`, [..., F] x [F, D] -> [..., D] in x's dtype promoted with the
  gain's, for a scalar gain; with the `out_gain` rule."""
  return gain * jnp.dot(x_NF, kernel_FD)


def _gained_matmul_jvp(primals, tangents):
  gain, x_NF, kernel_FD = primals
  d_gain, dx_NF, d_kernel_FD = tangents
  y_ND = gain * jnp.dot(x_NF, kernel_FD)
  # The gain's and the input's tangents go through W in one product, (d_gain x + gain dx) W:
  # transposed, the backward makes z = g W^T once, the input's gradient gain * z, the gain's
  # sum(x * z), and never needs x W.
  through_kernel_NF = jnp.zeros(x_NF.shape, y_ND.dtype)
  if _present(dx_NF):
    through_kernel_NF = through_kernel_NF + gain * dx_NF
  if _present(d_gain):
    through_kernel_NF = through_kernel_NF + d_gain * x_NF
  dy_ND = jnp.dot(through_kernel_NF.astype(x_NF.dtype), kernel_FD).astype(y_ND.dtype)
  if _present(d_kernel_FD):
    dy_ND = dy_ND + gain * jnp.dot(x_NF, d_kernel_FD)
  return y_ND, dy_ND


gained_matmul.defjvp(_gained_matmul_jvp, symbolic_zeros=True)


def _present(tangent) -> bool:
  """A symbolic-zero tangent (an input not differentiated) costs nothing."""
  return tangent is not None and not isinstance(tangent, SymbolicZero)


@jax.custom_jvp
def dense(x_ND, kernel_DF):
  """`x @ kernel`, [..., D] x [D, F] -> [..., F], with the kernel-gradient rule above."""
  return jnp.dot(x_ND, kernel_DF)


def _dense_jvp(primals, tangents):
  x_ND, kernel_DF = primals
  dx_ND, dkernel_DF = tangents
  y_NF = jnp.dot(x_ND, kernel_DF)
  dy_NF = jnp.zeros_like(y_NF)
  if _present(dx_ND):
    dy_NF = dy_NF + jnp.dot(dx_ND, kernel_DF)
  if _present(dkernel_DF):
    x_2D = x_ND.reshape(-1, x_ND.shape[-1])
    dy_NF = dy_NF + jnp.dot(dkernel_DF.T, x_2D.T).T.reshape(y_NF.shape)
  return y_NF, dy_NF


dense.defjvp(_dense_jvp, symbolic_zeros=True)


def fast_gain_gradients(shape):
  """`shape(logits_BHQK, resid_H, terms) -> (A', A)` (`attention.shape_attention_matrix`,
  A' = resid * softmax(logits) + the sum of gain * matrix over the `terms`) with the gain rule
  above, for any number of terms. The matrices are constants: their tangents are ignored."""
  @jax.custom_jvp
  def fast_shape(logits_BHQK, resid_H, terms):
    return shape(logits_BHQK, resid_H, terms)

  def jvp(primals, tangents):
    _, resid_H, terms = primals
    d_logits_BHQK, d_resid_H, d_terms = tangents
    shaped_BHQK, probs_BHQK = shape(*primals)
    B, H, Q, _ = probs_BHQK.shape
    per_row = lambda d_gain_H: jnp.broadcast_to(d_gain_H[None, :, None], (B, H, Q))[..., None]
    d_probs_BHQK = jnp.zeros_like(probs_BHQK)
    if _present(d_logits_BHQK):   # the softmax's own JVP
      d_probs_BHQK = probs_BHQK * (
          d_logits_BHQK - jnp.sum(probs_BHQK * d_logits_BHQK, axis=-1, keepdims=True))
    d_shaped_BHQK = resid_H.reshape(-1, 1, 1) * d_probs_BHQK
    if _present(d_resid_H):
      d_shaped_BHQK = d_shaped_BHQK + per_row(d_resid_H) * probs_BHQK
    for (_, matrix), (d_gain_H, _) in zip(terms, d_terms):
      if _present(d_gain_H):
        d_shaped_BHQK = d_shaped_BHQK + per_row(d_gain_H) * matrix
    return (shaped_BHQK, probs_BHQK), (d_shaped_BHQK, d_probs_BHQK)

  fast_shape.defjvp(jvp, symbolic_zeros=True)
  return fast_shape
