"""Pre-LN with Dynamic Tanh in place of every norm (DyT: Zhu, Chen, He, LeCun, Liu, "Transformers
without Normalization", CVPR 2025): each RMSNorm of the block, and the final LayerNorm, becomes
`gamma * tanh(alpha * x) + beta` (their Eq. (1)), alpha a learnable scalar from 0.5, gamma ones,
beta zeros (docs/model.md, "Norms"; docs/adding_a_variant.md walks through this change).

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=preln_dyt:cpu --workdir=/tmp/preln_dyt
Measured (2026-12-07, 2 idle cores; docs/adding_a_variant.md, "Measured"): eval loss 3.310
after 1,000 steps (perplexity 27.4, the unigram plateau it never leaves), against Pre-LN's
1.481 and SAS-P's 1.778; about 2,650 tokens/s against Pre-LN's 4,000-4,300 on the fast path.
alpha_0 = 0.5 is the paper's default; its LLaMA code sets alpha_0 per norm and by width.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/preln_dyt.py --workdir=/tmp/preln_dyt

The speed package has not verified `norm_type="dyt"`: the run builds the reference model and
logs one line saying so (docs/fast.md).
"""
from . import preln

# alpha_0 of the attention norms, the MLP norms and the final norm: both authors' language-model
# code defaults (DyT: jiachenzhu/DyT, other_tasks/LLaMA/fms_fsdp/models/llama.py, LLaMAConfig;
# Derf: zlab-princeton/Derf, "language model/model_derf.patch", GPTConfig). Their LLaMA README
# tunes them only at D >= 4096 (7B: 0.8 / 0.2 / 0.2; 13B: 0.6 / 0.15 / 0.15; 34B and 70B:
# 0.2 / 0.05 / 0.05), smaller the wider the model; none of those widths is run here.
AUTHORS_LM_ALPHA_INIT = {"attn": 1.0, "mlp": 1.0, "final": 1.0}


def use_authors_lm_recipe(m, norm_type: str) -> None:
  """`norm_type` ("dyt" or "derf") in place of every norm, as both authors train a language
  model: a learnable scalar from sqrt(D) times the embedding (llama.py's `shared_scale`;
  the Derf patch's `shared_scale`, which multiplies token plus position embedding as here)
  and alpha_0 per norm (`AUTHORS_LM_ALPHA_INIT`)."""
  m.norm_type = norm_type
  m.embedding_scale = "learned"
  for where, alpha in AUTHORS_LM_ALPHA_INIT.items():
    m[f"alpha_init_{where}_norm"] = alpha


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  use_authors_lm_recipe(c.model, "dyt")
  return c
