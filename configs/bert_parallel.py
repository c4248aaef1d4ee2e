"""Crammed-BERT encoder with Parallel (GPT-J) blocks: one norm feeds attention and MLP.

Bidirectional attention with a padding mask, MLM objective (masking rate 0.25), 16 layers,
D=768, AdamW betas (0.9, 0.98), eps 1e-12, clipping 0.5, peak lr 3e-3 (paper Sec. 5).

Pretrain (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/bert_parallel.py:cpu --workdir=/tmp/bert_parallel
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/bert_parallel.py --workdir=/tmp/bert_parallel
Fine-tune on a GLUE task (docs/encoders.md, "Fine-tuning on a GLUE task"):
    python -m simplified_flax.finetune --config=configs/bert_parallel.py \
        --pretrained_workdir=/tmp/bert_parallel --task=sst2 --workdir=/tmp/bert_parallel_sst2

Expected: MLM loss falls steadily; GLUE average 78.5, throughput 1.05x bert_preln (paper Table 1).
"""
from . import base, parallel


def get_config(arg: str = ""):
  c = parallel.get_config(base.with_switch(arg, "encoder"))
  return c
