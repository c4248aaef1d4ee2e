"""The one decision of the speed package: which speed paths a model runs, from its config and the
platform its step is compiled for (docs/fast.md).

    plan = choose(config.model, dtype="bfloat16", platform="gpu")   # a Plan, or None
    None: the reference model (simplified_flax/model), unchanged.

A plan applies only where every config field that changes the block has a value the speed
paths were verified on (`VERIFIED`, checked against the reference by tests/test_fast_matrix.py
for every config file in configs/); fields that cannot change what the block computes are
listed in `IGNORED`. Any other field or value builds the reference model and logs one line
that names it. A new variant may run slower; it never runs wrong.
"""
import dataclasses
import functools
from typing import Optional

from absl import logging

from simplified_flax import field_checks
from simplified_flax.fast import attention_kernels
from simplified_flax.fast import grad_rules

PLATFORMS = ("cpu", "gpu", "tpu")


_one_of, _number, _number_or_none = (field_checks.one_of, field_checks.number,
                                     field_checks.number_or_none)
_positive_int = field_checks.positive_int
_BOOL = _one_of(False, True)

# Every model field that can change what a block computes, with the values the speed paths
# were verified on (the equivalence matrix runs each config file of configs/ through every
# platform's plan). A value outside these builds the reference model.
VERIFIED = {
    "kind": _one_of("decoder", "encoder"),
    "n_layer": _positive_int, "n_embd": _positive_int, "n_head": _positive_int,
    "context_length": _positive_int, "max_position_embeddings": _positive_int,
    "mlp_width_mult": _positive_int, "vocab_size": _positive_int,
    "activation": _one_of("leaky_relu"),
    "lrelu_neg_slope": _one_of(0.0),
    "attention_impl": _one_of("auto", "explicit", "fused"),
    "scan_layers": _BOOL, "remat": _BOOL, "scan_residuals": _one_of("matmuls", "all"),
    "norm_type": _one_of("rmsnorm", "none"),
    "norm_position": _one_of("pre"),
    "norm_eps": _number,
    "parallel_layers": _BOOL,
    "qk_norm_type": _one_of("none", "rmsnorm"),
    "dot_norm_type": _one_of("none"),
    "attn_output_gate": _one_of(False),   # gated attention: the reference model only, for now
    "attn_block_resid_gain": _number, "attn_block_skip_gain": _number,
    "mlp_block_resid_gain": _number, "mlp_block_skip_gain": _number,
    "trainable_attn_block_gains": _BOOL, "trainable_mlp_block_gains": _BOOL,
    "centre_attn": _BOOL,
    "attn_mat_resid_gain": _number, "attn_mat_skip_gain": _number, "centre_attn_gain": _number,
    "trainable_attn_mat_gains": _BOOL,
    # Value / Proj: the block reads their form (identity, plain, reparameterised: valproj.py).
    "value_resid_gain": _number, "value_skip_gain": _number_or_none,
    "val_init_type": _one_of("normal", "orth", "id"), "trainable_value_gains": _BOOL,
    "first_layer_value_resid_gain": _number_or_none,
    "proj_resid_gain": _number, "proj_skip_gain": _number_or_none,
    "proj_init_type": _one_of("normal", "orth", "id"), "trainable_proj_gains": _BOOL,
    "last_layer_proj_resid_gain": _number_or_none,
    "dropout_rate": _one_of(0.0),
    # nGPT and CompleteP: the reference model only, for now (their default values only).
    # Rotary positions, the embedding's scalar and an untied head: the reference model only,
    # for now (their defaults only).
    "position_embedding": _one_of("learned"), "embedding_scale": _one_of("none"),
    "tie_head": _one_of(True),
    "ngpt": _one_of(False),
    "depth_mup_alpha": _one_of(None), "depth_mup_base_layers": _one_of(None),
}
# Fields that cannot change what the fast model computes from given parameters: initial
# values (the reference model initialises; a plan never does), the loss's head (training's),
# and the switch itself.
IGNORED = frozenset({
    # Read only by what a plan never builds: rotary positions' base, DyT's / Derf's alpha_0.
    "rope_theta", "embedding_scale_init", "alpha_init_attn_norm", "alpha_init_mlp_norm", "alpha_init_final_norm",
    "query_init_std", "key_init_std", "val_proj_init_std", "mlp_proj_init_std",
    "tie_valproj_init", "loss_vocab_chunk_size", "vocab_pad_multiple", "loss_keep_logits",
    "grad_rules",
})


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the fast model runs, decided once by `choose` and passed to every fast module.

  platform: the platform the step is compiled for ("cpu", "gpu", "tpu").
  rules: the names of grad_rules.AUTO_PLATFORM that apply.
  attention_impl: the attention form ("explicit" or "fused") that "auto" resolves to.
  interpret: the Pallas kernels in interpret mode, off their platform (a platform's plan
    checked on a CPU; tests only).
  """
  platform: str
  rules: frozenset
  attention_impl: str
  interpret: bool = False

  def applies(self, rule: str) -> bool:
    return rule in self.rules


def unclassified(model_config) -> list[str]:
  """The fields of `model_config` in neither VERIFIED nor IGNORED, in the config's order."""
  return [field for field in model_config.keys() if field not in VERIFIED and field not in IGNORED]


def unverified(model_config) -> Optional[str]:
  """One line naming the first field (in the config's order) whose value the speed paths were
  not verified on, or that is not classified at all; None when every field is verified."""
  for field, value in model_config.items():
    if field in IGNORED:
      continue
    check = VERIFIED.get(field)
    if check is None:   # unclassified
      return (f"model.{field} is new to the speed package (simplified_flax/fast/plan.py); "
              f"verify it and add it to VERIFIED or IGNORED there to run the fast path")
    if not check(value):
      return (f"model.{field}={value!r} was not verified for the fast path (verified: "
              f"{check.description}); see docs/fast.md, 'Verifying a new setting'")
  return None


def choose(model_config, *, dtype, platform: str, interpret: bool = False) -> Optional[Plan]:
  """The plan for a model of `model_config` computing in `dtype` on `platform`, or None for
  the reference model: `model.grad_rules="off"`, or a field `unverified` names (logged once).
  `interpret`: the kernels in Pallas interpret mode (a GPU's or TPU's plan on a CPU)."""
  if platform not in PLATFORMS:
    raise ValueError(f"Unknown platform {platform!r}; expected one of {PLATFORMS}.")
  mode, left_out = grad_rules.parse(grad_rules.mode_of(model_config))
  if mode == "off":
    return None
  reason = unverified(model_config)
  if reason is not None:
    _log_once(f"Running the reference model: {reason}.")
    return None
  rules = frozenset(rule for rule, platforms in grad_rules.AUTO_PLATFORM.items()
                    if rule not in left_out and (mode == "on" or platform in platforms))
  impl = attention_kernels.resolve_impl(model_config.attention_impl, dtype=dtype,
                                        soft_capped=model_config.dot_norm_type == "tanh",
                                        backend=platform)
  return Plan(platform, rules, impl, interpret)


@functools.lru_cache(maxsize=64)
def _log_once(line: str) -> None:
  logging.warning(line)


def forget_logged_lines() -> None:
  """Log each fallback line again from now on (for tests that read the log)."""
  _log_once.cache_clear()
