"""The optimisers (docs/model.md, "Training settings"): gradient clipping, then the direction
`optimizer.name` names, with one schedule and one weight-decay mask (decoupled decay):
  adamw  the paper's AdamW, the default;
  muon   Muon (`optax.contrib.scale_by_muon`) on every weight matrix (a `kernel` with >= 2 axes,
         the last two [fan_in, fan_out]), rescaled to AdamW's RMS (`optimizer.muon_rms`) so one
         learning rate serves both; embeddings, norms and gains keep AdamW's direction.
Two model settings change the optimiser (docs/training.md, "Optimisers"):
  model.depth_mup_alpha  CompleteP (Dey et al. 2025, Table 1): inside the residual blocks the
         learning rate times m_L^(alpha - 1), and AdamW's eps times m_L^-alpha in every
         parameter group, as their code scales it (`depth_mup_scales`);
  model.ngpt  nGPT: after every update each weight matrix and table is renormalised along the
         embedding dimension (`renormalized`, model/ngpt.py), as part of the step.
Master weights, gradients and optimiser state are float32; `accumulate_gradients` sums
micro-batches.
"""
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from simplified_flax.model import ngpt
from simplified_flax.model import scan_layout
from simplified_flax.runs.config_checks import OPTIMIZERS, SCHEDULES

GAIN_SUFFIX = "_gain"   # trainable gains: never decayed, logged by diagnostics.gain_metrics


def warmup_steps(opt_config, num_train_steps: int) -> int:
  """`optimizer.warmup_steps` when set, else `warmup_fraction * num_train_steps` (rounded)."""
  if opt_config.warmup_steps is not None:
    return int(opt_config.warmup_steps)
  return int(round(opt_config.warmup_fraction * num_train_steps))


def make_schedule(opt_config, num_train_steps: int) -> optax.Schedule:
  """lr(count), count the updates already applied: warm-up `0 -> learning_rate` over
  `warmup_steps`, then linear (the paper's) or cosine to 0 at `num_train_steps`, rsqrt
  (`learning_rate * sqrt(warmup / count)`, `1 / sqrt(count)` without warm-up) or constant."""
  peak = float(opt_config.learning_rate)
  kind = opt_config.schedule
  warm = warmup_steps(opt_config, num_train_steps)
  decay_span = max(num_train_steps - warm, 1)
  if kind not in SCHEDULES:
    raise ValueError(f"optimizer.schedule={kind!r} is unknown: use one of {list(SCHEDULES)}.")

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    warm_factor = jnp.minimum(step / warm, 1.0) if warm > 0 else 1.0
    progress = jnp.clip((step - warm) / decay_span, 0.0, 1.0)
    if kind == "linear":
      decay = 1.0 - progress
    elif kind == "cosine":
      decay = 0.5 * (1.0 + jnp.cos(math.pi * progress))
    elif kind == "rsqrt":
      decay = jax.lax.rsqrt(jnp.maximum(step, max(warm, 1)) / max(warm, 1))
    else:
      decay = 1.0
    return peak * warm_factor * decay

  return schedule


