"""SAS-P with gated attention (Qiu et al., "Gated Attention for Large Language Models:
Non-linearity, Sparsity, and Attention-Sink-Free", NeurIPS 2025, arXiv 2505.06708): the shaped
attention's output times sigmoid(x W_g + b_g), elementwise and per head, before the (here
identity) output projection, x the block's normed input, W_g [D, D] N(0, 0.02) and b_g [D]
zeros (their gate is part of the q projection and shares its bias flag; q has one). Qiu et al.
credit the gate with a non-linearity between the value and output projections, the path
SAS removes; this config asks whether the gate still helps without it (docs/model.md, "Gated
attention"; docs/beyond_the_paper.md, "Gated attention").

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=sas_p_gated:cpu --workdir=/tmp/sas_p_gated
Measured (2026-12-07, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its best of learning rates 1e-3/2e-3/4e-3): eval loss 2.317 ± 0.023
at 4e-3 (the grid's edge) against Pre-LN's 2.341 ± 0.009: -0.024 [-0.073, +0.026], not
separated; SAS-P without the gate 2.380 ± 0.010. With 150 steps it is below Pre-LN, by 0.112
[0.078, 0.145] at L=2, D=64 (followups_small) and 0.113 [0.074, 0.152] at L=4, D=128
(followups_half_steps): the verdict depends on the scale.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/sas_p_gated.py --workdir=/tmp/sas_p_gated

The speed package has not verified `attn_output_gate=True`: the run builds the reference model
and logs one line saying so (docs/fast.md).
"""
from . import sas_p


def get_config(arg: str = ""):
  c = sas_p.get_config(arg)
  c.model.attn_output_gate = True
  return c
