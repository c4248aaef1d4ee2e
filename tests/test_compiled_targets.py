"""experiments/compiled_targets.py: the committed report of compiled accelerator programs, its
tables from rows, and `--update` (the compiler-free tests read hand-made rows; the tiny H200 run
needs jax's CUDA plugin, as in test_compile.py)."""
import json

import jax
import pytest

from test_compile import _needs

pytestmark = pytest.mark.aot


def test_the_compiled_targets_report_compares_variants_with_their_commands(tmp_path):
  _needs("gpu")
  from experiments import compiled_targets  # pylint: disable=import-outside-toplevel
  compiled_targets.main(["--tiny", "--rows=variants", "--variants=preln,sas_p",
                         "--targets=h200", "--jobs=2", f"--output={tmp_path}"])
  results = json.loads((tmp_path / "results.json").read_text())
  rows = results["variants"]
  assert [(r["variant"], r["overrides"]["model.attention_impl"]) for r in rows] == [
      ("preln", "auto"), ("sas_p", "auto"), ("preln", "explicit"), ("sas_p", "explicit")]
  assert [r["attention_kernel"] for r in rows] == ["cudnn", "cudnn", "xla", "xla"]
  assert all(r["fits"] and r["versions"]["jax"] == jax.__version__ for r in rows)
  for r in rows:   # the split by part, read from each row's --hlo_out, adds up to the JSON's
    assert sum(r["non_matmul_parts"].values()) == pytest.approx(
        r["non_matmul_bytes_per_device"], rel=1e-9)
    assert "--hlo_out" not in r["command"]
  text = (tmp_path / "report.md").read_text()
  assert rows[1]["command"] in text and "x Pre-LN" in text
  assert "### Bytes outside matmuls, by part of the step" in text
  assert f"| h200 | sas_p | {rows[1]['non_matmul_parts']['embedding'] / 1e9:.2f} |" in text
  # The norms against their floor: all of the norms' part, at least the floor.
  floors = rows[0]["norm_floors"]
  moved, floor = (sum(f[k] for f in floors.values()) for k in ("bytes", "floor"))
  assert moved == pytest.approx(rows[0]["non_matmul_parts"]["norms"], rel=1e-9)
  assert 0 < floor < moved
  assert (f"| h200 | preln | {moved / 1e9:.2f} | {floor / 1e9:.2f} | "
          f"{(moved - floor) / 1e9:.2f} |") in text
  assert (tmp_path / "roofline_vs_preln.png").stat().st_size > 0


def test_the_report_reads_what_a_step_that_does_not_fit_needs():
  from experiments import compiled_targets_report  # pylint: disable=import-outside-toplevel
  error = ("simplified_flax.compile: error: The step does not fit on v5e-1: Ran out of memory "
           "on HBM, the total memory required for HLO temporaries (27.59G) exceeds available "
           "HBM (15.75G). Shrink it with parallel.fsdp, ...")
  long = {"model.n_layer": 2, "model.context_length": 16384, "batch_size": 1}
  rows = [{"variant": "sas_p", "target": "v5e-1", "command": "fused", "fits": True,
           "overrides": dict(long, **{"model.attention_impl": "fused"}),
           "memory_per_device_bytes": {"total": int(2.759 * 2 ** 30)}, "compile_s": 1.0},
          {"variant": "sas_p", "target": "v5e-1", "command": "explicit", "fits": False,
           "overrides": dict(long, **{"model.attention_impl": "explicit"}), "error": error}]
  text = compiled_targets_report.markdown({"script": "s", "versions": {}, "shape": {},
                                           "long_context": rows})
  assert "| > 27.59 (temporaries) |" in text
  assert "(fused <= 0.100x the explicit temporaries alone)" in text


