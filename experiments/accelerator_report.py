"""The markdown report (and plots) of `accelerator_check.py`'s results: one section per part.

    text = report(results, output_folder, command)   # also writes the PNGs into output_folder

A new part adds its key and section function to SECTIONS.
"""
import os

from experiments import report_lib

PAPER_SPEEDUPS = {"sas": 1.09, "sas_p": 1.16, "sas_p_nonorm": 1.20}   # He & Hofmann, Table 1


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def report(results: dict, output: str, command: str) -> str:
  """Writes the plots and returns the markdown report of `run_check`'s results."""
  lines = [f"# Accelerator check: {results['device']} ({results['backend']}, jax {results['jax']})",
           "", f"`{command}` ({results['date']}, {results['wall_s']:.0f} s in all)", ""]
  for key, section in SECTIONS:
    if key in results:
      lines += section(results[key], output)
  return "\n".join(lines)


def _equalities(rows: list, output: str) -> list:
  del output
  lines = ["## a. Equalities (relative error ||fused - explicit|| / ||explicit||)", ""]
  return lines + report_lib.markdown_table(
      ["check", "dtype", "relative error", "tolerance", "ok", "fused path on cuDNN"],
      [[r["check"], r["dtype"], _fmt(r.get("rel_error"), ".2e"), _fmt(r.get("tolerance"), ".0e"),
        {True: "yes", False: "**NO**", None: r.get("note", "-")}[r["ok"]],
        {True: "yes", False: "no", None: "-"}[r.get("fused_path_uses_cudnn")]]
       for r in rows], align="llrrll") + [""]


def _throughput(bench: dict, output: str) -> list:
  first = next(iter(bench.values()))
  lines = [f"## b. Throughput at B={first['batch_size']} T={first['seq_len']} "
            f"L={first['n_layer']} D={first['n_embd']} V={first['vocab_size']}, {first['dtype']}",
            "", "Ratios are paired within rounds (each round times every config once).", ""]
  lines += report_lib.markdown_table(
      ["config", "params", "tokens/s", "x Pre-LN", "paper", "MFU (measured peak)",
       "MFU (nominal)", "memory", "compile", "measured / roofline"],
      [[name, f"{r['params_trainable'] / 1e6:.1f}M", f"{r['tokens_per_sec']:,.0f}",
        f"{r['speedup_paired']:.3f}", _fmt(PAPER_SPEEDUPS.get(name), ".2f"),
        f"{100 * r['mfu']:.1f}%", _fmt(r["mfu_nominal"] and 100 * r["mfu_nominal"], ".1f"),
        f"{r['memory_bytes'] / 2**30:.2f} GiB", f"{r['compile_s']:.0f} s",
        _fmt(r.get("measured_over_roofline"), ".2f")]
       for name, r in bench.items()])
  report_lib.plot_bars({n: r["speedup_paired"] for n, r in bench.items()},
                       os.path.join(output, "throughput.png"), reference=1.0,
                       title="Training throughput relative to Pre-LN", ylabel="x Pre-LN")
  return lines + ["", "measured / roofline: the median step over the compiled program's roofline "
                   "on this device (`python -m simplified_flax.compile`'s estimate; 1 would be "
                   "every kernel at its ceiling).", "", "![throughput](throughput.png)", ""]


def _long_context(rows: list, output: str) -> list:
  del output
  return ["## c. Long context (SAS-P)", ""] + report_lib.markdown_table(
      ["T", "attention", "step memory", "step time", "tokens/s"],
      [[r["seq_len"], r["attention_impl"]] + (["out of memory", "-", "-"] if r["oom"] else [
          f"{r['memory_bytes'] / 2**30:.2f} GiB", f"{1e3 * r['step_time_s']:.1f} ms",
          f"{r['tokens_per_sec']:,.0f}"]) for r in rows], align="rlrrr") + [""]


