"""Crammed-BERT encoder with Value-SkipInit blocks: shaped attention, plain orthogonal
value and output projections.

Bidirectional attention with a padding mask, MLM objective (masking rate 0.25), 16 layers,
D=768, AdamW betas (0.9, 0.98), eps 1e-12, clipping 0.5, peak lr 3e-3 (paper Sec. 5).

Pretrain (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/bert_value_skipinit.py:cpu --workdir=/tmp/bert_vsi
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/bert_value_skipinit.py --workdir=/tmp/bert_vsi
Fine-tune on a GLUE task (docs/encoders.md, "Fine-tuning on a GLUE task"):
    python -m simplified_flax.finetune --config=configs/bert_value_skipinit.py \
        --pretrained_workdir=/tmp/bert_vsi --task=sst2 --workdir=/tmp/bert_vsi_sst2

Expected: MLM loss falls steadily; GLUE average 78.0, throughput 0.95x bert_preln (paper Table 1).
"""
from . import base, value_skipinit


def get_config(arg: str = ""):
  c = value_skipinit.get_config(base.with_switch(arg, "encoder"))
  c.model.mlp_block_resid_gain = 0.05   # the paper's encoder value (16 layers)
  return c
