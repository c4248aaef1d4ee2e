"""OP block (Outlier-Protected, He et al. 2024): no block norms, per-head RMSNorm of queries and
keys, down-weighted residual branches.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/op.py:cpu --workdir=/tmp/op
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/op.py --workdir=/tmp/op

Expected: loss close to Pre-LN with far lower activation kurtosis (outlier features), as the
OP paper reports; docs/experiments.md has this code's CPU-scale run of it.
Trainable parameters at the paper's shape with a 50K vocabulary: 166,621,440.
"""
from . import base


def get_config(arg: str = ""):
  c = base.get_config(arg)
  c.model.norm_type = "none"
  c.model.qk_norm_type = "rmsnorm"
  c.model.attn_block_resid_gain = 0.2
  c.model.mlp_block_resid_gain = 0.2
  return c
