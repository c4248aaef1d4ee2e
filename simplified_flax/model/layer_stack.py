"""The stack of blocks: unrolled (one module per layer, `h_<l>`), or scanned (`model.scan_layers`):
the layers that share their structure run as one `nn.scan` (parameters with a leading layer
axis), one block body compiled at any depth; which layers, and the scanned module's name
(`h_1_to_17` for SAS-P at 18 layers), are scan_layout.py's. `model.remat` rematerialises each
block; without it `model.scan_residuals` says what the scanned backward keeps."""
import functools
from typing import Any, Dict

import flax.linen as nn

from simplified_flax.model import scan_layout

# model.scan_residuals: what a scanned block keeps for the backward, per layer (without remat).
#  "matmuls": its matmuls' outputs (the parent's `remat_policy()`), as the unrolled program
#    keeps them; the elementwise rest is recomputed inside the backward's loop, fused into the
#    kernels that read it. "all": JAX's default, every intermediate the backward reads, each in
#    a stacked [layers, ...] buffer (SAS-P on the H200 at the paper's shape: 14.3 GiB of
#    temporaries against 6.9 for "matmuls"; docs/model.md, "Scanned layers").
SCAN_RESIDUALS = ("matmuls", "all")


@functools.lru_cache(maxsize=None)
def layer_step(block_class: type) -> type:
  """`block_class` (with `block.Block`'s call) as a scan step: (x, per-layer inputs) -> (x, x
  or None); `train` and whether to emit the hidden state are attributes (scan takes arrays)."""

  class LayerStep(block_class):
    train: bool = False
    emit_hidden: bool = False

    def __call__(self, x_BTD, anchors, key_mask, segment_ids, cache_index, lengths):
      out_BTD = super().__call__(x_BTD, anchors, key_mask=key_mask, segment_ids=segment_ids,
                                 train=self.train, cache_index=cache_index, lengths=lengths)
      return out_BTD, (out_BTD if self.emit_hidden else None)

  LayerStep.__name__ = LayerStep.__qualname__ = f"LayerStep[{block_class.__name__}]"
  return LayerStep


def run_blocks(parent: nn.Module, m, x_BTD, anchors: Dict[str, Any], *, causal: bool, dtype,
               key_mask, segment_ids, train: bool, cache_index, lengths):
  """x [B, T, D] through every block, as submodules of `parent` (a compact Transformer: its
  `block_class()` with `block_attributes()`, its `remat_policy()`), sowing each block's
  output as "hidden" in `intermediates`, in order."""
  scanned = scan_layout.scanned_layers(m)
  step_class, extra = layer_step(parent.block_class()), parent.block_attributes()
  emit = parent.is_mutable_collection("intermediates")
  # Under scan, CSE cannot undo the rematerialisation, so it need not be prevented.
  remat = m.get("remat", False)
  if remat:
    scan_step = nn.remat(step_class, prevent_cse=False)
  elif m.get("scan_residuals", "matmuls") == "matmuls":   # absent from configs saved before it
    scan_step = nn.remat(step_class, prevent_cse=False, policy=parent.remat_policy())
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
                                 name=scan_layout.stacked_name(scanned), **extra)(
          x_BTD, scan_layout.stacked_anchors(anchors, scanned), *per_layer)
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
