"""Crammed-BERT encoder with SAS blocks.

Bidirectional attention with a padding mask, MLM objective (masking rate 0.25), 16 layers,
D=768, AdamW betas (0.9, 0.98), eps 1e-12, clipping 0.5, peak lr 3e-3 (paper Sec. 5).

Pretrain (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/bert_sas.py:cpu --workdir=/tmp/bert_sas
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/bert_sas.py --workdir=/tmp/bert_sas

Expected: MLM loss falls steadily; GLUE average 78.4, throughput 1.09x bert_preln (paper Table 1).
"""
from . import base, sas


def get_config(arg: str = ""):
  c = sas.get_config(base.with_switch(arg, "encoder"))
  c.model.mlp_block_resid_gain = 0.05   # the paper's encoder value (16 layers)
  return c
