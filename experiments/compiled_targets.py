"""Every decoder variant compiled for an H200 and a TPU v5e-8, on this CPU: the committed report.

    python experiments/compiled_targets.py                    # ~30 min on 2 cores
    python experiments/compiled_targets.py --rows=variants    # or long_context, depth, pod
    python experiments/compiled_targets.py --rows=variants --targets=v5e-8 --update
    python experiments/compiled_targets.py --tiny --output=/tmp/compiled   # CI: tiny shapes

Writes `<output>/report.md`, `results.json` and `roofline_vs_preln.png` (default output
experiments/results/compiled). Each row is one `python -m simplified_flax.compile` command
(listed in the report, which gives the date and the jax/libtpu versions), each its own process:
  variants      the eight decoder variants at the paper's shape (18 layers, D=768, H=12,
                T=128, batch 128, V=50,257, bfloat16) on h200 and v5e-8, on the default path
                (attention_impl="auto": cuDNN, splash) and the explicit T x T one; the
                roofline ratio to Pre-LN on the same target and path (paper, Table 1: SAS
                1.09, SAS-P 1.16, SAS-P without norms 1.20); and each one's bytes outside
                matmuls by part of the step (step_breakdown.NON_MATMUL_PARTS, read from the
                command's `--hlo_out`);
  long_context  SAS-P with 2 layers at T=16,384, batch 1, fused and explicit, on v5e-1 and
                h200: memory per device, and the fused-to-explicit ratio;
  depth         SAS-P at 18 and 72 layers on v5e-8, model.scan_layers on and off: compile
                seconds on this host (the one timing here) and the 72-to-18 ratio;
  pod           SAS-P on v5e-256 (64 hosts) with parallel.fsdp=8, batch 512.
Figures are read from the compiled programs (aot/report.py): estimates, not timings. Each row
records the script's command and the commit it compiled (`+changes` where the package or the
configs differed from it); `--update` recompiles only the rows asked for and keeps the rest of
`<output>/results.json`, so the report says which rows were compiled when.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import compiled_targets_report  # pylint: disable=g-import-not-at-top
from experiments import report_lib  # pylint: disable=g-import-not-at-top
from experiments import step_breakdown  # pylint: disable=g-import-not-at-top
from simplified_flax.aot import hlo_costs  # pylint: disable=g-import-not-at-top
from simplified_flax.aot import report  # pylint: disable=g-import-not-at-top

VARIANTS = ("preln", "parallel", "value_skipinit", "sas", "sas_p", "sas_p_nonorm", "op",
            "naive_skipless")
ROWS = ("variants", "long_context", "depth", "pod")
SHAPES = {   # the paper's shape, and a tiny one that checks the script in CI
    "paper": {"dtype": "bfloat16", "model.vocab_size": 50257},
    "tiny": {"dtype": "bfloat16", "model.vocab_size": 97, "model.n_layer": 2,
             "model.n_embd": 64, "model.n_head": 2, "batch_size": 8},
}
LONG = {"model.n_layer": 2, "model.context_length": 16384,
        "model.max_position_embeddings": 16384, "batch_size": 1}


def command(variant: str, target: str, overrides: Dict[str, Any]) -> List[str]:
  """The compile command a row runs."""
  return ["python", "-m", "simplified_flax.compile", f"--config={variant}", f"--target={target}",
          *[f"--config.{k}={v}" for k, v in overrides.items()], "--json"]


def source_commit() -> str | None:
  """The checkout's short commit, `+changes` where the package or the configs differ from it
  (what a row compiled); None outside a git checkout."""
  git = lambda *args: subprocess.run(["git", "-C", report_lib.REPO_ROOT, *args],
                                     capture_output=True, text=True, check=False)
  head = git("rev-parse", "--short", "HEAD")
  if head.returncode:
    return None
  changed = git("status", "--porcelain", "--", "simplified_flax", "configs").stdout.strip()
  return head.stdout.strip() + ("+changes" if changed else "")


def compile_row(variant: str, target: str, overrides: Dict[str, Any],
                made: Dict[str, Any], by_part: bool = False) -> Dict[str, Any]:
  """One row: the command's JSON report, or {"fits": False, "error": <its one line>}. Each
  row is its own process, as a user runs it (a compiler that crashes costs only its row).
  `made`: the script's command and commit, recorded on the row. `by_part`: also the bytes
  outside matmuls by part of the step ("non_matmul_parts", step_breakdown.py) and each norm's
  bytes against a one-pass floor ("norm_floors"), read from the command's `--hlo_out`."""
  argv = command(variant, target, overrides)
  row = {"variant": variant, "target": target, "overrides": overrides,
         "command": shlex.join(argv), "date": datetime.date.today().isoformat(),
         "versions": report.versions(), **made}   # a row that fails has them too
  print(row["command"], flush=True)
  with tempfile.TemporaryDirectory() as folder:
    hlo_path = os.path.join(folder, "train.hlo")
    proc = subprocess.run([sys.executable, *argv[1:], *([f"--hlo_out={hlo_path}"] * by_part)],
                          capture_output=True, text=True, cwd=report_lib.REPO_ROOT, check=False)
    if by_part and os.path.exists(hlo_path):
      with open(hlo_path, encoding="utf-8") as f:
        program = hlo_costs.parse(f.read())
      row["non_matmul_parts"] = step_breakdown.non_matmul_bytes_by_part(program)
      row["norm_floors"] = step_breakdown.norm_floors(program)
  if proc.stdout.strip():
    row.update(json.loads(proc.stdout))
    print(f"  {row['memory_per_device_bytes']['total'] / 2 ** 30:.2f} GiB per device, "
          f"{row['xla_cost_analysis'].get('bytes accessed', 0) / 1e9:.2f} GB (cost_analysis), "
          f"compiled in {row['compile_s']:.1f} s", flush=True)
  if proc.returncode:
    lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
    row.update(fits=False, status=proc.returncode, error=lines[-1] if proc.returncode in (1, 2)
               else f"the compiler crashed (exit status {proc.returncode})")
    print(f"  {row['error']}", flush=True)
  return row


