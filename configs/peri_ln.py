"""Peri-LN: Pre-LN with a norm on each sub-layer's output as well (Kim, Lee, Park, Oh, Kim, Yoo,
Shin, Han, Shin, Yoo, "Peri-LN: Revisiting Normalization Layer in the Transformer
Architecture", ICML 2025, arXiv 2502.02732): x = x + Norm_out(F(Norm_in(x))) for the attention
and the MLP, and the embedding normed before the first block, the final norm kept. Every norm
is an RMSNorm (`norm_type`), scale initialised to 1 (docs/model.md, "Peri-LN";
docs/beyond_the_paper.md, "Peri-LN").

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=peri_ln:cpu --workdir=/tmp/peri_ln
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 2.352 ±
0.018 at 2e-3 against Pre-LN's 2.341 ± 0.010 at 1e-3: +0.011 [-0.029, +0.051], not separated.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/peri_ln.py --workdir=/tmp/peri_ln

The speed package has not verified `norm_position="peri"`: the run builds the reference model
and logs one line saying so (docs/fast.md).
"""
from . import preln


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  c.model.norm_position = "peri"
  return c
