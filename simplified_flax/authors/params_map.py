"""The one name mapping: the authors' state dict (GPT2LMHeadModel whose blocks their
`convertGPT2model` replaced) <-> this code's unrolled `params` tree, for a decoder config.

`layout(m)` lists every tensor of their state dict: its name, shape, and either the parameter
path here (the same numbers: their Conv1D weights are [in, out] like a Dense kernel, so only
gains change shape, [1] <-> [] and [1, H, 1, 1] <-> [H]) or the constant it holds (their zero
biases, their fixed gains: a Parameter with requires_grad=False there, a constant here).
Their checkpoints store no fixed matrix W0 of a reparameterised Value/Proj, so only identity
ones (`init_type="id"`, as in SAS) convert. The head is tied to `transformer.wte.weight`:
`lm_head.weight` is left out as Hugging Face's `save_pretrained` leaves it out.

Reading, a constant of theirs that their forward pass reads must hold the config's value; one
it never reads (the gain of a skip that is absent, a trainable gain of an unused term) is not
checked, and writing gives it the config's value, so their file round-trips bit for bit
except there, and this code's parameters always do.
"""
import dataclasses
from typing import Any

import numpy as np

from simplified_flax.authors import ConversionError
from simplified_flax.model import valproj

HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class Entry:
  """One tensor of their state dict."""
  name: str                        # e.g. "transformer.h.0.attn.qk_attn.weight"
  shape: tuple[int, ...]           # its shape there
  path: tuple[str, ...] | None     # its parameter here, or None: a constant of the config
  value: float = 0.0               # path None: the value of every element
  read: bool = True                # path None: whether their forward pass reads it


def _norm(prefix: str, path: tuple, kind: str, D: int) -> list[Entry]:
  if kind == "ln":
    return [Entry(f"{prefix}.weight", (D,), path + ("scale",)),
            Entry(f"{prefix}.bias", (D,), path + ("bias",))]
  if kind == "rmsnorm":
    return [Entry(f"{prefix}.scale", (D,), path + ("scale",))]
  return []


def _gain(name: str, path: tuple, shape: tuple, value, trainable: bool, read: bool = True):
  """A gain: the parameter `path` when trainable here, else the constant `value`."""
  if trainable:
    return Entry(name, shape, path)
  return Entry(name, shape, None, float(value), read)


def _linear(prefix: str, path: tuple, settings: valproj.LinearSettings, D: int) -> list[Entry]:
  """Value (`v_attn`) or Proj (`c_proj`): none, a plain [D, D] weight, or reparameterised."""
  if settings.form == "identity":
    return []
  bias = Entry(f"{prefix}.bias", (D,), None, 0.0)
  if settings.form == "plain":
    return [Entry(f"{prefix}.weight", (D, D), path + ("linear", "kernel")), bias]
  if settings.init_type != "id":
    raise ConversionError(
        f"{prefix} is reparameterised with a fixed {settings.init_type!r} matrix W0, which the "
        "authors' checkpoints do not store (only init_type 'id' converts).")
  trainable = settings.trainable_gains
  return [Entry(f"{prefix}.weight", (D, D), path + ("kernel",)), bias,
          _gain(f"{prefix}.resid_gain", path + ("resid_gain",), (1,), settings.resid_gain,
                trainable),
          _gain(f"{prefix}.skip_gain", path + ("skip_gain",), (1,), settings.skip_gain, trainable)]


