"""Folders of either side: an authors' run (`config.json` + `model.safetensors`, or
`pytorch_model.bin` where torch is importable) <-> this code's workdir (`config.json` in this
code's format, an Orbax checkpoint saved as training saves one, the tokenizer).

A converted workdir holds one checkpoint, step 0, with a fresh optimiser state (their files hold
no optimiser state this code could read): `train` on it starts its schedule again from the
converted weights. The output folder must be new or empty; nothing is written before the input
is read and converted whole.
"""
import dataclasses
import json
import os
import shutil

from etils import epath

from simplified_flax import storage
from simplified_flax.authors import ConversionError
from simplified_flax.authors import config_map
from simplified_flax.authors import params_map
from simplified_flax.config_files import CONFIG_FILE

SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
SPM_FILE = "tokenizer.model"   # data/tokenizers.py TOKENIZER_FILENAME: read here as it is
DECODER_VARIANTS = ("preln", "parallel", "value_skipinit", "sas", "sas_p", "sas_p_nonorm", "op",
                    "naive_skipless")


@dataclasses.dataclass(frozen=True)
class Converted:
  """What a conversion wrote, for the console."""
  out: str
  variant: str                      # the shipped config the workdir's config starts from
  overrides: dict                   # the model fields where it differs from that config
  notes: tuple[str, ...] = ()


def require_new_folder(path: str) -> None:
  """ConversionError unless `path` is absent or an empty folder (nothing is overwritten)."""
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    raise ConversionError(f"{path} exists and is not an empty folder; converting never "
                          "overwrites: give a new output folder.")