def leaf_names(path) -> tuple[str, ...]:
  """A pytree key path as names, e.g. ("h_0", "attn", "c_attn", "kernel")."""
  return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def leaf_gets_decay(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` (module names..., leaf name) is weight-decayed: kernels
  and embeddings are, norm scales/biases and gains not; another leaf name is an error."""
  if path[-1] in ("kernel", "embedding"):
    return True
  if path[-1] in ("scale", "bias") or path[-1].endswith(GAIN_SUFFIX):
    return False
  raise ValueError(
      f"Parameter {'/'.join(path)!r} has a leaf name the weight-decay mask does not know: "
      f"name dense weights 'kernel', embeddings 'embedding', norm parameters 'scale'/'bias' "
      f"and gains '*{GAIN_SUFFIX}', or extend "
      f"simplified_flax.training.optimizer.leaf_gets_decay.")


def decay_mask(params) -> Any:
  """A pytree of bools matching `params`: True where weight decay applies."""
  return jax.tree_util.tree_map_with_path(lambda path, _: leaf_gets_decay(leaf_names(path)),
                                          params)


def muon_matrix(path: tuple[str, ...], leaf) -> bool:
  """Whether Muon orthogonalises the leaf at `path`: a weight matrix (or a stack of them)."""
  return path[-1] == "kernel" and getattr(leaf, "ndim", 0) >= 2


def _muon_labels(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: "muon" if muon_matrix(leaf_names(path), x) else "adam", params)


def _muon_dimension_numbers(params):
  """Reduction / output axes of every Muon leaf; `params` holds MaskedNode elsewhere (how
  `optax.partition` hands a transformation its own leaves only)."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return jax.tree.map(
      lambda x: x if masked(x) else optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1),
      params, is_leaf=masked)


def scale_to_rms(rms: float) -> optax.GradientTransformation:
  """Each orthogonalised [.., fan_in, fan_out] update (entries of RMS 1/sqrt(max(fan_in,
  fan_out))) times sqrt(max(fan_in, fan_out)) * rms: RMS `rms`, as AdamW's roughly is (Liu et
  al. 2025, "Muon is scalable")."""
  def scale(updates, params=None):
    del params
    return jax.tree.map(lambda u: u * (max(u.shape[-2:]) ** 0.5 * rms), updates)
  return optax.stateless(scale)


def muon(o, learning_rate: optax.Schedule) -> optax.GradientTransformation:
  """Muon on the matrices, AdamW on the rest; masked decoupled decay on both (as AdamW's)."""
  matrices = optax.chain(
      optax.contrib.scale_by_muon(beta=o.get("muon_beta", 0.95), nesterov=True,
                                  weight_dimension_numbers=_muon_dimension_numbers),
      scale_to_rms(o.get("muon_rms", 0.2)))
  direction = optax.partition(
      {"muon": matrices, "adam": optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)},
      _muon_labels)
  return optax.chain(direction, optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
                     optax.scale_by_learning_rate(learning_rate))


def depth_mup_scales(model_config) -> tuple[float, float]:
  """(learning-rate factor, eps factor) under CompleteP's rules (Dey et al. 2025, Table 1,
  depth terms; this code scales no width), m_L = n_layer / depth_mup_base_layers: m_L^(alpha
  - 1) for the learning rate of the blocks' weights, biases and norm gains (1 at alpha = 1),
  and m_L^-alpha for AdamW's eps in every group, as the authors' `configure_optimizers` scales
  its one `adam_eps` (EleutherAI/nanoGPT-mup, branch completep, model.py). (1, 1) without
  `model.depth_mup_alpha`. Embeddings, the final norm and the head keep the base learning
  rate; the initial values (the depth terms of Table 1 leave every init variance alone) and
  the weight decay (Table 1 scales it with width only) are unchanged."""
  alpha = model_config.get("depth_mup_alpha")
  if alpha is None:   # absent from configs saved before it
    return 1.0, 1.0
  m_L = model_config.n_layer / model_config.depth_mup_base_layers
  return float(m_L ** (alpha - 1)), float(m_L ** -alpha)


def in_residual_block(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` belongs to a residual block (`h_<l>`, or a scanned stack
  `h_<a>_to_<b>`): Table 1's "hidden" and "Pre-LN" groups."""
  return scan_layout.layers_of(path[0]) is not None


def _adamw(o, learning_rate, eps: float) -> optax.GradientTransformation:
  return optax.adamw(learning_rate, b1=o.b1, b2=o.b2, eps=eps, weight_decay=o.weight_decay,
                     mask=decay_mask)


def depth_mup_adamw(o, schedule: optax.Schedule, lr_scale: float,
                    eps_scale: float) -> optax.GradientTransformation:
  """AdamW with the residual blocks' learning rate times `lr_scale` and every group's eps times
  `eps_scale` (two parameter groups, as `depth_mup_scales` gives them); decoupled decay as
  AdamW's (times each group's learning rate, as torch's AdamW groups do)."""
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "blocks" if in_residual_block(leaf_names(path)) else "rest", params)
  blocks = _adamw(o, lambda count: schedule(count) * lr_scale, o.eps * eps_scale)
  rest = _adamw(o, schedule, o.eps * eps_scale)
  return optax.partition({"blocks": blocks, "rest": rest}, labels)


