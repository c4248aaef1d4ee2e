"""The converter's refusals: unknown or inexpressible config fields, wrong or missing tensors
and files, a non-empty output folder, workdirs the authors' format cannot hold; one line each,
nothing written."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from simplified_flax.authors import ConversionError, dirs
from test_convert import _perturbed_params, _tiny, _write_theirs


@pytest.fixture(scope="module")
def theirs_preln(tmp_path_factory):
  """A valid authors' folder of the tiny Pre-LN model: (config dict, tensors)."""
  config = _tiny("preln")
  _, _, params = _perturbed_params(config)
  folder = tmp_path_factory.mktemp("theirs")
  _write_theirs(folder, config, params)
  return dirs.read_authors_dir(str(folder))[:2]


def _refused(tmp_path, theirs, tensors, match):
  src, out = tmp_path / "src", tmp_path / "out"
  src.mkdir(parents=True)
  (src / "config.json").write_text(json.dumps(theirs))
  if tensors is not None:
    save_file(tensors, str(src / "model.safetensors"))
  with pytest.raises(ConversionError, match=match) as error:
    dirs.workdir_from_authors(str(src), str(out))
  assert "\n" not in str(error.value) and not out.exists()


def test_unknown_or_inexpressible_config_fields_are_refused(tmp_path, theirs_preln):
  theirs, tensors = theirs_preln
  cases = [({"foo_gain": 1.0}, r"unknown field\(s\) foo_gain"),
           ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
           ({"activation_function": "gelu_new"}, "activation_function='gelu_new'"),
           ({"attn_pdrop": 0.1}, "dropout rates .* differ"),
           ({"n_inner": 100}, "n_inner=100 is not a multiple of n_embd=32")]
  for i, (change, match) in enumerate(cases):
    _refused(tmp_path / str(i), {**theirs, **change}, tensors, match)
  no_field = {k: v for k, v in theirs.items() if k != "centre_attn"}
  _refused(tmp_path / "missing", no_field, tensors, "no centre_attn: not a config of the authors")


def test_wrong_missing_or_changed_tensors_are_refused(tmp_path, theirs_preln):
  theirs, tensors = theirs_preln
  name = "transformer.h.1.mlp.c_fc.weight"
  cases = [({**tensors, name: tensors[name][:, :8].copy()}, f"{name} has shape \\[32, 8\\]"),
           ({k: v for k, v in tensors.items() if k != name}, f"missing {name}"),
           ({**tensors, "transformer.h.0.attn.extra": tensors[name]}, "unexpected .*extra"),
           ({**tensors, "transformer.h.0.attn_block_skip_gain": np.array([0.5], np.float32)},
            "attn_block_skip_gain holds \\[0.5\\], not the config's fixed 1.0"),
           ({**tensors, "lm_head.weight": tensors["transformer.wte.weight"] + 1},
            "lm_head.weight differs from transformer.wte.weight"),
           ({**tensors, name: tensors[name].astype(np.float64)}, f"{name} is float64")]
  for i, (changed, match) in enumerate(cases):
    _refused(tmp_path / str(i), theirs, changed, match)


def test_missing_files_and_a_non_empty_output_are_refused(tmp_path, theirs_preln):
  theirs, _ = theirs_preln
  _refused(tmp_path / "weights", theirs, None, "holds neither model.safetensors nor")
  with pytest.raises(ConversionError, match="config.json does not exist"):
    dirs.workdir_from_authors(str(tmp_path / "nothing"), str(tmp_path / "out"))
  (tmp_path / "used").mkdir()
  (tmp_path / "used" / "keep.txt").write_text("mine")
  with pytest.raises(ConversionError, match="exists and is not an empty folder"):
    dirs.workdir_from_authors(str(tmp_path / "nothing"), str(tmp_path / "used"))
  assert os.listdir(tmp_path / "used") == ["keep.txt"]


@pytest.mark.parametrize("variant,overrides,match", [
    ("bert_sas", {}, "model.kind='encoder': the authors' code has the decoder"),
    ("preln", {"value_skip_gain": 1.0, "val_init_type": "orth"},
     "fixed 'orth' matrix W0, which the authors' checkpoints do not store")])
def test_a_workdir_they_cannot_express_is_refused_before_reading(variant, overrides, match,
                                                                 tmp_path):
  config = _tiny(variant, **overrides)
  (tmp_path / "work").mkdir()
  (tmp_path / "work" / "config.json").write_text(json.dumps(config.to_dict()))
  with pytest.raises(ConversionError, match=match):
    dirs.authors_from_workdir(str(tmp_path / "work"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *args: subprocess.run([sys.executable, "-m", "simplified_flax.convert", *args],
                                     capture_output=True, text=True, env=env,
                                     cwd=os.path.dirname(os.path.dirname(__file__)))
  both = run(f"--from_authors={tmp_path}", f"--to_authors={tmp_path}", f"--workdir={tmp_path}")
  assert both.returncode == 2 and "exactly one of --from_authors" in both.stderr
  missing = run(f"--from_authors={tmp_path / 'none'}", f"--workdir={tmp_path / 'out'}")
  assert missing.returncode == 1 and missing.stderr.count("\n") == 1
  assert "simplified_flax.convert: error:" in missing.stderr and "config.json" in missing.stderr
