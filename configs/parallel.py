"""Parallel (GPT-J) block: one norm feeds both the attention and the MLP branch.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/parallel.py:cpu --workdir=/tmp/parallel
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/parallel.py --workdir=/tmp/parallel

Expected: throughput 1.05x Pre-LN (paper Table 1); loss close to Pre-LN.
Trainable parameters at the paper's shape with a 50K vocabulary: 166,645,248.
"""
from . import base


def get_config(arg: str = ""):
  c = base.get_config(arg)
  c.model.parallel_layers = True
  c.model.attn_block_skip_gain = 0.0
  return c
