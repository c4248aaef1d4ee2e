"""nGPT, the normalized Transformer (Loshchilov, Hsieh, Sun, Ginsburg, "nGPT: Normalized
Transformer with Representation Learning on the Hypersphere", ICLR 2025, arXiv 2410.01131),
trained as the paper trains it: no weight decay, no warm-up.

Every hidden state and every weight vector along the embedding dimension lies on the unit
sphere, and there are no norm layers (model/ngpt.py; docs/model.md, "nGPT"). Each layer
(their Eqs. (10)-(11)):
    h <- Norm(h + alpha_A * (Norm(Attn(h)) - h));   h <- Norm(h + alpha_M * (Norm(MLP(h)) - h))
with q, k normalised per head and scaled by s_qk, softmax scale sqrt(d_k) (Eqs. (15)-(16)); a
SwiGLU MLP with u times s_u and v times s_v * sqrt(D) (Eqs. (20)-(21)); logits
z = s_z * (h E_out^T) (Eq. (3)); the first hidden state E[token].
Init: every matrix and table N(0, 1) normalised along the embedding dimension; alpha_A,
alpha_M [D] at 0.05 (stored at scale 1/sqrt(D)), s_qk [D] at 1 (scale 1/sqrt(D)), s_u, s_v [F]
at 1 (scale 1), s_z [V] at 1 (scale 1/sqrt(D)). After every optimiser step each matrix and
table is renormalised (training/optimizer.py, `renormalized`).

Optimiser (the authors' code): AdamW betas (0.9, 0.95), weight decay 0, no warm-up, cosine
decay to 0, clipping at 1. Learning rate: the paper's 15e-4 (its 0.5B model, D=1024) at the
paper shape here; with the `cpu` switch (D=256) 3e-3, the top of the paper's own sweep (its
code's launcher trains at 30e-4): an Adam step moves each entry of a unit vector by about
the learning rate, a relative step of lr * sqrt(D), and 3e-3 at D=256 is 15e-4's at D=1024.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=ngpt:cpu --workdir=/tmp/ngpt
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 2.058 ±
0.015 at 8e-3 (rates 1e-3 to 1.6e-2 tried; 2.061 at 1.6e-2) against Pre-LN's 2.341 ± 0.010 at
1e-3: -0.282 [-0.329, -0.235], lower, with 1.12M parameters against Pre-LN's 0.95M (the SwiGLU's
third matrix). The comparison before the authors' rotary positions, untied head and a bracketed
grid read +0.165, higher (2.505 at 4e-3, the grid's edge then).
Paper shape on an accelerator host:
    python -m simplified_flax.train --config=configs/ngpt.py --workdir=/tmp/ngpt

As the authors' code (NVIDIA/ngpt, model.py): rotary positions (`position_embedding="rope"`,
q and k rotated before their normalisation; no position table) and a head of its own
(`tie_head=False`). Not as their code: their rotation function is not a rotation (it computes
(-x_odd cos, x_even sin) per pair); this code rotates as RoFormer does (model/rope.py). The
speed package has not verified `model.ngpt`: the run builds the reference model and logs one
line saying so (docs/fast.md). The loss reads the full logits (s_z scales each), not the
chunked head.
"""
from . import preln


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  c.model.ngpt = True
  c.model.norm_type = "none"   # no norm layers (the flag builds nGPT's layer, which has none)
  # The authors' model.py: rotary positions (no position table) and a head of its own.
  c.model.position_embedding = "rope"
  c.model.tie_head = False
  o = c.optimizer
  o.name, o.schedule, o.b1, o.b2 = "adamw", "cosine", 0.9, 0.95
  o.weight_decay, o.warmup_fraction, o.warmup_steps = 0.0, 0.0, 0
  o.learning_rate = 3e-3 if "cpu" in arg.split(",") else 15e-4
  o.grad_clip_norm = 1.0
  return c
