"""The recipe of docs/adding_a_variant.md, "Adding an attention-shaping term", applied to a copy of
the code: its edits, as text patches of the files it lists and of no other, add a throwaway term
`probe * I` (the matrix is alpha's, so that each form's term is one line: what is tested is
where a term goes, not its maths). Run there, the matrix holds the reference's two forms of it
to each other and the fast model to the reference on every plan, at the initial and the moved
parameters; the existing configs keep their plans; cached decoding equals the full pass;
the authors' format converts the existing configs and refuses the new one in one line. The
recipe's list of files is the one patched here.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
RECIPE_PAGE = REPO / "docs" / "adding_a_variant.md"
RECIPE_HEADING = "## Adding an attention-shaping term"

# The recipe's edits, in its order: (file, [(text there, its replacement)]); a file that does
# not exist yet is written whole (old None).
RECIPE = [
    ("configs/base.py", [(
        "  m.trainable_attn_mat_gains = False\n",
        "  m.trainable_attn_mat_gains = False\n"
        "  m.probe_attn_gain = _placeholder(float)   # probe * I (None: no such term)\n")]),
    ("simplified_flax/model/attention.py", [
        ("def shaping_terms(mask, *, num_queries: int, num_keys: int, query_offset, skip_gain,\n"
         "                  centre_gain, num_heads: int):",
         "def shaping_terms(mask, *, num_queries: int, num_keys: int, query_offset, skip_gain,\n"
         "                  centre_gain, num_heads: int, probe_gain=None):"),
        ("    terms.append((head_vector(centre_gain), -centering_matrix_from_mask(mask)))\n",
         "    terms.append((head_vector(centre_gain), -centering_matrix_from_mask(mask)))\n"
         "  if probe_gain is not None:\n"
         "    terms.append((head_vector(probe_gain),\n"
         "                  eye_QK[..., None, :, :].astype(jnp.float32)))\n"),
        ("def fused_terms(v_BKHd, *, skip_gain, centre_gain, num_queries: int, query_offset=0,\n"
         "                prefix_sums: Callable = cumulative_sum, **where):",
         "def fused_terms(v_BKHd, *, skip_gain, centre_gain, num_queries: int, query_offset=0,\n"
         "                prefix_sums: Callable = cumulative_sum, probe_gain=None, **where):"),
        ("                                               prefix_sums=prefix_sums, **where)))\n"
         "  return terms\n",
         "                                               prefix_sums=prefix_sums, **where)))\n"
         "  if probe_gain is not None:\n"
         "    terms.append((probe_gain, masks.take_queries(v_BKHd, num_queries, query_offset)))\n"
         "  return terms\n"),
        ("                     logit_soft_cap=None, return_probs: bool = False):",
         "                     logit_soft_cap=None, return_probs: bool = False, probe_gain=None):"),
        ("centre_gain=centre_gain, num_queries=Tq,\n",
         "centre_gain=centre_gain, num_queries=Tq,\n"
         "                        probe_gain=probe_gain,\n"),
        ("                        skip_gain=skip_gain, centre_gain=centre_gain, num_heads=H)",
         "                        skip_gain=skip_gain, centre_gain=centre_gain, num_heads=H,\n"
         "                        probe_gain=probe_gain)")]),
    ("simplified_flax/model/kv_cache.py", [
        ("                            logit_soft_cap=None) -> Tuple[jax.Array, Cache]:",
         "                            logit_soft_cap=None, probe_gain=None\n"
         "                            ) -> Tuple[jax.Array, Cache]:"),
        ("        centre_gain=centre_gain, causal=True, query_offset=index_B, impl=impl,\n"
         "        logit_soft_cap=logit_soft_cap)",
         "        centre_gain=centre_gain, causal=True, query_offset=index_B, impl=impl,\n"
         "        logit_soft_cap=logit_soft_cap, probe_gain=probe_gain)"),
        ("  terms.append((centre_gain, -mean_BQHd))\n",
         "  terms.append((centre_gain, -mean_BQHd))\n"
         "  if probe_gain is not None:\n"
         "    terms.append((probe_gain, v_BQHd))\n")]),
    ("simplified_flax/model/block.py", [(
        "  return gains\n",
        "  if m.get(\"probe_attn_gain\") is not None:\n"
        "    gains[\"probe_gain\"] = layers.gain(module, \"probe_attn_gain\", m.probe_attn_gain,\n"
        "                                      trainable, (H,))\n"
        "  return gains\n")]),
    ("simplified_flax/fast/plan.py", [(
        "    \"trainable_attn_mat_gains\": _BOOL,\n",
        "    \"trainable_attn_mat_gains\": _BOOL,\n"
        "    \"probe_attn_gain\": _number_or_none,\n")]),
    ("simplified_flax/authors/expressible.py", [(
        "    \"centre_attn_gain\": _number, \"trainable_attn_mat_gains\": _BOOL,\n",
        "    \"centre_attn_gain\": _number, \"trainable_attn_mat_gains\": _BOOL,\n"
        "    \"probe_attn_gain\": _one_of(None, has=\"no probe term\"),\n")]),
    ("configs/sas_p_probe.py", [(None, (
        '"""SAS-P with a throwaway shaping term, probe * I (tests/test_adding_a_term.py).\n\n'
        "    python -m simplified_flax.train --config=configs/sas_p_probe.py:cpu "
        "--workdir=/tmp/sas_p_probe\n"
        '"""\n'
        "from . import sas_p\n\n\n"
        'def get_config(arg: str = ""):\n'
        "  c = sas_p.get_config(arg)\n"
        "  c.model.probe_attn_gain = 0.3\n"
        "  return c\n"))]),
    ("tests/test_convert.py", [(
        "REFUSED = {",
        "REFUSED = {\"sas_p_probe\": \"probe_attn_gain\", ")]),
]
# What runs in the copy: the new config's matrix (the reference's two forms, the fast model on
# every plan), the existing configs' plans (SAS-P's, on every platform), decoding with the
# cache's running sum (the fused form's own terms), both tables' classification, the
# conversion.
CHECKS = [
    "tests/test_fast_matrix.py::test_the_fast_model_equals_the_reference_on_every_plan_in_both_"
    "forms[sas_p_probe]",
    "tests/test_fast_matrix.py::test_off_is_the_reference_and_auto_applies_each_rule_on_its_"
    "platform",
    "tests/test_decode.py::test_cached_decoding_equals_the_full_forward_pass[sas_p_probe-fused]",
    "tests/test_fast_matrix.py::test_every_model_field_is_verified_or_ignored_by_the_fast_path",
    "tests/test_convert.py::test_every_field_of_every_config_file_is_in_the_authors_table",
    "tests/test_convert.py::test_their_state_dict_gives_the_numpy_logits_and_round_trips_"
    "exactly[sas_p]",
    "tests/test_convert.py::test_their_state_dict_gives_the_numpy_logits_and_round_trips_"
    "exactly[sas_p_probe]",
]


