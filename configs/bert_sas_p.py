"""Crammed-BERT encoder with SAS-P blocks.

Bidirectional attention with a padding mask, MLM objective (masking rate 0.25), 16 layers,
D=768, AdamW betas (0.9, 0.98), eps 1e-12, clipping 0.5, peak lr 3e-3 (paper Sec. 5).

Pretrain (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/bert_sas_p.py:cpu --workdir=/tmp/bert_sas_p
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/bert_sas_p.py --workdir=/tmp/bert_sas_p

Expected: MLM loss falls steadily; GLUE average 78.3, throughput 1.16x bert_preln (paper Table 1).
"""
from . import base, sas_p


def get_config(arg: str = ""):
  c = sas_p.get_config(base.with_switch(arg, "encoder"))
  c.model.mlp_block_resid_gain = 0.05   # the paper's encoder value (16 layers)
  return c
