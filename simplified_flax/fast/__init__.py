"""The speed package: everything that changes only how fast the model runs (docs/fast.md).

`simplified_flax.model` is the reference, the papers' equations under autodiff. This package
holds the gradient rules, the Pallas and Mosaic kernels, the attention-kernel dispatch, the
block-level fusions and the target platform, behind one decision:

    plan = fast.choose(config.model, dtype=..., platform="gpu")   # None: the reference model
    model = fast.build_model(config.model, dtype)                 # the fast or reference model

The fast model has the reference's parameters under the same names, so a checkpoint moves
between the two unchanged; tests/test_fast_matrix.py holds every config file of configs/ to
the reference on every platform's plan.
"""
from simplified_flax.fast.model import ModelApply
from simplified_flax.fast.model import Transformer
from simplified_flax.fast.model import build_model
from simplified_flax.fast.plan import IGNORED
from simplified_flax.fast.plan import Plan
from simplified_flax.fast.plan import VERIFIED
from simplified_flax.fast.plan import choose
from simplified_flax.fast.plan import unverified
