"""report.md and the plot of `compiled_targets.py`, from its results dict alone."""
import datetime
import re
from typing import Any, Dict, List

from experiments import report_lib
from experiments import step_breakdown

GiB = 2 ** 30


def _by(rows, **match) -> List[Dict[str, Any]]:
  return [r for r in rows if all(r.get(k, r["overrides"].get(k)) == v for k, v in match.items())]


def _impl(row) -> str:
  return row["overrides"].get("model.attention_impl", "auto")


def with_ratios(rows: List[Dict[str, Any]]) -> None:
  """Sets each variant row's `x_preln` (Pre-LN's roofline over its own), `bytes_x_preln` and
  `xla_bytes_x_preln` (its bytes over Pre-LN's), against Pre-LN on the same target and path."""
  for row in rows:
    ref = [r for r in rows if r["variant"] == "preln" and r["target"] == row["target"]
           and _impl(r) == _impl(row) and r.get("roofline_step_s")]
    if ref and row.get("roofline_step_s"):
      row["x_preln"] = ref[0]["roofline_step_s"] / row["roofline_step_s"]
      row["bytes_x_preln"] = row["bytes_per_device"] / ref[0]["bytes_per_device"]
    if ref and _xla_bytes(row) and _xla_bytes(ref[0]):
      row["xla_bytes_x_preln"] = _xla_bytes(row) / _xla_bytes(ref[0])


def _xla_bytes(row) -> float | None:
  """XLA's own cost_analysis bytes per device (TPU programs; None on GPU, where it is absent)."""
  return (row.get("xla_cost_analysis") or {}).get("bytes accessed")


def _xla_bytes_cell(row) -> str:
  if not _xla_bytes(row):
    return "-"
  return f"{_xla_bytes(row) / 1e9:.2f} ({row.get('xla_bytes_x_preln', 0):.3f})"


def _between_devices_cell(row) -> str:
  """The bytes the step's collectives reduce or gather (rows compiled before the report read
  them: '-')."""
  found = row.get("collective_bytes_per_device")
  return "-" if found is None else f"{sum(found.values()) / 1e9:.2f}"


def _variant_lines(rows, paper) -> List[str]:
  with_ratios(rows)
  table = []
  for r in rows:
    if not r.get("fits", True) and "roofline_step_s" not in r:
      table.append([r["target"], _impl(r), r["variant"], "-", "-", "-", "-", "-", "-", "-",
                    "-", "does not fit", _fast_cell(r)])
      continue
    table.append([r["target"], _impl(r), r["variant"], f"{r['flops_per_device'] / 1e12:.2f}",
                  f"{r['bytes_per_device'] / 1e9:.2f} ({r.get('bytes_x_preln', 0):.3f})",
                  f"{r['non_matmul_bytes_per_device'] / 1e9:.1f}", _between_devices_cell(r),
                  f"{r['roofline_step_s'] * 1e3:.2f}", f"{r.get('x_preln', 0):.3f}",
                  paper.get(r["variant"], "-"), _xla_bytes_cell(r),
                  f"{r['memory_per_device_bytes']['total'] / GiB:.2f} ({r['attention_kernel']})",
                  _fast_cell(r)])
  return report_lib.markdown_table(
      ["target", "path", "variant", "TFLOP/device", "GB moved (x Pre-LN)", "non-matmul GB",
       "between devices GB", "roofline ms", "x Pre-LN", "paper", "XLA bytes GB (x Pre-LN)",
       "GiB/device (kernel)", "fast path"],
      table,
      align="lll" + "r" * 9 + "l")


def _fast_cell(row) -> str:
  """Whether the speed package built the row's program ("applied"), or the field that made it
  the reference model. Rows compiled before the compile report recorded it: read from the
  row's config against today's table of verified settings (fast/plan.py), marked "*"."""
  path, mark = row.get("fast_path"), ""
  if path is None:
    import configs  # pylint: disable=import-outside-toplevel
    from simplified_flax.aot import report  # pylint: disable=import-outside-toplevel
    path, mark = report.fast_path(configs.load(row["variant"], row["overrides"]).model), "*"
  cell = path if path == "applied" or path.startswith("off") else \
      "reference (" + path.split("model.", 1)[-1].split(" ", 1)[0] + ")"
  return cell + mark