def _training(train: dict, output: str) -> list:
  lines = ["## d. Training comparison (same windows, same order)", ""]
  lines += report_lib.markdown_table(
      ["variant", "final eval loss", "final train loss", "tokens/s", "training time"],
      [[n, f"{r['final_eval_loss']:.4f}", f"{r['final_train_loss']:.4f}",
        f"{r['tokens_per_sec']:,.0f}", f"{r['train_s']:.0f} s"] for n, r in train.items()])
  histories = {n: r["history"] for n, r in train.items()}
  report_lib.plot_curves(histories, os.path.join(output, "loss_vs_step.png"),
                         title="Training loss vs step")
  report_lib.plot_curves(histories, os.path.join(output, "loss_vs_time.png"), x="time_s",
                         xlabel="training time (s)", title="Training loss vs training time")
  return lines + ["", "![loss vs step](loss_vs_step.png) ![loss vs time](loss_vs_time.png)", ""]


def _breakdown(per_config: dict, output: str) -> list:
  del output
  lines = ["## e. Where the step's time goes (profiled kernels; FLOPs and bytes from the HLO)", ""]
  for name, r in per_config.items():
    lines += [f"**{name}** (batch {r['batch_size']}): step {1e3 * r['step_time_s']:.1f} ms, "
              f"kernels {1e3 * r['op_time_s']:.1f} ms summed", ""]
    lines += report_lib.markdown_table(
        ["part", "time", "share", "GFLOP", "GB", "TFLOP/s", "GB/s"],
        [[part, _fmt(p["time_s"] and 1e3 * p["time_s"], ".2f") + " ms",
          _fmt(p["share"] and 100 * p["share"], ".1f") + "%", f"{p['flops'] / 1e9:.1f}",
          f"{p['bytes'] / 1e9:.2f}",
          _fmt(p["flops"] / p["time_s"] / 1e12 if p["time_s"] else None, ".1f"),
          _fmt(p["bytes"] / p["time_s"] / 1e9 if p["time_s"] else None, ".0f")]
         for part, p in r["parts"].items()], align="lrrrrrr") + [""]
  return lines


def _xla_flags(rows: list, output: str) -> list:
  del output
  lines = ["## f. XLA flags (one process each; ratios to the first row)", ""]
  return lines + report_lib.markdown_table(
      ["XLA flags", "tokens/s", "x first", "matmul peak x first", "compile"],
      [[f"`{r['xla_flags']}`" if r["xla_flags"] else "(none)"] + (
          [f"failed: {r['error']}", "-", "-", "-"] if "error" in r else
          [f"{r['tokens_per_sec']:,.0f}", _fmt(r.get("tokens_ratio"), ".3f"),
           _fmt(r.get("peak_ratio"), ".3f"), f"{r['compile_s']:.0f} s"]) for r in rows],
      align="lrrrr") + ["", "Share of the step's kernel time per part (its --breakdown):", ""] + (
          _shares_table([r for r in rows if "shares" in r]))


def _shares_table(rows: list) -> list:
  if not rows:
    return []
  parts = list(rows[0]["shares"])
  return report_lib.markdown_table(
      ["XLA flags"] + parts,
      [[f"`{r['xla_flags']}`" if r["xla_flags"] else "(none)"] +
       [_fmt(r["shares"][p] and 100 * r["shares"][p], ".1f") for p in parts] for r in rows],
      align="l" + "r" * len(parts)) + [""]


def _compile_depth(rows: list, output: str) -> list:
  del output
  shallow, deep = min(rows[-1]["seconds"]), max(rows[-1]["seconds"])
  lines = ["## g. Compile to first step against depth (SAS-P, b's shape)", ""]
  return lines + report_lib.markdown_table(
      ["scan_layers", f"L={shallow}", f"L={deep}", f"L={deep} / L={shallow}"],
      [[str(r["scan_layers"]), f"{r['seconds'][shallow]:.1f} s"] + (
          [f"{r['seconds'][deep]:.1f} s", f"{r['seconds'][deep] / r['seconds'][shallow]:.2f}x"]
          if deep in r["seconds"] else ["-", "-"]) for r in rows],
      align="lrrr") + [""]


# (results key, section): the report's order; a new part adds its own.
SECTIONS = (("equalities", _equalities), ("throughput", _throughput),
            ("breakdown", _breakdown), ("long_context", _long_context),
            ("training", _training), ("compile_depth", _compile_depth),
            ("xla_flags", _xla_flags))
