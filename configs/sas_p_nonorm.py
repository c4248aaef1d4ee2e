"""SAS-P without normalisation: no block norms (only layer 0's input LayerNorm and the final
LayerNorm remain).

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/sas_p_nonorm.py:cpu --workdir=/tmp/sas_p_nonorm
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/sas_p_nonorm.py --workdir=/tmp/sas_p_nonorm

Expected: eval loss ~1.245 after 40K steps at the paper's shape; throughput 1.20x Pre-LN (the
paper's figures, Sec. 4 and Table 1).
Trainable parameters at the paper's shape with a 50K vocabulary: 145,975,982.
"""
from . import sas_p


def get_config(arg: str = ""):
  c = sas_p.get_config(arg)
  c.model.norm_type = "none"
  return c
