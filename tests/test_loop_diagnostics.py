"""Diagnostics in the training loop: computed only every `diagnostics_every` steps,
written to metrics.jsonl per layer."""
import os

import jax
import pytest

from conftest import tiny_config
from simplified_flax.training import loop
from simplified_flax.runs import metrics_io
from simplified_flax.train import create_train_state, diagnostics_step
from test_loop import TINY, make_config, write_corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("corpus"))


def _diagnostic_rows(workdir) -> dict[int, dict]:
  rows = metrics_io.read_history(os.path.join(workdir, metrics_io.METRICS_FILE))
  return {r["step"]: r for r in rows if "kurtosis/layer_0" in r}


def test_diagnostics_run_and_are_written_only_every_n_steps(tmp_path, data, monkeypatch):
  dispatched, real = [], loop._diagnostics_step

  def recording(config, model):
    inner = real(config, model)
    def step_fn(state, batch, axis_name=None):
      jax.debug.callback(lambda s: dispatched.append(int(s)), state.step)
      return inner(state, batch, axis_name=axis_name)
    return step_fn

  monkeypatch.setattr(loop, "_diagnostics_step", recording)
  config = make_config({**TINY, **data, "num_train_steps": 7, "diagnostics_every": 3,
                        "checkpoint_every_steps": 0}, variant="sas")
  loop.train_and_evaluate(config, str(tmp_path / "run"), tensorboard=False)
  jax.effects_barrier()

  assert sorted(dispatched) == [3, 6]
  rows = _diagnostic_rows(tmp_path / "run")
  assert sorted(rows) == [3, 6]
  row = rows[3]
  for layer in range(config.model.n_layer):
    for name in ("kurtosis", "feature_corr_rms", "token_corr_mean", "token_corr_rms",
                 "max_median_ratio", "attn_entropy"):
      assert f"{name}/layer_{layer}" in row
  assert any(k.startswith("gain/h_0/") for k in row)   # SAS trains its gains
  history = metrics_io.read_history(os.path.join(tmp_path / "run", metrics_io.METRICS_FILE))
  assert {r["step"] for r in history if any("/layer_" in k for k in r)} == {3, 6}


def test_no_diagnostics_when_every_is_zero(tmp_path, data):
  config = make_config({**TINY, **data, "num_train_steps": 4, "diagnostics_every": 0,
                        "checkpoint_every_steps": 0})
  loop.train_and_evaluate(config, str(tmp_path / "run"), tensorboard=False)
  assert _diagnostic_rows(tmp_path / "run") == {}


def test_fused_config_gets_its_entropy_from_the_explicit_path():
  config = tiny_config("preln", attention_impl="fused")
  config.batch_size = 2
  state = create_train_state(config, jax.random.PRNGKey(0))
  tokens_BT = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 61)
  fused = jax.jit(diagnostics_step)(state, {"inputs": tokens_BT})
  assert "attn_entropy/layer_0" not in fused and "kurtosis/layer_1" in fused
  explicit = jax.jit(loop._diagnostics_step(config, None))(state, {"inputs": tokens_BT})
  assert "attn_entropy/layer_0" in explicit
  assert float(explicit["kurtosis/layer_1"]) == pytest.approx(float(fused["kurtosis/layer_1"]),
                                                              rel=1e-4, abs=1e-6)
