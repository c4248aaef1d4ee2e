"""SAS-P with Dynamic Tanh in place of every norm (DyT: Zhu, Chen, He, LeCun, Liu, "Transformers
without Normalization", CVPR 2025): the block's one read norm and the final LayerNorm become
`gamma * tanh(alpha * x) + beta` (their Eq. (1)), alpha a learnable scalar from 0.5. Between
SAS-P (RMSNorm) and SAS-P without norms: an elementwise squashing, no statistics over D.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=sas_p_dyt:cpu --workdir=/tmp/sas_p_dyt
Measured (2026-12-07, 2 idle cores; docs/adding_a_variant.md, "Measured"): eval loss 3.309
after 1,000 steps (perplexity 27.4, the unigram plateau it never leaves), against SAS-P's
1.778 and Pre-LN's 1.481; about 2,950 tokens/s (727 s) against SAS-P's 4,500-4,900.
alpha_0 = 0.5 is the paper's default; its LLaMA code sets alpha_0 per norm and by width.
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
