"""The authors' `config.json` (a Hugging Face GPT2Config with their block fields) <-> the fields
of this code's `config.model` (docs/model.md, "Knobs").

Their run writes the GPT-2 fields that differ from GPT2Config's defaults (`GPT2_DEFAULTS` fills
the rest) and every block field of their `run_clm.py` (`BLOCK_FIELDS`; `qk_norm_type` and
`dot_norm_type` came later and default to "none"). A field neither side knows, or a value this
code cannot express (GPT-2's own attention options, an untied head, unequal dropout rates, a
width that is no multiple of n_embd), is a ConversionError naming it. The other way,
`authors_config` writes a model only where every field passes `expressible.refusal` (the
table of what their code has); nothing is dropped unnoticed.
"""
from typing import Any

from simplified_flax.authors import ConversionError
from simplified_flax.authors import expressible

# GPT2Config's defaults of the fields read here (a saved config.json leaves them out).
GPT2_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
    "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True,
    "add_cross_attention": False, "model_type": "gpt2",
}
# GPT-2 fields with no bearing on the parameters or the forward pass of their model.
IGNORED_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "initializer_range", "reorder_and_upcast_attn",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "task_specific_params", "n_ctx", "tokenizer_class",
})
# Their block fields: the same names as this code's `config.model` fields, with these types.
FLOAT_FIELDS = ("attn_block_resid_gain", "attn_block_skip_gain", "mlp_block_resid_gain",
                "mlp_block_skip_gain", "attn_mat_resid_gain", "attn_mat_skip_gain",
                "value_resid_gain", "first_layer_value_resid_gain", "value_skip_gain",
                "proj_resid_gain", "last_layer_proj_resid_gain", "proj_skip_gain",
                "val_proj_init_std", "query_init_std", "key_init_std", "centre_attn_gain",
                "lrelu_neg_slope", "mlp_proj_init_std")
BOOL_FIELDS = ("trainable_attn_block_gains", "trainable_mlp_block_gains",
               "trainable_attn_mat_gains", "trainable_value_gains", "trainable_proj_gains",
               "centre_attn", "parallel_layers")
STR_FIELDS = ("norm_type", "val_init_type", "proj_init_type", "norm_position", "qk_norm_type",
              "dot_norm_type")
OPTIONAL_FLOATS = ("first_layer_value_resid_gain", "value_skip_gain", "last_layer_proj_resid_gain",
                   "proj_skip_gain", "val_proj_init_std", "query_init_std", "key_init_std",
                   "mlp_proj_init_std")
LATER_FIELDS = {"qk_norm_type": "none", "dot_norm_type": "none"}
BLOCK_FIELDS = FLOAT_FIELDS + BOOL_FIELDS + STR_FIELDS + ("tie_valproj_init",
                                                          "activation_function")
ACTIVATIONS = {"leaky_relu": "leaky_relu", "gelu": "gelu"}   # theirs (HF ACT2FN) -> this code's
KNOWN_FIELDS = frozenset(GPT2_DEFAULTS) | IGNORED_FIELDS | frozenset(BLOCK_FIELDS)


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ConversionError(message)


def model_fields(theirs: dict, where: str = "config.json") -> dict[str, Any]:
  """{`config.model` field: value} of the model their config describes (the decoder); a
  ConversionError for an unknown field or one this code cannot express."""
  unknown = sorted(set(theirs) - KNOWN_FIELDS)
  _require(not unknown, f"{where}: unknown field(s) {', '.join(unknown)}: neither GPT-2's nor "
           "the authors' run_clm.py fields; this converter does not know what they change.")
  c = {**GPT2_DEFAULTS, **LATER_FIELDS, **theirs}
  missing = [k for k in BLOCK_FIELDS if k not in c]
  _require(not missing, f"{where}: no {', '.join(missing)}: not a config of the authors' "
           "simplified_transformers run (their run_clm.py writes every block field).")
  for field, wanted in (("model_type", "gpt2"), ("scale_attn_weights", True),
                        ("scale_attn_by_inverse_layer_idx", False),
                        ("tie_word_embeddings", True), ("add_cross_attention", False)):
    _require(c[field] == wanted, f"{where}: {field}={c[field]!r} is not expressible here "
             f"(this code's block needs {field}={wanted!r}).")
  _require(c["activation_function"] in ACTIVATIONS,
           f"{where}: activation_function={c['activation_function']!r} is not expressible "
           f"here; this code has {', '.join(ACTIVATIONS)}.")
  rates = {k: c[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
  _require(len(set(rates.values())) == 1, f"{where}: dropout rates {rates} differ; this code "
           "has one model.dropout_rate: make them equal.")
  D = int(c["n_embd"])
  inner = D * 4 if c["n_inner"] is None else int(c["n_inner"])
  _require(inner % D == 0, f"{where}: n_inner={inner} is not a multiple of n_embd={D}; this "
           "code's MLP width is model.mlp_width_mult * n_embd.")
  fields = {"kind": "decoder", "vocab_size": int(c["vocab_size"]), "n_layer": int(c["n_layer"]),
            "n_embd": D, "n_head": int(c["n_head"]),
            "max_position_embeddings": int(c["n_positions"]),
            "context_length": min(int(c.get("n_ctx") or 128), int(c["n_positions"])),
            "mlp_width_mult": inner // D, "activation": ACTIVATIONS[c["activation_function"]],
            "norm_eps": float(c["layer_norm_epsilon"]), "dropout_rate": float(rates["resid_pdrop"]),
            "tie_valproj_init": c["tie_valproj_init"] or "none"}
  for k in FLOAT_FIELDS:
    fields[k] = None if c[k] is None and k in OPTIONAL_FLOATS else _number(c[k], k, where)
  fields.update({k: bool(c[k]) for k in BOOL_FIELDS})
  fields.update({k: str(c[k]) for k in STR_FIELDS})
  return fields


def _number(value, field: str, where: str) -> float:
  _require(isinstance(value, (int, float)) and not isinstance(value, bool),
           f"{where}: {field}={value!r} is not a number.")
  return float(value)


def authors_config(m, eod_id: int | None = None) -> dict[str, Any]:
  """Their `config.json` for the model `m` (a decoder's `config.model`), every field written
  out: GPT2LMHeadModel's, then the block fields their `convertGPT2model` reads. A
  ConversionError, one line, where a field of `m` is not theirs (`expressible.refusal`)."""
  refused = expressible.refusal(m)   # every field, by its table; nothing else is written
  _require(refused is None, refused)
  activation = {v: k for k, v in ACTIVATIONS.items()}[m.activation]
  config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": int(m.vocab_size), "n_positions": int(m.max_position_embeddings),
            "n_ctx": int(m.context_length), "n_embd": int(m.n_embd), "n_layer": int(m.n_layer),
            "n_head": int(m.n_head), "n_inner": int(m.mlp_width_mult * m.n_embd),
            "activation_function": activation, "layer_norm_epsilon": float(m.norm_eps),
            "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "use_cache": True, "torch_dtype": "float32"}
  config.update({k: float(m.dropout_rate) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")})
  if eod_id is not None:
    config.update(bos_token_id=int(eod_id), eos_token_id=int(eod_id))
  for k in FLOAT_FIELDS:
    config[k] = None if m[k] is None else float(m[k])
  config.update({k: bool(m[k]) for k in BOOL_FIELDS})
  config.update({k: str(m[k]) for k in STR_FIELDS})
  config["tie_valproj_init"] = None if m.tie_valproj_init == "none" else m.tie_valproj_init
  return config
