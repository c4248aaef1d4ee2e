"""Per-layer Value / Proj settings and their fixed anchor matrices W0 (docs/model.md, "Value
and Proj", the W0 of Eq. (7)).

The anchors are drawn once, at init, by `anchor_matrices` for the whole stack, because
`tie_valproj_init` couples them across modules and across layers:
  * "all_blocks": each block's Proj anchor is its Value anchor transposed;
  * "last_block": the last Proj anchor undoes the product of every earlier Value/Proj anchor,
    so the fixed part of the whole value path is the identity at init.
"""
import dataclasses
from typing import Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

TIE_MODES = ("none", "all_blocks", "last_block")


@dataclasses.dataclass(frozen=True)
class LinearSettings:
  resid_gain: float
  skip_gain: Optional[float]
  init_type: str
  trainable_gains: bool
  init_std: Optional[float]

  @property
  def form(self) -> str:
    """"plain", "identity" or "reparam" (docs/model.md, "Value and Proj")."""
    if self.skip_gain is None:
      return "plain"
    if self.skip_gain == 1 and self.resid_gain == 0 and self.init_type == "id":
      return "identity"
    return "reparam"


def value_settings(m, layer: int) -> LinearSettings:
  resid = m.value_resid_gain
  if layer == 0 and m.first_layer_value_resid_gain is not None:
    resid = m.first_layer_value_resid_gain
  return LinearSettings(resid_gain=resid, skip_gain=m.value_skip_gain,
                        init_type=m.val_init_type, trainable_gains=m.trainable_value_gains,
                        init_std=m.val_proj_init_std)


def proj_settings(m, layer: int) -> LinearSettings:
  resid = m.proj_resid_gain
  if layer == m.n_layer - 1 and m.last_layer_proj_resid_gain is not None:
    resid = m.last_layer_proj_resid_gain
  return LinearSettings(resid_gain=resid, skip_gain=m.proj_skip_gain,
                        init_type=m.proj_init_type, trainable_gains=m.trainable_proj_gains,
                        init_std=m.val_proj_init_std)


def anchor_matrix(key, init_type: str, dim: int) -> jax.Array:
  """A fixed W0 (Eq. (7)): identity, random orthogonal or N(0, 1/D)."""
  if init_type == "id":
    return jnp.eye(dim, dtype=jnp.float32)
  if init_type == "orth":
    return nn.initializers.orthogonal()(key, (dim, dim), jnp.float32)
  assert init_type == "normal", init_type
  return jax.random.normal(key, (dim, dim), jnp.float32) * dim ** -0.5


def anchor_matrices(key, m) -> Dict[str, Dict[str, jax.Array]]:
  """{"layer_<l>": {"value": W0, "proj": W0}} for every reparameterised Value/Proj."""
  D = m.n_embd
  anchors = {}
  running_DD = jnp.eye(D, dtype=jnp.float32)   # product of the fixed matrices so far
  for layer in range(m.n_layer):
    key, value_key, proj_key = jax.random.split(key, 3)
    v_set, p_set = value_settings(m, layer), proj_settings(m, layer)
    entry = {}
    value_DD = proj_DD = jnp.eye(D, dtype=jnp.float32)
    if v_set.form == "reparam":
      value_DD = entry["value"] = anchor_matrix(value_key, v_set.init_type, D)
    if p_set.form == "reparam":
      proj_DD = anchor_matrix(proj_key, p_set.init_type, D)
      if m.tie_valproj_init == "all_blocks":
        proj_DD = value_DD.T
      elif m.tie_valproj_init == "last_block" and layer == m.n_layer - 1:
        proj_DD = jnp.linalg.inv(running_DD @ value_DD)
      entry["proj"] = proj_DD
    running_DD = running_DD @ value_DD @ proj_DD
    if entry:
      anchors[f"layer_{layer}"] = entry
  return anchors
