"""Pre-LN with gated attention (Qiu, Wang, Zheng, Huang, Wen, Yang, Men, Yu, Huang, Huang, Liu,
Zhou, Lin, "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
Attention-Sink-Free", NeurIPS 2025, arXiv 2505.06708): the attention output, before the
output projection, times an elementwise, head-specific, query-dependent gate, their best
position G1: Proj(sigmoid(x W_g + b_g) * SDPA(q, k, v)), x the attention sub-block's (normed)
input, W_g [D, D] N(0, 0.02) and b_g [D] zeros: in the authors' code (qiuzh20/gated_attention,
modeling_qwen3.py) the gate is the second half of the q projection's output and shares its
bias flag, and q has a bias here (docs/model.md, "Gated attention";
docs/beyond_the_paper.md, "Gated attention").

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=preln_gated:cpu --workdir=/tmp/preln_gated
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 2.255 ±
0.018 at 2e-3 against Pre-LN's 2.341 ± 0.010 at 1e-3: -0.086 [-0.110, -0.062], lower.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/preln_gated.py --workdir=/tmp/preln_gated

The speed package has not verified `attn_output_gate=True`: the run builds the reference model
and logs one line saying so (docs/fast.md).
"""
from . import preln


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  c.model.attn_output_gate = True
  return c
