"""The stack of blocks: unrolled (one module per layer, `h_<l>`), or scanned (`model.scan_layers`).

Scanned, the layers that share their structure run as one `nn.scan` (parameters with a leading
layer axis): one block body compiled at any depth. Layer 0 (with `first_layer_value_resid_gain`
or `norm_type="none"`) and the last (with `last_layer_proj_resid_gain`) may differ and stay
outside under their unrolled names; the run between is one module `h_<first>_to_<last>`
(`h_1_to_17` for SAS-P at 18 layers). Fewer than two shared layers: unrolled. Anchors keep their
unrolled layout; `model.remat` rematerialises each block, and without it `model.scan_residuals`
says what the scanned backward keeps (`SCAN_RESIDUALS`). `stack_layers` / `unstack_layers`
convert a params (or cache) tree between the layouts exactly.
"""
import functools
import re
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from simplified_flax.model import block
from simplified_flax.model import valproj

# model.scan_residuals: what a scanned block keeps for the backward, per layer (without remat).
#  "matmuls": the outputs of its matmuls and attention kernels, as the unrolled program keeps
#    them; the elementwise rest (norms, casts, activations, the shaping terms) is recomputed
#    inside the backward's loop, where XLA fuses it into the kernels that read it.
#  "all": JAX's default for a scan, every intermediate the backward reads, float32 norm and
#    shaping terms included, each written to a stacked [layers, ...] buffer. On the H200, SAS-P
#    at the paper's shape: 14.3 GiB of temporaries against 6.9 for "matmuls" (unrolled: 8.3).
SCAN_RESIDUALS = ("matmuls", "all")
# The attention kernels' forward primitives (cuDNN's; splash and other Pallas kernels): their
# outputs are kept like a matmul's, so that the backward never runs the forward kernel again.
KERNEL_PRIMITIVES = frozenset({"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper",
                               "pallas_call"})


def keep_matmuls_and_kernels(prim, *avals, **params) -> bool:
  """The remat policy of scan_residuals="matmuls": keep an output of a matmul (any
  dot_general, batched ones included: the explicit path's scores) or of an attention kernel."""
  return (prim.name in KERNEL_PRIMITIVES
          or jax.checkpoint_policies.checkpoint_dots(prim, *avals, **params))


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


@functools.lru_cache(maxsize=None)
def layer_step(block_class: type) -> type:
  """`block_class` (`block.Block` or a class with its call) as a scan step: (x, per-layer
  inputs) -> (x, x or None); `train` and whether to emit the hidden state are attributes,
  since scan and remat take only arrays."""

  class LayerStep(block_class):
    train: bool = False
    emit_hidden: bool = False

    def __call__(self, x_BTD, anchors, key_mask, segment_ids, cache_index, lengths):
      out_BTD = super().__call__(x_BTD, anchors, key_mask=key_mask, segment_ids=segment_ids,
                                 train=self.train, cache_index=cache_index, lengths=lengths)
      return out_BTD, (out_BTD if self.emit_hidden else None)

  LayerStep.__name__ = LayerStep.__qualname__ = f"LayerStep[{block_class.__name__}]"
  return LayerStep


LayerStep = layer_step(block.Block)


def run_blocks(parent: nn.Module, m, x_BTD, anchors: Dict[str, Any], *, causal: bool, dtype,
               key_mask, segment_ids, train: bool, cache_index, lengths):
  """x [B, T, D] through every block, as submodules of `parent` (a compact Transformer; its
  `block_class()` with `block_attributes()`), sowing each block's output as "hidden" in
  `intermediates`, layer by layer, in order."""
  scanned = scanned_layers(m)
  step_class, extra = layer_step(parent.block_class()), parent.block_attributes()
  emit = parent.is_mutable_collection("intermediates")
  # Under scan, CSE cannot undo the rematerialisation, so it need not be prevented.
  remat = m.get("remat", False)
  if remat:
    scan_step = nn.remat(step_class, prevent_cse=False)
  elif m.get("scan_residuals", "matmuls") == "matmuls":   # absent from configs saved before it
    scan_step = nn.remat(step_class, prevent_cse=False, policy=keep_matmuls_and_kernels)
  else:
    scan_step = step_class
  per_layer = (key_mask, segment_ids, cache_index, lengths)
  layer = 0
  while layer < m.n_layer:
    if scanned is not None and layer == scanned.start:
      stack = nn.scan(scan_step, variable_axes={"params": 0, "intermediates": 0, "cache": 0},
                      split_rngs={"params": True, "dropout": True},
                      in_axes=(0,) + (nn.broadcast,) * 4, length=len(scanned))
      x_BTD, hidden_LBTD = stack(m, layer, causal, dtype, train=train, emit_hidden=emit,
                                 name=stacked_name(scanned), **extra)(
          x_BTD, stacked_anchors(anchors, scanned), *per_layer)
      for i in range(len(scanned) if emit else 0):
        parent.sow("intermediates", "hidden", hidden_LBTD[i])
      layer = scanned.stop
      continue
    unrolled_step = nn.remat(step_class) if remat else step_class
    x_BTD, _ = unrolled_step(m, layer, causal, dtype, train=train, name=f"h_{layer}", **extra)(
        x_BTD, anchors.get(f"layer_{layer}", {}), *per_layer)
    parent.sow("intermediates", "hidden", x_BTD)
    layer += 1
  return x_BTD


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
