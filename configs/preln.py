"""Pre-LN baseline (the paper's reference block): RMSNorm before each sub-block, skips with gain 1,
plain N(0, 0.02) value and output projections.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256; 8m33s on
2 idle cores, 2026-12-07, ending at eval loss 1.481):
    python -m simplified_flax.train --config=configs/preln.py:cpu --workdir=/tmp/preln
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/preln.py --workdir=/tmp/preln

Expected: eval loss ~1.155 after 40K steps at the paper's shape (CodeParrot; the paper's
figure, Sec. 4).
Trainable parameters at the paper's shape with a 50K vocabulary: 166,645,248.
"""
from . import base


def get_config(arg: str = ""):
  c = base.get_config(arg)
  # Pre-LN is the base config unchanged.
  return c
