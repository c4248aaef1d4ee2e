"""SAS-P with Dynamic Tanh in place of every norm (DyT: Zhu, Chen, He, LeCun, Liu, "Transformers
without Normalization", CVPR 2025): the block's one read norm and the final LayerNorm become
`gamma * tanh(alpha * x) + beta` (their Eq. (1)), with the authors' language-model recipe
(`preln_dyt.use_authors_lm_recipe`: a learnable scalar from sqrt(D) times the embedding,
alpha_0 per norm). Between SAS-P (RMSNorm) and SAS-P without norms: an elementwise squashing,
no statistics over D.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=sas_p_dyt:cpu --workdir=/tmp/sas_p_dyt
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 2.970 ±
0.080 at 4e-3 (8e-3: 3.220, two seeds at the plateau) against Pre-LN's 2.341 ± 0.010: +0.629
[+0.407, +0.851], higher; SAS-P itself 2.380. The `cpu` run measured 3.309, the unigram plateau,
before the recipe (docs/adding_a_variant.md, "Measured"), and has not been rerun.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/sas_p_dyt.py --workdir=/tmp/sas_p_dyt

The speed package has not verified `norm_type="dyt"`: the run builds the reference model and
logs one line saying so (docs/fast.md).
"""
from . import preln_dyt
from . import sas_p


def get_config(arg: str = ""):
  c = sas_p.get_config(arg)
  preln_dyt.use_authors_lm_recipe(c.model, "dyt")
  return c