def read_authors_dir(src: str) -> tuple[dict, dict, str]:
  """(their config dict, their state dict as numpy arrays, the weights file) of the run
  folder `src`."""
  config_path = os.path.join(src, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise ConversionError(f"{config_path} does not exist: --from_authors takes the folder of "
                          f"an authors' run (config.json + {SAFETENSORS_FILE}).")
  config = storage.read_json_object(config_path, ConversionError,
                                    "Give the config.json the authors' run wrote.")
  weights = os.path.join(src, SAFETENSORS_FILE)
  if os.path.isfile(weights):
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
    try:
      return config, load_file(weights), weights
    except Exception as e:  # pylint: disable=broad-except  (safetensors' own error types)
      raise ConversionError(f"{weights} does not load as safetensors ({e}).") from None
  weights = os.path.join(src, TORCH_FILE)
  if os.path.isfile(weights):
    return config, _torch_state_dict(weights), weights
  raise ConversionError(f"{src} holds neither {SAFETENSORS_FILE} nor {TORCH_FILE}.")


def _torch_state_dict(path: str) -> dict:
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConversionError(f"{path} is a torch pickle and torch is not installed here: save "
                          f"it as {SAFETENSORS_FILE}, or install torch.") from None
  state = torch.load(path, map_location="cpu", weights_only=True)
  return {k: (v.float() if v.is_floating_point() and v.dtype == torch.bfloat16 else v).numpy()
          for k, v in state.items()}


def write_authors_dir(out: str, config: dict, tensors: dict) -> None:
  """`config.json` + `model.safetensors` (metadata format "pt", as Hugging Face writes)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, SAFETENSORS_FILE), metadata={"format": "pt"})
  text = json.dumps(config, indent=2, sort_keys=True).encode()
  storage.write_atomically(epath.Path(out) / CONFIG_FILE, lambda f: f.write(text))


def workdir_config(fields: dict):
  """(config, variant, overrides): the shipped decoder config whose model differs from
  `fields` in the fewest fields, with `fields` set (shapes included)."""
  from simplified_flax import config_files  # pylint: disable=import-outside-toplevel
  best = None
  for variant in DECODER_VARIANTS:
    config = config_files.load(variant)
    model = config.model.to_dict()
    overrides = {k: v for k, v in fields.items() if model.get(k) != v}
    if best is None or len(overrides) < len(best[2]):
      best = (config, variant, overrides)
  config, variant, overrides = best
  config.model.update(fields)
  return config, variant, overrides


def workdir_from_authors(src: str, out: str, seed: int = 0) -> Converted:
  """Converts the authors' run `src` into the new workdir `out` (module docstring)."""
  # pylint: disable=import-outside-toplevel  (JAX and Orbax only once the inputs are read)
  import jax
  import jax.numpy as jnp
  from simplified_flax.data import tokenizers
  from simplified_flax.model import parameters
  from simplified_flax.runs import checkpoints, config_checks
  from simplified_flax.training.step import create_train_state
  require_new_folder(out)
  theirs, tensors, weights = read_authors_dir(src)
  config, variant, overrides = workdir_config(config_map.model_fields(
      theirs, os.path.join(src, CONFIG_FILE)))
  config.seed = seed
  notes = []
  spm_path = os.path.join(src, SPM_FILE)
  if os.path.isfile(spm_path):
    pieces = tokenizers.SentencePieceTokenizer.load(spm_path).vocab_size
    if pieces > config.model.vocab_size:
      raise ConversionError(f"{spm_path} has {pieces} pieces, more than the model's vocab_size "
                            f"{config.model.vocab_size}: not the tokenizer of this model.")
    config.data.tokenizer, config.data.spm_vocab_size = "sentencepiece", pieces
  else:
    notes.append(f"{src} holds no {SPM_FILE}: the workdir's data.tokenizer is "
                 f"{config.data.tokenizer!r}; set data.* for your data before evaluating.")
  config_checks.validate_run_config(config)
  shapes = {tuple(k.key for k in path): tuple(x.shape) for path, x in
            jax.tree_util.tree_leaves_with_path(
                parameters.variable_shapes(config.model)["params"])}
  params = params_map.from_state_dict(tensors, config.model, shapes, weights)
  state = create_train_state(config, jax.random.PRNGKey(seed))
  state = state.replace(params=jax.tree.map(jnp.asarray, params))
  config_dict = config.to_dict()
  manager = checkpoints.make_manager(out, max_to_keep=config.max_to_keep, save_interval_steps=1,
                                     async_save=False)
  checkpoints.save(manager, 0, state, {}, config_dict,
                   {"elapsed_s": 0.0, "converted_from": os.path.abspath(src)})
  manager.wait_until_finished()
  manager.close()
  text = json.dumps(config_dict, indent=2, sort_keys=True).encode()
  storage.write_atomically(epath.Path(out) / CONFIG_FILE, lambda f: f.write(text))
  if os.path.isfile(spm_path):
    shutil.copyfile(spm_path, os.path.join(out, SPM_FILE))
  return Converted(out, variant, overrides, tuple(notes))


def authors_from_workdir(workdir: str, out: str, step: int | None = None) -> Converted:
  """Writes the latest good checkpoint of `workdir` (or `step`) as an authors' run `out`."""
  # pylint: disable=import-outside-toplevel
  import jax
  from simplified_flax.data import tokenizers
  from simplified_flax.model import scan_layout
  from simplified_flax.runs import config_checks
  from simplified_flax.training.evaluation import load_config, restore_read_only
  require_new_folder(out)
  config = load_config(workdir)
  config_checks.validate_run_config(config)
  config_map.authors_config(config.model)   # a model they cannot express fails before reading
  params_map.layout(config.model)
  restored = restore_read_only(workdir, config, step=step)
  params = scan_layout.unstack_layers(jax.device_get(restored.state.params), config.model)
  tensors = params_map.to_state_dict(params, config.model)
  write_authors_dir(out, config_map.authors_config(config.model, tokenizers.EOD_ID), tensors)
  notes = [f"step {restored.step} of {workdir}"]
  spm_path = config.data.spm_model_path or os.path.join(workdir, SPM_FILE)
  if config.data.tokenizer == "sentencepiece" and os.path.isfile(spm_path):
    shutil.copyfile(spm_path, os.path.join(out, SPM_FILE))
    notes.append(f"its SentencePiece model copied as {SPM_FILE}")
  return Converted(out, "", {}, tuple(notes))
