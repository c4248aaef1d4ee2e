"""Value-SkipInit: SAS's shaped attention matrix, but value and output projections are plain
orthogonally initialised linears.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/value_skipinit.py:cpu --workdir=/tmp/value_skipinit
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/value_skipinit.py --workdir=/tmp/value_skipinit

Expected: throughput 0.95x Pre-LN (paper Table 1); slightly behind SAS per step.
Trainable parameters at the paper's shape with a 50K vocabulary: 166,645,950 (the authors' code
counts 18 more: docs/building.md, "Parameter counts").
"""
from . import sas


def get_config(arg: str = ""):
  c = sas.get_config(arg)
  c.model.value_skip_gain = None
  c.model.val_init_type = "orth"
  c.model.first_layer_value_resid_gain = None
  return c
