"""`experiments/accelerator_check.py --tiny`: every part of the accelerator check runs on a CPU
and writes its report, so the command that runs on a GPU/TPU host is known to work."""
import json
import subprocess
import sys

import numpy as np
import pytest

from test_loop import REPO, subprocess_env

pytestmark = pytest.mark.slow   # each test runs the whole check in a child process

SCRIPT = REPO / "experiments" / "accelerator_check.py"


def _run(*args):
  return subprocess.run([sys.executable, str(SCRIPT), *args], env=subprocess_env(), cwd=REPO,
                        capture_output=True, text=True, timeout=900, check=False)


# Two tests, the parts split between them, so that xdist's two workers share the check's
# compiles (one test was the suite's longest by far); together they run every part.
def test_tiny_check_parts_a_b_e_equalities_throughput_breakdown(tmp_path):
  out = tmp_path / "report"
  done = _run("--tiny", "--parts=abe", f"--output={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert {"equalities", "throughput", "breakdown"} <= set(results)
  assert all(row["ok"] for row in results["equalities"])
  assert {"preln", "sas", "sas_p", "sas_p_nonorm", "preln/explicit", "sas_p/explicit",
          "preln/full_logits_loss",
          "preln/vocab_pad_128", "preln/no_relu_matmul"} <= set(results["throughput"])
  assert set(results["breakdown"]) == {"preln", "sas_p"}
  assert all(r["parts"]["block matmuls"]["flops"] > 0 for r in results["breakdown"].values())
  report = (out / "report.md").read_text()
  for section in ("## a.", "## b.", "## e."):
    assert section in report
  assert (out / "throughput.png").stat().st_size > 0


def test_tiny_check_parts_c_d_f_g_on_the_shipped_corpus_format(tmp_path):
  corpus = tmp_path / "corpus.npy"
  made = _run("--tiny", f"--make_corpus={corpus}")
  assert made.returncode == 0, made.stderr[-3000:]
  tokens_N = np.load(corpus)
  assert tokens_N.dtype == np.uint16 and tokens_N.size == 1 << 18 and tokens_N.max() < 259

  out = tmp_path / "report"
  done = _run("--tiny", "--parts=cdfg", f"--corpus={corpus}", f"--output={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
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
  for section in ("## c.", "## d.", "## f.", "## g."):
    assert section in report
  for png in ("loss_vs_step.png", "loss_vs_time.png"):
    assert (out / png).stat().st_size > 0


def test_missing_corpus_is_one_clear_error(tmp_path):
  done = _run("--tiny", f"--corpus={tmp_path / 'nope.npy'}")
  assert done.returncode == 2
  assert "--make_corpus" in done.stderr and "Traceback" not in done.stderr