def _non_matmul_lines(rows) -> List[str]:
  """The bytes outside matmuls of each variant on the default path, by part of the step (rows
  compiled with the split); [] where no row has it."""
  parts = step_breakdown.NON_MATMUL_PARTS
  table = [[r["target"], r["variant"], *[f"{r['non_matmul_parts'][p] / 1e9:.2f}" for p in parts],
            f"{sum(r['non_matmul_parts'].values()) / 1e9:.2f}"]
           for r in rows if _impl(r) == "auto" and r.get("non_matmul_parts")]
  if not table:
    return []
  return ["### Bytes outside matmuls, by part of the step (default path, GB per device)", "",
          "The non-matmul column above, split by the name scopes XLA keeps on each kernel: the "
          "parts of `python experiments/benchmark.py --target=NAME --breakdown`, with its "
          "elementwise part cut by what the kernels do (experiments/step_breakdown.py). A TPU "
          "program fuses most elementwise work into its matmuls' kernels (counted with them) and "
          "moves weights between HBM and VMEM in copies of their own. What each part holds, and "
          "what was tried to shrink it: optimisation_log.md.", "",
          *report_lib.markdown_table(["target", "variant", *parts, "all"], table,
                                     align="ll" + "r" * (len(parts) + 1))]


def _norm_floor_lines(rows) -> List[str]:
  """The norms' bytes of each variant on the default path against their one-pass floor (rows
  compiled with the split); [] where no row has norm kernels of their own."""
  table = []
  for r in rows:
    floors = r.get("norm_floors") or {}
    moved, floor = (sum(f[k] for f in floors.values()) for k in ("bytes", "floor"))
    if _impl(r) == "auto" and f"{moved / 1e9:.2f}" != "0.00":   # a TPU's are in its matmuls
      table.append([r["target"], r["variant"], f"{moved / 1e9:.2f}", f"{floor / 1e9:.2f}",
                    f"{(moved - floor) / 1e9:.2f}"])
  if not table:
    return []
  return ["### The norms against a one-pass floor (default path, GB per device)", "",
          "The norms' part above, and the floor of the same norms: per norm, layer and way, what "
          "its kernels read from outside the norm read once and their result written once, the "
          "traffic of a norm kernel that keeps a row on chip (`step_breakdown.norm_floors`; per "
          "norm: `benchmark.py --target=NAME --breakdown`). What taking the difference away would "
          "do to the targets: optimisation_log.md, eleventh pass. A TPU program fuses its norms "
          "into its matmuls' kernels, and has no row here.", "",
          *report_lib.markdown_table(["target", "variant", "norms", "floor", "over"], table,
                                     align="llrrr")]


def _memory_lines(rows) -> List[str]:
  table = []
  for r in rows:
    o = r["overrides"]
    needs = needed_gib(r.get("error", ""))
    need = (f"{r['memory_per_device_bytes']['total'] / GiB:.2f}" if "memory_per_device_bytes"
            in r else f"> {needs:.2f} (temporaries)" if needs else r.get("error", "-"))
    table.append([r["variant"], r["target"], o.get("model.n_layer", 18),
                  o.get("model.context_length", 128), o.get("batch_size", 128), _impl(r),
                  o.get("model.scan_layers", False), need, _between_devices_cell(r),
                  f"{r['compile_s']:.1f}" if "compile_s" in r else "-",
                  r.get("hosts", "-"), r.get("fits", False)])
  return report_lib.markdown_table(
      ["variant", "target", "layers", "T", "batch", "path", "scan", "GiB/device",
       "between devices GB", "compile s", "hosts", "fits"], table, align="ll" + "r" * 10)


def needed_gib(error: str) -> float | None:
  """The GiB a compiler's does-not-fit line says the step needs (TPU: "HLO temporaries
  (27.59G) exceeds ..."; the report's own: "it needs 27.59 GiB per device"), else None."""
  found = (re.search(r"temporaries \(([0-9.]+)G\)", error) or
           re.search(r"needs ([0-9.]+) GiB per device", error))
  return float(found.group(1)) if found else None


def _ratio_notes(results) -> List[str]:
  notes = []
  long = results.get("long_context", [])
  for target in sorted({r["target"] for r in long}):
    fused = [r for r in _by(long, target=target) if _impl(r) == "fused"]
    explicit = [r for r in _by(long, target=target) if _impl(r) == "explicit"]
    if fused and explicit and "memory_per_device_bytes" in fused[0]:
      f = fused[0]["memory_per_device_bytes"]["total"]
      if "memory_per_device_bytes" in explicit[0]:
        e = explicit[0]["memory_per_device_bytes"]["total"]
        notes.append(f"- Long context on {target}: fused {f / GiB:.2f} GiB against explicit "
                     f"{e / GiB:.2f} GiB per device ({f / e:.3f}x).")
      else:
        error = explicit[0].get("error", "")
        needs = needed_gib(error)
        ratio = (f" (fused <= {f / GiB / needs:.3f}x the explicit temporaries alone)"
                 if needs else "")
        notes.append(f"- Long context on {target}: fused {f / GiB:.2f} GiB; explicit does not "
                     f"fit: {error}{ratio}")
  depth = results.get("depth", [])
  for scan in (True, False):
    rows = sorted(_by(depth, **{"model.scan_layers": scan}),
                  key=lambda r: r["overrides"]["model.n_layer"])
    if len(rows) == 2 and all("compile_s" in r for r in rows):
      notes.append(f"- Compile on v5e-8, scan_layers={scan}: {rows[0]['compile_s']:.1f} s at "
                   f"{rows[0]['overrides']['model.n_layer']} layers, {rows[1]['compile_s']:.1f} "
                   f"s at {rows[1]['overrides']['model.n_layer']} "
                   f"({rows[1]['compile_s'] / rows[0]['compile_s']:.2f}x; a timing on this "
                   f"host).")
  return notes