def renormalized(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx`, then each weight matrix and table projected back to unit norm along the embedding
  dimension (nGPT, `ngpt.embedding_axis`): its update u becomes `Norm(p + u) - p`, so that
  `optax.apply_updates` lands on the sphere (to float32 round-off); the learnable scales keep
  theirs. Part of the optimiser, hence of every step, its checkpoints and their resumption."""
  def project(path, u, p):
    axis = ngpt.embedding_axis(leaf_names(path))
    return u if axis is None else ngpt.unit_norm(p + u, axis).astype(p.dtype) - p

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("nGPT's renormalisation needs the parameters: pass them to update().")
    updates, state = tx.update(updates, state, params)
    return jax.tree_util.tree_map_with_path(project, updates, params), state
  return optax.GradientTransformation(tx.init, update)


def make_optimizer(config) -> optax.GradientTransformation:
  """Global-norm clipping (when `optimizer.grad_clip_norm` > 0), then `optimizer.name`
  (with CompleteP's per-group scales under `model.depth_mup_alpha`), then nGPT's
  renormalisation under `model.ngpt`."""
  o = config.optimizer
  name = o.get("name", "adamw")   # configs saved before the field existed: adamw
  schedule = make_schedule(o, config.num_train_steps)
  m = config.get("model") or {}   # an optimiser's config alone: no model settings
  lr_scale, eps_scale = depth_mup_scales(m)
  if name == "adamw" and m.get("depth_mup_alpha") is not None:
    tx = depth_mup_adamw(o, schedule, lr_scale, eps_scale)
  elif name == "adamw":
    tx = _adamw(o, schedule, o.eps)
  elif name == "muon":
    tx = muon(o, schedule)
  else:
    raise ValueError(f"optimizer.name={name!r} is unknown: use one of {list(OPTIMIZERS)}.")
  if o.grad_clip_norm and o.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), tx)
  return renormalized(tx) if m.get("ngpt", False) else tx


def micro_batches(batch: dict, num_micro: int) -> dict:
  """[B, ...] leaves -> [k, B/k, ...]; micro-batch i holds rows i, i+k, ... (strided: each
  stays evenly sharded along the batch axis)."""
  def split(x):
    if x.shape[0] % num_micro:
      raise ValueError(f"A batch of {x.shape[0]} rows does not split into grad_accum_steps="
                       f"{num_micro} micro-batches.")
    return jnp.swapaxes(x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def accumulate_gradients(sum_grad_fn: Callable, params, batch: dict, num_micro: int):
  """Sums `sum_grad_fn(params, micro_batch, index) -> (grads, sums)` over `num_micro` parts:
  for gradients of a *sum* over rows, `sum_grad_fn` of the whole batch up to summation order."""
  if num_micro == 1:
    return sum_grad_fn(params, batch, jnp.int32(0))
  parts = micro_batches(batch, num_micro)

  def body(carry, xs):
    index, micro = xs
    grads, sums = sum_grad_fn(params, micro, index)
    return jax.tree.map(jnp.add, carry, (grads, sums)), None

  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(sum_grad_fn, params, jax.tree.map(lambda x: x[0], parts),
                                      jnp.int32(0)))
  total, _ = jax.lax.scan(body, zeros, (jnp.arange(num_micro, dtype=jnp.int32), parts))
  return total
