"""Crammed-BERT encoder with SAS-P blocks and no block norms (only layer 0's input LayerNorm
and the final LayerNorm remain).

Bidirectional attention with a padding mask, MLM objective (masking rate 0.25), 16 layers,
D=768, AdamW betas (0.9, 0.98), eps 1e-12, clipping 0.5; peak lr 2e-3, the paper's value
without norms (3e-3 for the normed encoders) (paper Sec. 5; docs/model.md, "Training settings").

Pretrain (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=configs/bert_sas_p_nonorm.py:cpu --workdir=/tmp/bert_nonorm
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/bert_sas_p_nonorm.py --workdir=/tmp/bert_nonorm

Expected: MLM loss falls, throughput 1.20x bert_preln; fine-tuning can diverge (the paper
reports NaNs), which `simplified_flax.finetune` stops with the training loop's non-finite-loss
error, naming the step.
"""
from . import base, sas_p


def get_config(arg: str = ""):
  c = sas_p.get_config(base.with_switch(arg, "encoder"))
  c.model.norm_type = "none"
  c.model.mlp_block_resid_gain = 0.05   # the paper's encoder value (16 layers)
  c.optimizer.learning_rate = 2e-3      # the paper's encoder lr without norms
  return c
