"""Crammed-BERT encoder with Pre-LN blocks (the paper's encoder baseline).

Bidirectional attention with a padding mask, MLM objective (masking rate 0.25), 16 layers,
D=768, AdamW betas (0.9, 0.98), eps 1e-12, clipping 0.5, peak lr 3e-3 (paper Sec. 5).

Pretrain (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/bert_preln.py:cpu --workdir=/tmp/bert_preln
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/bert_preln.py --workdir=/tmp/bert_preln

Expected: MLM loss falls steadily; GLUE average 78.9 (paper Table 1, crammed BERT, 24 h on one GPU).
"""
from . import base, preln


def get_config(arg: str = ""):
  c = preln.get_config(base.with_switch(arg, "encoder"))
  return c