def copy_of_the_code(where: pathlib.Path) -> pathlib.Path:
  """The package, configs/, tests/ and pyproject.toml, copied to `where`."""
  for name in ("simplified_flax", "configs", "tests"):
    shutil.copytree(REPO / name, where / name,
                    ignore=shutil.ignore_patterns("__pycache__", "_build"))
  shutil.copy(REPO / "pyproject.toml", where / "pyproject.toml")
  return where


def apply(root: pathlib.Path, steps=RECIPE) -> None:
  """The recipe's edits of `steps` in the copy at `root`; each text is where the recipe says
  it is, once (else the code moved: update the recipe and its page together)."""
  for name, edits in steps:
    path = root / name
    for old, new in edits:
      if old is None:
        path.write_text(new)
        continue
      text = path.read_text()
      assert text.count(old) == 1, f"{name}: the recipe's text is not there once: {old!r}"
      path.write_text(text.replace(old, new))


def recipe_files() -> set[str]:
  """The code files the recipe's section of docs/adding_a_variant.md names: `a/b.py` paths
  in backticks, and the config file and tests it asks for."""
  page = RECIPE_PAGE.read_text()
  section = page[page.index(RECIPE_HEADING):]
  return set(re.findall(r"`((?:simplified_flax|configs|tests)/[\w/]+\.py)`", section))


def test_the_recipe_lists_the_files_it_changes():
  named = recipe_files()
  patched = {name for name, _ in RECIPE} - {"configs/sas_p_probe.py"}
  assert patched <= named, f"the recipe does not name {sorted(patched - named)}"
  assert "simplified_flax/fast/block.py" not in named   # the gains pass through (fast/block.py)


@pytest.mark.slow
def test_the_recipe_applied_to_a_copy_gives_a_term_both_forms_and_the_fast_path_agree_on(
    tmp_path):
  root = copy_of_the_code(tmp_path)
  apply(root)
  env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *CHECKS], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
  assert f"{len(CHECKS)} passed" in run.stdout, run.stdout[-3000:]
