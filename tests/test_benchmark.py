"""experiments/benchmark.py, the throughput benchmark, and its entry point
`python -m simplified_flax.benchmark`: bookkeeping (never speed): FLOP counts, configs, output."""
import json
import subprocess
import sys

import jax
import pytest

from conftest import TINY_MODEL, tiny_config
from simplified_flax.model import transformer
from test_loop import REPO

sys.path.insert(0, str(REPO))
from experiments import benchmark  # pylint: disable=wrong-import-position
import simplified_flax.benchmark  # pylint: disable=wrong-import-position


def init_params(config):
  model = transformer.build_model(config.model)
  tokens = jax.numpy.zeros((1, config.model.context_length), jax.numpy.int32)
  return model.init(jax.random.key(0), tokens)["params"]


@pytest.mark.parametrize("variant, matmuls_per_layer", [
    ("preln", 2 + 1 + 1 + 4 + 4),   # W_qk (D x 2D), Value, Proj, MLP in and out (x D^2)
    ("sas", 2 + 4 + 4),             # no Value / Proj matrices (layer 0's value is added below)
])
def test_flops_per_token_is_six_n_plus_attention(variant, matmuls_per_layer):
  config = tiny_config(variant)
  m = config.model
  L, D, T, V = m.n_layer, m.n_embd, m.context_length, m.vocab_size
  weights = L * matmuls_per_layer * D * D + (D * D if variant == "sas" else 0)
  counts = benchmark.flops_per_token(config, init_params(config))
  assert counts["matmul_params"] == weights + V * D
  assert counts["flops_per_token"] == 6 * (weights + V * D) + 12 * L * T * D


def test_load_config_applies_shape_then_overrides():
  config = benchmark.load_config("sas_p", {"model.n_layer": 3, "batch_size": 4})
  assert (config.model.n_layer, config.model.n_embd, config.model.n_head) == (3, 768, 12)
  assert config.model.vocab_size == 256 and config.batch_size == 4
  assert config.model.parallel_layers   # the variant's own settings survive


def test_table_gives_ratios_to_the_first_config():
  row = {key: 2.0 for _, key, _, _ in benchmark.COLUMNS}
  text = benchmark.table({"a": row, "b": {key: 3.0 for key in row}})
  assert "(x1.500)" in text.splitlines()[2] and "(x1.000)" in text.splitlines()[1]


@pytest.mark.slow
def test_command_prints_a_json_line_with_every_config():
  overrides = [f"--config.model.{k}={v}" for k, v in TINY_MODEL.items()]
  out = subprocess.run(
      [sys.executable, "-m", "simplified_flax.benchmark", "--configs=preln,sas_p",
       "--batch_size=2", "--steps=1", "--rounds=1", "--matmul_size=64", "--breakdown",
       *overrides], capture_output=True, text=True, check=True, cwd=str(REPO)).stdout
  assert out.count("breakdown of ") == 2   # --breakdown: one table per config
  results = json.loads(out.strip().splitlines()[-1])
  assert all(r["breakdown"]["parts"]["block matmuls"]["flops"] > 0 for r in results.values())
  assert list(results) == ["preln", "sas_p"]
  for r in results.values():
    for key in ("params_trainable", "step_time_s", "tokens_per_sec", "mfu"):
      assert r[key] > 0, key
    assert r["tokens_per_sec"] * r["step_time_s"] == pytest.approx(2 * TINY_MODEL["context_length"])
  assert results["sas_p"]["params_trainable"] < results["preln"]["params_trainable"]


def test_entry_point_runs_the_checkouts_script_with_the_command_line(tmp_path, monkeypatch,
                                                                     capsys):
  assert simplified_flax.benchmark.SCRIPT == REPO / "experiments" / "benchmark.py"
  script = tmp_path / "benchmark.py"
  script.write_text("import sys\nprint(__name__, sys.argv)\n")
  monkeypatch.setattr(sys, "argv", ["benchmark", "--configs=preln", "--rounds=2"])
  simplified_flax.benchmark.main(script)
  assert capsys.readouterr().out == f"__main__ {[str(script), '--configs=preln', '--rounds=2']}\n"


def test_entry_point_without_the_checkout_says_what_to_run(tmp_path, monkeypatch, capsys):
  """An installed package has no experiments/: one line with the command to run instead."""
  monkeypatch.setattr(sys, "argv", ["benchmark", "--configs=preln,sas", "--config.dtype=bfloat16"])
  with pytest.raises(SystemExit) as done:
    simplified_flax.benchmark.main(tmp_path / "experiments" / "benchmark.py")
  assert done.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "ships with the source checkout" in err
  assert err.endswith(
      "run: python experiments/benchmark.py --configs=preln,sas --config.dtype=bfloat16\n")


def test_the_batch_size_has_one_source_of_truth():
  """`--config.batch_size=16` is measured at 16 (it was silently replaced by the flag's 8)."""
  from absl import app  # pylint: disable=import-outside-toplevel
  assert benchmark.load_config(
      "preln", benchmark.with_flag({}, "batch_size", None)).batch_size == 8
  assert benchmark.load_config(
      "preln", benchmark.with_flag({"batch_size": 16}, "batch_size", None)).batch_size == 16
  assert benchmark.with_flag({}, "batch_size", 4) == {"batch_size": 4}
  assert benchmark.with_flag({"batch_size": 4}, "batch_size", 4) == {"batch_size": 4}
  with pytest.raises(app.UsageError, match="--batch_size=8 and --config.batch_size=16"):
    benchmark.with_flag({"batch_size": 16}, "batch_size", 8)