def variant_rows(shape: Dict[str, Any], names: List[str], on: List[str],
                 impls: List[str] = ("auto", "explicit")) -> List[tuple]:
  return [(variant, target, dict(shape, **{"model.attention_impl": impl}))
          for target in on for impl in impls for variant in names]


def long_context_rows(shape: Dict[str, Any], tiny: bool) -> List[tuple]:
  long = dict(LONG, **({"model.context_length": 1024, "model.max_position_embeddings": 1024}
                       if tiny else {}))
  return [("sas_p", target, dict(shape, **long, **{"model.attention_impl": impl}))
          for target in ("v5e-1", "h200") for impl in ("fused", "explicit")]


def depth_rows(shape: Dict[str, Any], tiny: bool) -> List[tuple]:
  depths = (2, 8) if tiny else (18, 72)
  return [("sas_p", "v5e-8", dict(shape, **{"model.n_layer": n, "model.scan_layers": scan}))
          for scan in (True, False) for n in depths]


def pod_rows(shape: Dict[str, Any], tiny: bool) -> List[tuple]:
  pod = {"parallel.fsdp": 8, "batch_size": 512}
  return [("sas_p", "v5e-64" if tiny else "v5e-256", dict(shape, **pod))]


def row_key(row: Dict[str, Any]) -> str:
  """What makes two rows the same row: variant, target and overrides."""
  return json.dumps([row["variant"], row["target"], row["overrides"]], sort_keys=True)


def merged(kept: Dict[str, Any], fresh: Dict[str, Any]) -> Dict[str, Any]:
  """`fresh` results with the rows of `kept` that it did not compile: a row compiled again
  takes its old row's place, a new one goes last."""
  out = dict(fresh)
  for name in ROWS:
    if name not in kept:
      continue
    rows = list(kept[name])
    where = {row_key(r): i for i, r in enumerate(rows)}
    for row in fresh.get(name, []):
      if row_key(row) in where:
        rows[where[row_key(row)]] = row
      else:
        rows.append(row)
    out[name] = rows
  return out


def kept_results(output: str, shape: Dict[str, Any]) -> Dict[str, Any]:
  """`<output>/results.json` for --update ({} where there is none); exits with one line, before
  anything is compiled, where it holds another shape."""
  path = os.path.join(output, "results.json")
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    kept = json.load(f)
  if kept.get("shape") != shape:
    sys.exit(f"compiled_targets.py: error: --update: {path} holds the shape {kept.get('shape')}, "
             f"this run compiles {shape}; drop --update or pass another --output.")
  return kept


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default=",".join(ROWS), help=f"Comma-separated of {ROWS}.")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--targets", default="h200,v5e-8", help="Of the variant rows.")
  parser.add_argument("--impls", default="auto,explicit", help="The variant rows' "
                      "model.attention_impl values (a variant the speed package falls back for "
                      "compiles the same reference program under both: give auto alone).")
  parser.add_argument("--jobs", type=int, default=1, help="Rows compiled at once (each a "
                      "process; compile seconds are then shared-machine timings).")
  parser.add_argument("--tiny", action="store_true", help="Tiny shapes (checks the script).")
  parser.add_argument("--output", default=os.path.join(report_lib.REPO_ROOT, "experiments",
                                                       "results", "compiled"))
  parser.add_argument("--update", action="store_true", help="Keep the rows of "
                      "<output>/results.json that this run does not compile; replace those "
                      "it does.")
  args = parser.parse_args(argv)
  shape = SHAPES["tiny" if args.tiny else "paper"]
  chosen = args.rows.split(",")
  kept = kept_results(args.output, shape) if args.update else {}
  script = shlex.join(["python", "experiments/compiled_targets.py",
                       *(sys.argv[1:] if argv is None else argv)])
  made = {"script": script, "commit": source_commit()}
  results: Dict[str, Any] = {"shape": shape, "versions": report.versions(), "script": script}
  planned = {"variants": variant_rows(shape, args.variants.split(","), args.targets.split(","),
                                      args.impls.split(",")),
             "long_context": long_context_rows(shape, args.tiny),
             "depth": depth_rows(shape, args.tiny), "pod": pod_rows(shape, args.tiny)}
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for name in ROWS:
      if name in chosen:
        by_part = name == "variants"   # the report splits the variant rows' bytes
        results[name] = list(pool.map(lambda row: compile_row(*row, made, by_part),
                                      planned[name]))
  if kept:
    results = merged(kept, results)
  os.makedirs(args.output, exist_ok=True)
  text = compiled_targets_report.markdown(results)
  report_lib.write_report(args.output, text, results)
  if results.get("variants"):
    compiled_targets_report.plot(results["variants"],
                                 os.path.join(args.output, "roofline_vs_preln.png"))
  print(f"Wrote {args.output}/report.md and results.json")


if __name__ == "__main__":
  main()