def _provenance_lines(results: Dict[str, Any]) -> List[str]:
  """One line per (script command, commit, date, versions) that compiled rows, naming them."""
  groups: Dict[tuple, List[str]] = {}
  for name in ("variants", "long_context", "depth", "pod"):
    for r in results.get(name, []):
      versions = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items())
      key = (r.get("script", results["script"]), r.get("commit") or "an unrecorded commit",
             r.get("date", "-"), versions)
      what = f"{name} on {r['target']}" if name == "variants" else name
      labels = groups.setdefault(key, [])
      if what not in labels:
        labels.append(what)
  return [f"- `{script}` at {commit}, {date} ({versions}): the {', '.join(labels)} rows."
          for (script, commit, date, versions), labels in groups.items()]


def markdown(results: Dict[str, Any]) -> str:
  """The report: what was compiled, how to read it, the tables, every row's command."""
  lines = ["# The train step compiled for accelerators, read from the programs", "",
           f"Written {datetime.date.today().isoformat()} on a CPU-only host. Shape overrides: "
           f"`{results['shape']}`. The rows were compiled by:", "", *_provenance_lines(results),
           "",
           "Every figure is read from the program XLA compiled for the target "
           "(`python -m simplified_flax.compile`): buffers, FLOPs and bytes per device are "
           "exact for that program; the roofline (the sum over kernels of max(FLOPs / peak, "
           "bytes / HBM bandwidth), published peaks) is an estimate, not a timing. Compile "
           "seconds are the one timing, on this host. 'GB moved' is HBM traffic: on a TPU, "
           "buffers the compiler keeps in on-chip VMEM count nothing and arrays are padded to "
           "the TPU's tiles. 'Between devices' is what the step's collectives reduce or gather "
           "per device, link traffic the roofline does not count. The 'XLA bytes' column (TPU "
           "only, with its ratio to Pre-LN's) is XLA's own `cost_analysis`, which counts VMEM "
           "accesses and memory-space assignment's copies too (docs/compile.md).", ""]
  if results.get("variants"):
    lines += ["## Decoder variants (paper shape)", "",
              "'Fast path': 'applied' where the speed package built the program (docs/fast.md), "
              "else 'reference' and the first setting it has not verified; '*' where the row "
              "predates the compile report's record of it and the cell reads the row's config "
              "against today's table (fast/plan.py).", "",
              *_variant_lines(results["variants"], PAPER_TABLE), ""]
    split = _non_matmul_lines(results["variants"])
    lines += [*split, ""] if split else []
    floors = _norm_floor_lines(results["variants"])
    lines += [*floors, ""] if floors else []
  memory_rows = [r for k in ("long_context", "depth", "pod") for r in results.get(k, [])]
  if memory_rows:
    lines += ["## Long context, compile depth, pod", "", *_memory_lines(memory_rows), "",
              *_ratio_notes(results), ""]
  rows = [r for k in ("variants", "long_context", "depth", "pod") for r in results.get(k, [])]
  lines += ["## Commands", "", "Each row above is one of these:", "", "```",
            *[r["command"] for r in rows], "```", ""]
  return "\n".join(lines)


PAPER_TABLE = {"sas": 1.09, "sas_p": 1.16, "sas_p_nonorm": 1.20}


def plot(rows: List[Dict[str, Any]], path: str) -> None:
  """Bars: each variant's roofline speed relative to Pre-LN, per target, default path."""
  with_ratios(rows)
  values = {f"{r['variant']} {r['target']}": r["x_preln"] for r in rows
            if _impl(r) == "auto" and "x_preln" in r}
  report_lib.plot_bars(values, path, title="Roofline step speed vs Pre-LN (default path)",
                       ylabel="x Pre-LN (estimate)", reference=1.0)
