"""`experiments/accelerator_check.py --tiny`: every part of the accelerator check runs on a CPU
and writes its report, so the command that runs on a GPU/TPU host is known to work."""
import json
import subprocess
import sys

import numpy as np
import pytest

from test_loop import REPO, subprocess_env

pytestmark = pytest.mark.slow   # the whole check in a child process

SCRIPT = REPO / "experiments" / "accelerator_check.py"


def _run(*args, env=None):
  return subprocess.run([sys.executable, str(SCRIPT), *args], env=env or subprocess_env(),
                        cwd=REPO, capture_output=True, text=True, timeout=900, check=False)


def test_tiny_check_runs_every_part_on_the_shipped_corpus_format(tmp_path):
  """The whole check in one process, as on the device (parts a, b + e, c, g, d, f), with a
  compilation cache of its own: the tiny settings give b's, d's, f's and g's one-layer Pre-LN
  and SAS-P steps the same programs, compiled once (two processes compiled them apart)."""
  corpus = tmp_path / "corpus.npy"
  made = _run("--tiny", f"--make_corpus={corpus}")
  assert made.returncode == 0, made.stderr[-3000:]
  tokens_N = np.load(corpus)
  assert tokens_N.dtype == np.uint16 and tokens_N.size == 1 << 18 and tokens_N.max() < 259

  out = tmp_path / "report"
  done = _run("--tiny", f"--corpus={corpus}", f"--output={out}",
              env=subprocess_env(cache_dir=str(tmp_path / "jax_cache")))
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  # a, b and e: equalities, throughput, breakdown.
  assert {"equalities", "throughput", "breakdown"} <= set(results)
  assert all(row["ok"] for row in results["equalities"])
  assert {"preln", "sas", "sas_p", "sas_p_nonorm", "preln/explicit", "sas_p/explicit",
          "preln/full_logits_loss",
          "preln/vocab_pad_128", "preln/no_relu_matmul"} <= set(results["throughput"])
  assert set(results["breakdown"]) == {"preln", "sas_p"}
  assert all(r["parts"]["block matmuls"]["flops"] > 0 for r in results["breakdown"].values())
  # c, d, f and g: long context, training, XLA flags, compile depth.
  assert {"long_context", "training", "xla_flags", "compile_depth"} <= set(results)
  assert [r["xla_flags"] for r in results["xla_flags"]] == ["", "--xla_cpu_enable_fast_math=false"]
  assert all(r["tokens_per_sec"] > 0 and r["tokens_ratio"] > 0 for r in results["xla_flags"])
  assert [(r["seq_len"], r["attention_impl"]) for r in results["long_context"]] == [
      (64, "explicit"), (64, "fused")]
  for name in ("preln", "sas", "sas_p"):
    history = results["training"][name]["history"]
    assert [r["step"] for r in history if "eval_loss" in r] == [10, 20]
    assert np.isfinite(results["training"][name]["final_eval_loss"])
  assert [(r["scan_layers"], sorted(r["seconds"])) for r in results["compile_depth"]] == [
      (False, ["2"]), (True, ["2", "4"])]
  report = (out / "report.md").read_text()
  for section in ("## a.", "## b.", "## c.", "## d.", "## e.", "## f.", "## g."):
    assert section in report
  for png in ("throughput.png", "loss_vs_step.png", "loss_vs_time.png"):
    assert (out / png).stat().st_size > 0


def test_missing_corpus_is_one_clear_error(tmp_path):
  done = _run("--tiny", f"--corpus={tmp_path / 'nope.npy'}")
  assert done.returncode == 2
  assert "--make_corpus" in done.stderr and "Traceback" not in done.stderr
