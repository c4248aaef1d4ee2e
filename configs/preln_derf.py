"""Pre-LN with Dynamic erf in place of every norm (Derf: Chen, Lu, Zhu, Sun, Liu, "Stronger
Normalization-Free Transformers", CVPR 2026, arXiv 2512.10938): each RMSNorm of the block, and
the final LayerNorm, becomes `gamma * erf(alpha * x + s) + beta`, elementwise with no statistic
over D; alpha and s learnable scalars from alpha_0 and 0, gamma [D] ones, beta [D] zeros
(docs/model.md, "Norms"; docs/beyond_the_paper.md, "Derf"), trained as the authors train a
language model (their nanoGPT patch): a learnable scalar from sqrt(D) times the embedding and
alpha_0 per norm, 1.0 each (`preln_dyt.use_authors_lm_recipe`).

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=preln_derf:cpu --workdir=/tmp/preln_derf
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 3.073 ±
0.090 at 1e-3 (5e-4: 3.100; at 4e-3 every seed stays at the unigram plateau, 3.34) against
Pre-LN's 2.341 ± 0.010: +0.732 [+0.491, +0.973], higher. Without the embedding scalar it never
left the plateau at any rate.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/preln_derf.py --workdir=/tmp/preln_derf

The speed package has not verified `norm_type="derf"`: the run builds the reference model and
logs one line saying so (docs/fast.md).
"""
from . import preln
from . import preln_dyt


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  preln_dyt.use_authors_lm_recipe(c.model, "derf")
  return c
