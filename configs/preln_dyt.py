"""Pre-LN with Dynamic Tanh in place of every norm (DyT: Zhu, Chen, He, LeCun, Liu, "Transformers
without Normalization", CVPR 2025): each RMSNorm of the block, and the final LayerNorm, becomes
`gamma * tanh(alpha * x) + beta` (their Eq. (1)), alpha a learnable scalar, gamma ones, beta
zeros (docs/model.md, "Norms"; docs/adding_a_variant.md walks through this change), trained as
the authors train a language model: a learnable scalar from sqrt(D) times the embedding and
alpha_0 per norm (`use_authors_lm_recipe` below; both fields cite the code they come from).

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=preln_dyt:cpu --workdir=/tmp/preln_dyt
At the follow-ups comparison's shape:
    python -m simplified_flax.train --config=preln_dyt:cpu --workdir=/tmp/preln_dyt_small --config.model.n_layer=4 --config.model.n_embd=128 --config.model.n_head=4 --config.model.context_length=64 --config.batch_size=16 --config.num_train_steps=300 --config.eval_every_steps=100 --config.eval_steps=8 --config.optimizer.learning_rate=1e-3
Measured (2026-12-08, experiments/results/cpu/followups, 3 seeds): eval loss 3.078 ± 0.092 at
1e-3, its best of 5e-4 to 4e-3 (the data's unigram loss is 3.338), against Pre-LN's 2.341 ±
0.010: +0.737 [+0.492, +0.982], higher. It learns only at low rates: at 2e-3 two of three seeds,
at 4e-3 every seed stays at the unigram plateau. Without the embedding scalar it stays there at
every rate (3.339 at 1e-3, alpha_0 1.0); alpha_0 0.5 with the scalar gives 3.059 (seed 0). The
`cpu` run above (1,000 steps, L=6, D=256, lr 1e-3; 2026-12-08, on 2 cores shared with a test
run, about 2,200-3,400 tokens/s): eval loss 1.847 at step 1,000, against Pre-LN's 1.481 and
SAS-P's 1.778 (docs/adding_a_variant.md, "Measured"); without the recipe it stayed at the
plateau, 3.310.
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/preln_dyt.py --workdir=/tmp/preln_dyt

The speed package has not verified `norm_type="dyt"` or the embedding scalar: the run builds
the reference model and logs one line saying so (docs/fast.md).
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
