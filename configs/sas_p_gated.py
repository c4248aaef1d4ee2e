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
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 2.309 ±
0.016 at 8e-3 (1.6e-2: 2.501) against Pre-LN's 2.341 ± 0.010 at 1e-3: -0.032 [-0.086, +0.023],
not separated; SAS-P without the gate 2.380 ± 0.010 at 4e-3. With 150 steps (2026-12-07, before
the sweep bracketed its bests) it read below Pre-LN at L=2, D=64 (followups_small) and at L=4,
D=128 (followups_half_steps).
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