def _attention(p: str, h: tuple, m, layer: int) -> list[Entry]:
  D, H = m.n_embd, m.n_head
  a, at = f"{p}.attn", h + ("attn",)
  entries = [Entry(f"{a}.qk_attn.weight", (D, 2 * D), at + ("c_attn", "kernel")),
             Entry(f"{a}.qk_attn.bias", (2 * D,), at + ("c_attn", "bias"))]
  entries += _linear(f"{a}.v_attn", at + ("value",), valproj.value_settings(m, layer), D)
  entries += _linear(f"{a}.c_proj", at + ("proj",), valproj.proj_settings(m, layer), D)
  if m.qk_norm_type == "rmsnorm":
    entries += [Entry(f"{a}.q_norm.scale", (D // H,), at + ("q_norm", "scale")),
                Entry(f"{a}.k_norm.scale", (D // H,), at + ("k_norm", "scale"))]
  trainable, centred, shape = m.trainable_attn_mat_gains, m.centre_attn, (1, H, 1, 1)
  entries += [
      _gain(f"{a}.attn_mat_resid_gain", at + ("attn_mat_resid_gain",), shape,
            m.attn_mat_resid_gain, trainable),
      _gain(f"{a}.attn_mat_skip_gain", at + ("attn_mat_skip_gain",), shape,
            m.attn_mat_skip_gain, trainable and centred, read=centred),
      _gain(f"{a}.centre_attn_gain", at + ("centre_attn_gain",), shape, m.centre_attn_gain,
            trainable and centred and m.centre_attn_gain != 0, read=centred)]
  return entries


def _block(m, layer: int) -> list[Entry]:
  D, F = m.n_embd, m.mlp_width_mult * m.n_embd
  p, h = f"transformer.h.{layer}", (f"h_{layer}",)
  first_norm = "ln" if (m.norm_type == "none" and layer == 0) else m.norm_type
  entries = _norm(f"{p}.ln_1", h + ("norm1",), first_norm, D)
  entries += _norm(f"{p}.ln_2", h + ("norm2",), m.norm_type, D)
  entries += _attention(p, h, m, layer)
  entries += [Entry(f"{p}.mlp.c_fc.weight", (D, F), h + ("mlp", "c_fc", "kernel")),
              Entry(f"{p}.mlp.c_fc.bias", (F,), None, 0.0),
              Entry(f"{p}.mlp.c_proj.weight", (F, D), h + ("mlp", "c_proj", "kernel")),
              Entry(f"{p}.mlp.c_proj.bias", (D,), None, 0.0)]
  sequential = not m.parallel_layers
  for kind in ("attn", "mlp"):
    trainable = m[f"trainable_{kind}_block_gains"]
    resid, skip = f"{kind}_block_resid_gain", f"{kind}_block_skip_gain"
    skipped = m[skip] != 0 and (sequential or kind == "mlp")   # the skips the forward adds
    entries += [_gain(f"{p}.{resid}", h + (resid,), (1,), m[resid], trainable),
                _gain(f"{p}.{skip}", h + (skip,), (1,), m[skip],
                      trainable and sequential and skipped, read=skipped)]
  return entries


def layout(m) -> list[Entry]:
  """Every tensor of their state dict for the decoder `m` (`config.model`), in their order;
  a ConversionError for a model their checkpoints cannot hold."""
  if m.kind != "decoder":
    raise ConversionError(f"model.kind={m.kind!r}: the authors' code has the decoder "
                          "(GPT2LMHeadModel) only.")
  D = m.n_embd
  entries = [Entry("transformer.wte.weight", (m.vocab_size, D), ("wte", "embedding")),
             Entry("transformer.wpe.weight", (m.max_position_embeddings, D),
                   ("wpe", "embedding"))]
  for layer in range(m.n_layer):
    entries += _block(m, layer)
  return entries + _norm("transformer.ln_f", ("ln_f",), "ln", D)


def _get(tree, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def to_state_dict(params, m) -> dict[str, np.ndarray]:
  """Their state dict (float32 numpy arrays, contiguous) of this code's unrolled `params`."""
  tensors = {}
  for e in layout(m):
    if e.path is None:
      tensors[e.name] = np.full(e.shape, e.value, np.float32)
    else:
      tensors[e.name] = np.ascontiguousarray(np.asarray(_get(params, e.path), np.float32)
                                             .reshape(e.shape))
  return tensors


def from_state_dict(tensors: dict[str, np.ndarray], m, shapes: dict[tuple, tuple],
                    where: str) -> dict[str, Any]:
  """This code's unrolled `params` (nested dicts of float32 arrays) from their state dict;
  `shapes` {path: shape} lists the parameters the model here has. A ConversionError names the
  first missing, unexpected, misshapen or non-float tensor, and a constant that differs from
  the config where their forward pass reads it."""
  entries = layout(m)
  mapped = {e.path for e in entries if e.path is not None}
  if mapped != set(shapes):
    raise ConversionError(f"{where}: no tensor of theirs maps to {sorted(set(shapes) - mapped)}"
                          f" here (or none here to {sorted(mapped - set(shapes))}).")
  expected = {e.name for e in entries}
  unexpected = sorted(set(tensors) - expected - {HEAD})
  missing = [e.name for e in entries if e.name not in tensors]
  if missing or unexpected:
    raise ConversionError(f"{where}: " + "; ".join(
        f"{what} {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3
                                              else "")
        for what, names in (("missing", missing), ("unexpected", unexpected)) if names)
        + f" for the config's model ({m.n_layer} layers; norm_type {m.norm_type!r}).")
  params: dict[str, Any] = {}
  for e in entries:
    x = _float32(tensors[e.name], e.name, where)
    if x.shape != e.shape:
      raise ConversionError(f"{where}: {e.name} has shape {list(x.shape)}, but the config "
                            f"needs {list(e.shape)}.")
    if e.path is None:
      if e.read and not np.array_equal(x, np.full(e.shape, e.value, np.float32)):
        raise ConversionError(f"{where}: {e.name} holds {x.ravel()[:4].tolist()}, not the "
                              f"config's fixed {e.value}; this code keeps it constant.")
      continue
    node = params
    for key in e.path[:-1]:
      node = node.setdefault(key, {})
    node[e.path[-1]] = x.reshape(shapes[e.path])
  if HEAD in tensors and not np.array_equal(_float32(tensors[HEAD], HEAD, where),
                                            params["wte"]["embedding"]):
    raise ConversionError(f"{where}: {HEAD} differs from transformer.wte.weight; this code's "
                          "head is tied to the token embedding.")
  return params


def _float32(x, name: str, where: str) -> np.ndarray:
  """`x` as float32: float16 / float32 tensors exactly, any other dtype a ConversionError."""
  x = np.asarray(x)
  if x.dtype not in (np.float32, np.float16):
    raise ConversionError(f"{where}: {name} is {x.dtype}; float32 or float16 tensors convert.")
  return x.astype(np.float32)
