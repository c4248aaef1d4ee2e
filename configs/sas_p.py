"""SAS-P: SAS in the parallel layout, with no skip connection at all.

Train (CPU-sized, about 5 minutes on 2 idle cores; eval loss about 1.78 after its 1,000 steps):
    python -m simplified_flax.train --config=sas_p:cpu --workdir=/tmp/sas_p
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/sas_p.py --workdir=/tmp/sas_p

Expected: close to Pre-LN per step, throughput 1.16x Pre-LN (paper Table 1).
Trainable parameters at the paper's shape with a 50K vocabulary: 146,002,094.
"""
from . import sas


def get_config(arg: str = ""):
  c = sas.get_config(arg)
  c.model.parallel_layers = True
  c.model.mlp_block_skip_gain = 0.0
  return c
