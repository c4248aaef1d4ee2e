"""Naive skipless: Pre-LN with the attention skip simply removed -- the failure case that the
paper's signal-propagation fixes exist for.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/naive_skipless.py:cpu --workdir=/tmp/naive_skipless
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/naive_skipless.py --workdir=/tmp/naive_skipless

Expected: trains markedly worse than Pre-LN (the paper's motivating failure).
Trainable parameters at the paper's shape with a 50K vocabulary: 166,645,248.
"""
from . import base


def get_config(arg: str = ""):
  c = base.get_config(arg)
  c.model.attn_block_skip_gain = 0.0
  return c