def test_the_report_compares_tpu_rows_by_xla_bytes_and_gpu_rows_without():
  from experiments import compiled_targets_report  # pylint: disable=import-outside-toplevel
  def row(variant, target, roofline, xla_bytes=None):
    found = {"variant": variant, "target": target, "command": f"{variant} {target}",
             "overrides": {"model.attention_impl": "auto"}, "fits": True,
             "flops_per_device": 1e12, "bytes_per_device": 6e10,
             "non_matmul_bytes_per_device": 5e10, "roofline_step_s": roofline,
             "memory_per_device_bytes": {"total": 2 ** 30}, "attention_kernel": "splash"}
    if xla_bytes:
      found["xla_cost_analysis"] = {"bytes accessed": xla_bytes}
    return found
  rows = [row("preln", "v5e-8", 0.08, 29.0e9), row("sas_p", "v5e-8", 0.079, 30.45e9),
          row("preln", "h200", 0.025), row("sas_p", "h200", 0.024)]
  text = compiled_targets_report.markdown({"script": "s", "versions": {}, "shape": {},
                                           "variants": rows})
  assert "| 30.45 (1.050) |" in text and "| 29.00 (1.000) |" in text
  assert text.count("| - | 1.00 (splash) |") == 2   # the GPU rows have no XLA byte count


def test_update_replaces_the_rows_it_compiles_keeps_the_rest_and_names_their_commits(tmp_path):
  from experiments import compiled_targets  # pylint: disable=import-outside-toplevel
  from experiments import compiled_targets_report  # pylint: disable=import-outside-toplevel
  def row(variant, target, commit, roofline):
    return {"variant": variant, "target": target, "overrides": {"model.attention_impl": "auto"},
            "command": f"compile {variant} {target}", "date": "2026-12-0" + commit[-1],
            "script": f"python experiments/compiled_targets.py --targets={target}",
            "commit": commit, "versions": {"jax": "0.10.2"}, "fits": True,
            "flops_per_device": 1e12, "bytes_per_device": 6e10,
            "non_matmul_bytes_per_device": 5e10, "roofline_step_s": roofline,
            "memory_per_device_bytes": {"total": 2 ** 30}, "attention_kernel": "splash"}
  kept = {"shape": {"dtype": "bfloat16"}, "script": "old", "versions": {},
          "variants": [row("preln", "h200", "aaaaaa1", 0.025),
                       row("sas_p", "h200", "aaaaaa1", 0.023),
                       row("preln", "v5e-8", "aaaaaa1", 0.08)],
          "depth": [dict(row("sas_p", "v5e-8", "aaaaaa1", 0.08), overrides={"model.n_layer": 72})]}
  fresh = {"shape": {"dtype": "bfloat16"}, "script": "new", "versions": {},
           "variants": [row("preln", "v5e-8", "bbbbbb2", 0.07),
                        row("sas_p", "v5e-8", "bbbbbb2", 0.06)]}
  out = compiled_targets.merged(kept, fresh)
  assert [(r["variant"], r["target"], r["commit"]) for r in out["variants"]] == [
      ("preln", "h200", "aaaaaa1"), ("sas_p", "h200", "aaaaaa1"),
      ("preln", "v5e-8", "bbbbbb2"), ("sas_p", "v5e-8", "bbbbbb2")]
  assert out["depth"] == kept["depth"]
  text = compiled_targets_report.markdown(out)
  assert ("- `python experiments/compiled_targets.py --targets=v5e-8` at bbbbbb2, 2026-12-02 "
          "(jax 0.10.2): the variants on v5e-8 rows.") in text
  assert "at aaaaaa1, 2026-12-01 (jax 0.10.2): the variants on h200, variants on v5e-8" not in text
  (tmp_path / "results.json").write_text(json.dumps(kept))
  assert compiled_targets.kept_results(str(tmp_path), {"dtype": "bfloat16"}) == kept
  with pytest.raises(SystemExit, match="holds the shape"):
    compiled_targets.kept_results(str(tmp_path), {"dtype": "float32"})
