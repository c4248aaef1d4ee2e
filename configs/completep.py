"""Pre-LN with CompleteP (Dey, Zhang, Noci, Li, Bordelon, Bergsma, Pehlevan, Hanin, Hestness,
"Don't be lazy: CompleteP enables compute-efficient deep transformers", NeurIPS 2025, arXiv
2505.01618): depth-muP with alpha = 1, so that a learning rate tuned at depth L_base transfers
to depth L.

With m_L = L / L_base (docs/model.md, "CompleteP"; the depth terms of their Table 1):
    x <- x + m_L^-alpha * Attn(norm1(x));   x <- x + m_L^-alpha * MLP(norm2(x))
and, inside the residual blocks only, AdamW's learning rate times m_L^(alpha - 1) (1 at
alpha = 1); AdamW's eps times m_L^-alpha in every parameter group, from the authors' base of
1e-12, as their code scales its one `adam_eps` (EleutherAI/nanoGPT-mup, branch completep,
model.py `configure_optimizers` and train.py; training/optimizer.py, `depth_mup_scales`).
Embeddings, the final norm and the head keep the base learning rate.
Init: Pre-LN's (every weight N(0, 0.02), norm scales 1): Table 1's depth terms leave every
initial variance alone. Weight decay: Pre-LN's (Table 1 scales it with width only). This
code scales no width (m_N = 1).

L_base = 4: at 4 layers the model and its initial values are Pre-LN's exactly (its optimiser
too, but for eps 1e-12 in place of 1e-8), so a learning rate tuned there for Pre-LN is
CompleteP's base rate. The `cpu` switch's 6 layers give m_L = 1.5 (branches times 2/3, eps
times 2/3); the paper shape's 18 give m_L = 4.5.

The baseline it is compared with: this code's Pre-LN, which initialises every weight N(0, 0.02)
as the SAS authors' code does. The CompleteP authors' standard-parameterisation baseline
(nanoGPT's) initialises each residual output projection (`c_proj`) at 0.02 / sqrt(2 L)
instead; that baseline is not run here.

Train (CPU-sized, the `cpu` switch: 1,000 steps of 16 x 128 tokens at L=6, D=256):
    python -m simplified_flax.train --config=completep:cpu --workdir=/tmp/completep
Measured (2026-12-08, experiments/results/cpu/followups: L=4, D=128, T=64, batch 16, 300 steps,
3 seeds, each variant at its own best learning rate, bracketed by the sweep): eval loss 2.276 ±
0.021 at 2e-3 with L_base=1 (branches x 1/4) against Pre-LN's 2.341 ± 0.010 at 1e-3: -0.064
[-0.091, -0.038], lower.
Paper shape (L=18) on an accelerator host:
    python -m simplified_flax.train --config=configs/completep.py --workdir=/tmp/completep

The transfer check (experiments/results/cpu/completep_transfer, 2026-12-07): the best learning
rate at 4 and at 16 layers against Pre-LN's, 32 runs of 300 steps at D=128, T=64, batch 16,
2 seeds, rates 5e-4 to 4e-3 (about 50 minutes with --jobs=2 on 2 cores):
    python -m simplified_flax.sweep --config=completep:cpu --variants=preln,completep --grid=model.n_layer=4,16 --grid=optimizer.learning_rate=5e-4,1e-3,2e-3,4e-3 --seeds=2 --best_of=optimizer.learning_rate --jobs=2 --workdir_root=workdirs/completep_transfer --config.model.n_embd=128 --config.model.n_head=4 --config.model.context_length=64 --config.batch_size=16 --config.num_train_steps=300 --config.eval_every_steps=100 --config.eval_steps=8 --config.log_every_steps=25 --config.checkpoint_every_steps=150 --config.model.depth_mup_base_layers=4
Measured: Pre-LN's best rate is 1e-3 at both depths; CompleteP's is 1e-3 at 4 layers (it is
Pre-LN there) and 2e-3 at 16 (2.390 ± 0.001; 2.419 ± 0.021 at 1e-3). At 16 layers CompleteP
at its best is below Pre-LN at its best by 0.117 [0.078, 0.156]. At this budget its best rate
moved one grid step (x2) and Pre-LN's did not: the transfer is not shown at this scale.
That check ran before this config took the authors' eps (then 1e-8, scaled in the blocks
only), against this code's Pre-LN (not the authors' c_proj-scaled baseline); it has not been
rerun since.

The speed package has not verified `model.depth_mup_alpha`: the run builds the reference model
and logs one line saying so (docs/fast.md).
"""
from . import preln


def get_config(arg: str = ""):
  c = preln.get_config(arg)
  c.model.depth_mup_alpha = 1.0
  c.model.depth_mup_base_layers = 4
  # The authors' base eps (EleutherAI/nanoGPT-mup, branch completep, train.py `adam_eps`),
  # times m_L^-alpha in every group (training/optimizer.py).
  c.optimizer.eps = 1e-12
  return c
