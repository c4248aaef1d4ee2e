"""Which of this code's models the authors' code (github bobby-he/simplified_transformers: their
`run_clm.py` fields and `model_utils.convertGPT2model` block) can express, field by field: the
rule `convert --to_authors` follows, as `fast/plan.py`'s VERIFIED and IGNORED are the speed
package's.

    reason = refusal(config.model)   # one line naming a field and its value, or None

Every field of `config.model` is in `EXPRESSIBLE` (with the values their code has), in
`NOT_WRITTEN` (it cannot change the converted model), or in `UNREAD_UNLESS` (it changes the
model only where another field selects it, and their code has no such setting). Any other
field is refused whatever its value, so that a field added to configs/base.py is never
dropped from a converted run unnoticed: it converts once it is classified here.
"""
from typing import Optional

from simplified_flax import field_checks


_one_of, _number, _number_or_none = (field_checks.one_of, field_checks.number,
                                     field_checks.number_or_none)
_positive_int = field_checks.positive_int
_rate = field_checks.rate
_BOOL = _one_of(False, True)

# Every model field their config.json or state dict carries, with the values their code has
# (authors/config_map.py writes them; params_map.py lays out the tensors). The defaults of the
# fields their code lacks are its behaviour (a learned position table, a head tied to the
# token embedding, no embedding scale, no gate, no nGPT or CompleteP).
EXPRESSIBLE = {
    "kind": _one_of("decoder", has="the decoder (GPT2LMHeadModel) only"),
    "vocab_size": _positive_int, "n_layer": _positive_int, "n_embd": _positive_int,
    "n_head": _positive_int, "context_length": _positive_int,
    "max_position_embeddings": _positive_int, "mlp_width_mult": _positive_int,
    "activation": _one_of("leaky_relu", "gelu"), "lrelu_neg_slope": _number,
    "norm_type": _one_of("ln", "rmsnorm", "none"), "norm_position": _one_of("pre", "post"),
    "norm_eps": _number, "parallel_layers": _BOOL,
    "qk_norm_type": _one_of("none", "rmsnorm"), "dot_norm_type": _one_of("none", "tanh"),
    "attn_output_gate": _one_of(False, has="no attention output gate"),
    "attn_block_resid_gain": _number, "attn_block_skip_gain": _number,
    "mlp_block_resid_gain": _number, "mlp_block_skip_gain": _number,
    "trainable_attn_block_gains": _BOOL, "trainable_mlp_block_gains": _BOOL,
    "centre_attn": _BOOL, "attn_mat_resid_gain": _number, "attn_mat_skip_gain": _number,
    "centre_attn_gain": _number, "trainable_attn_mat_gains": _BOOL,
    "value_resid_gain": _number, "value_skip_gain": _number_or_none,
    "val_init_type": _one_of("normal", "orth", "id"), "trainable_value_gains": _BOOL,
    "first_layer_value_resid_gain": _number_or_none,
    "proj_resid_gain": _number, "proj_skip_gain": _number_or_none,
    "proj_init_type": _one_of("normal", "orth", "id"), "trainable_proj_gains": _BOOL,
    "last_layer_proj_resid_gain": _number_or_none,
    "tie_valproj_init": _one_of("none", "all_blocks", "last_block"),
    "query_init_std": _number_or_none, "key_init_std": _number_or_none,
    "val_proj_init_std": _number_or_none, "mlp_proj_init_std": _number_or_none,
    "dropout_rate": _rate,
    "ngpt": _one_of(False, has="no nGPT (normalised layers)"),
    "depth_mup_alpha": _one_of(None, has="no CompleteP (depth-scaled branches)"),
    # Fields the main line adds (configs/base.py there): their code's own behaviour only.
    "embedding_scale": _one_of("none"), "tie_head": _one_of(True),
    "position_embedding": _one_of("learned"),
}
# Fields that cannot change the converted model: how this code computes it (the same values
# under another program; a scanned run is written unrolled) and its training loss's head.
NOT_WRITTEN = frozenset({
    "attention_impl", "grad_rules", "scan_layers", "remat", "scan_residuals",
    "loss_vocab_chunk_size", "vocab_pad_multiple", "loss_keep_logits",
})
# Fields read only where another field selects what their code lacks (so it is refused there,
# by that field or by this one): {field: (whether the model reads it, which field selects)}.
_DYNAMIC_NORMS = lambda m: m.get("norm_type") in ("dyt", "derf")
UNREAD_UNLESS = {
    "depth_mup_base_layers": (lambda m: m.get("depth_mup_alpha") is not None,
                              "model.depth_mup_alpha"),
    "alpha_init_attn_norm": (_DYNAMIC_NORMS, "model.norm_type 'dyt' or 'derf'"),
    "alpha_init_mlp_norm": (_DYNAMIC_NORMS, "model.norm_type 'dyt' or 'derf'"),
    "alpha_init_final_norm": (_DYNAMIC_NORMS, "model.norm_type 'dyt' or 'derf'"),
    "rope_theta": (lambda m: m.get("position_embedding") == "rope",
                   "model.position_embedding 'rope'"),
    "embedding_scale_init": (lambda m: m.get("embedding_scale") == "learned",
                             "model.embedding_scale 'learned'"),
}
_CANNOT = "this run cannot be written as theirs (its checkpoint stays readable here)"


def unclassified(model_config) -> list[str]:
  """The fields of `model_config` in none of the tables, in the config's order."""
  known = set(EXPRESSIBLE) | NOT_WRITTEN | set(UNREAD_UNLESS)
  return [field for field in model_config.keys() if field not in known]


def refusal(model_config) -> Optional[str]:
  """One line naming the first field (in the config's order) that the authors' code cannot
  express, with its value, or that is in none of the tables; None where every field is
  theirs. A field of `UNREAD_UNLESS` is named only after every other field passed, so that the
  line names the field that selects what their code lacks (`norm_type='derf'`, not its alpha).
  `model_config`: `config.model`, or the dict a saved config holds."""
  for field, value in model_config.items():
    if field in NOT_WRITTEN or field in UNREAD_UNLESS:
      continue
    check = EXPRESSIBLE.get(field)
    if check is None:
      return (f"model.{field}={value!r} is new to the authors' format "
              "(simplified_flax/authors/expressible.py): say there which values their code "
              "has, or that it cannot change the converted model, to convert this run.")
    if not check(value):
      has = getattr(check, "has", None) or f"only {check.description} for {field}"
      return f"model.{field}={value!r}: the authors' code has {has}; {_CANNOT}."
  for field, value in model_config.items():
    if field in UNREAD_UNLESS:
      read, selector = UNREAD_UNLESS[field]
      if read(model_config):
        return (f"model.{field}={value!r}: read with {selector}, which the authors' code "
                f"lacks; {_CANNOT}.")
  return None
