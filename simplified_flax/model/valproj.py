"""Per-layer Value / Proj settings and their fixed anchor matrices W0 (Eq. (7); docs/model.md,
"Value and Proj"). The anchors are drawn once, at init, for the whole stack, because
`tie_valproj_init` couples them: "all_blocks" makes each Proj anchor its Value anchor
transposed; "last_block" makes the last Proj anchor undo the product of every earlier one.
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
  first = layer == 0 and m.first_layer_value_resid_gain is not None
  return LinearSettings(m.first_layer_value_resid_gain if first else m.value_resid_gain,
                        m.value_skip_gain, m.val_init_type, m.trainable_value_gains,
                        m.val_proj_init_std)


def proj_settings(m, layer: int) -> LinearSettings:
  last = layer == m.n_layer - 1 and m.last_layer_proj_resid_gain is not None
  return LinearSettings(m.last_layer_proj_resid_gain if last else m.proj_resid_gain,
                        m.proj_skip_gain, m.proj_init_type, m.trainable_proj_gains,
                        m.val_proj_init_std)


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
