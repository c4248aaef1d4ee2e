"""The scanned layout of `model.scan_layers` (layer_stack.py): which layers one scan runs, the name
of the module that holds them (`h_<first>_to_<last>`, parameters with a leading layer axis),
and a params (or cache) tree between that layout and the unrolled one (`h_0`, `h_1`, ...),
exactly: for checkpoints and conversions, which hold one layout and load into the other.

Layer 0 (with `first_layer_value_resid_gain` or `norm_type="none"`) and the last (with
`last_layer_proj_resid_gain`) may differ from the rest and stay unrolled; fewer than two shared
layers: unrolled. Anchors keep their unrolled layout.
"""
import re
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from simplified_flax.model import valproj


def _signature(m, layer: int) -> Tuple[Any, ...]:
  """Everything a block's structure and constants depend on besides its weights."""
  first_norm = "ln" if (m.norm_type == "none" and layer == 0) else m.norm_type
  return (first_norm, valproj.value_settings(m, layer), valproj.proj_settings(m, layer))


def scanned_layers(m) -> Optional[range]:
  """The layers one scan runs (all but a differing first / last), or None: unrolled."""
  L = m.n_layer
  if not m.get("scan_layers", False) or L < 3:   # absent from configs saved before it
    return None
  shared = _signature(m, L // 2)
  first = 0 if _signature(m, 0) == shared else 1
  stop = L if _signature(m, L - 1) == shared else L - 1
  layers = range(first, stop)
  if len(layers) < 2 or any(_signature(m, l) != shared for l in layers):
    return None
  return layers


def stacked_name(layers: range) -> str:
  return f"h_{layers.start}_to_{layers.stop - 1}"


def layers_of(name: str) -> Optional[range]:
  """The layers module `name` holds: `h_3` -> range(3, 4), `h_1_to_16` -> range(1, 17)."""
  match = re.fullmatch(r"h_(\d+)(?:_to_(\d+))?", name)
  if match is None:
    return None
  return range(int(match.group(1)), int(match.group(2) or match.group(1)) + 1)


def stacked_anchors(anchors: Dict[str, Any], layers: range) -> Dict[str, jax.Array]:
  """{"value": [n, D, D], "proj": [n, D, D]} of `layers` (the keys they all have)."""
  entries = [anchors.get(f"layer_{l}", {}) for l in layers]
  return {key: jnp.stack([e[key] for e in entries]) for key in entries[0]}


def stack_layers(tree: Dict[str, Any], m) -> Dict[str, Any]:
  """An unrolled params/cache tree ({"h_0": ..., "h_1": ...}) in the scanned layout of `m`."""
  layers = scanned_layers(m)
  if layers is None:
    return dict(tree)
  out = {k: v for k, v in tree.items() if layers_of(k) is None or layers_of(k)[0] not in layers}
  out[stacked_name(layers)] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                           *[tree[f"h_{l}"] for l in layers])
  return out


def unstack_layers(tree: Dict[str, Any], m) -> Dict[str, Any]:
  """The inverse of `stack_layers`: a scanned tree in the unrolled layout."""
  layers = scanned_layers(m)
  if layers is None:
    return dict(tree)
  out = {k: v for k, v in tree.items() if k != stacked_name(layers)}
  stacked = tree[stacked_name(layers)]
  for i, l in enumerate(layers):
    out[f"h_{l}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return out
