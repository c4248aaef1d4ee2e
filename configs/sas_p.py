"""SAS-P: SAS in the parallel layout, with no skip connection at all.

Train (CPU-sized; 7m42s on 2 idle cores, corpus preparation included, 2026-12-07, ending at
eval loss 1.778 after its 1,000 steps):
    python -m simplified_flax.train --config=sas_p:cpu --workdir=/tmp/sas_p
Paper shape (L=18, D=768, H=12, T=128, batch 128, 40K steps) on an accelerator host:
    python -m simplified_flax.train --config=configs/sas_p.py --workdir=/tmp/sas_p

Expected: close to Pre-LN per step, throughput 1.16x Pre-LN (paper Table 1).
Trainable parameters at the paper's shape with a 50K vocabulary: 146,002,094.

The paper's own data and recipe (the `codeparrot` switch, any decoder config;
docs/huggingface.md, "The paper's data"): CodeParrot, the code-search-net tokenizer, one
epoch of 100K documents' full 128-token windows, bf16:
    python -m simplified_flax.train --config=sas_p:codeparrot --workdir=/tmp/sas_p_cp
    python -m simplified_flax.train --config=preln:codeparrot --workdir=/tmp/preln_cp
Expected (paper Fig. 1 / Sec. 4): SAS-P's loss per step matches Pre-LN's at 18 layers with 12%
fewer trainable parameters (146.0M vs 166.6M; 16% fewer without the embeddings).
"""
from . import sas


def get_config(arg: str = ""):
  c = sas.get_config(arg)
  c.model.parallel_layers = True
  c.model.mlp_block_skip_gain = 0.0
  return c
