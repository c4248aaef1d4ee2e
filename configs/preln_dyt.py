"""Pre-LN with Dynamic Tanh in place of every norm (DyT: Zhu, Chen, He, LeCun, Liu, "Transformers
without Normalization", CVPR 2025): each RMSNorm of the block, and the final LayerNorm, becomes
`gamma * tanh(alpha * x) + beta` (their Eq. (1)), alpha a learnable scalar from 0.5, gamma ones,
beta zeros (docs/model.md, "Norms"; docs/adding_a_variant.md walks through this change).

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=preln_dyt:cpu --workdir=/tmp/preln_dyt
Measured (docs/adding_a_variant.md, "Measured"): MEASURED_PRELN_DYT
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/preln_dyt.py --workdir=/tmp/preln_dyt

The speed package has not verified `norm_type="dyt"`: the run builds the reference model and
logs one line saying so (docs/fast.md).
"""
from . import preln


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  c.model.norm_type = "dyt"
  return c
