"""SAS (Simplified Attention Sub-block): shaped attention, no attention-block skip, value and
output projections fixed to the identity (only layer 0 keeps a trainable value matrix).

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/sas.py:cpu --workdir=/tmp/sas
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/sas.py --workdir=/tmp/sas

Expected: matches Pre-LN per step (paper Fig. 2), ~15% fewer parameters, throughput 1.09x Pre-LN.
Trainable parameters at the paper's shape with a 50K vocabulary: 146,002,112 (the authors' code
counts 146,002,130: docs/building.md, "Parameter counts", explains the 18).
"""
from . import base


def get_config(arg: str = ""):
  c = base.get_config(arg)
  m = c.model
  m.attn_block_skip_gain = 0.0
  m.mlp_block_resid_gain = 0.1      # O(1/sqrt(L)): the paper's value at L=18
  m.centre_attn = True
  m.attn_mat_skip_gain = 1.0
  m.value_resid_gain = 0.0
  m.value_skip_gain = 1.0
  m.first_layer_value_resid_gain = 1.0
  m.val_init_type = "id"
  m.query_init_std = 0.0
  m.trainable_attn_block_gains = True
  m.trainable_mlp_block_gains = True
  m.trainable_attn_mat_gains = True
  m.trainable_value_gains = True
  return c
