"""Each follow-up's own headline claim, checked on the runs of the follow-ups comparison where
this budget can check it (docs/beyond_the_paper.md, "The comparison at the CPU scale").

    python experiments/followup_claims.py --report=experiments/results/cpu/followups

reads the sweep's `results.json` (each variant at its own best learning rate, and every run's
workdir, which must still exist) and writes `claims.md` and `claims.json` beside it:

- nGPT (Loshchilov et al.: the same loss in 4-20x fewer steps): per seed, the first logged
  step at which nGPT's train loss (each logged value is the mean over its logging interval) is
  at or below Pre-LN's at its last step, each at its own best rate.
- Gated attention (Qiu et al.: no attention sink, no massive activations): from each final
  checkpoint on the first eval batches, the share of attention on the first token (mean over
  layers, heads and queries after the first) and the largest |activation| of any block's output,
  for Pre-LN and SAS-P with and without the gate.
- DyT and Derf (parity with the norm they replace): their verdict against Pre-LN in the report.
CompleteP's claim (a learning rate that transfers across depth) has its own sweep
(experiments/results/cpu/completep_transfer).
"""
import argparse
import json
import os
import statistics
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

EVAL_BATCHES = 2   # of the runs' eval batches, for the attention and activation measures
GATE_PAIRS = (("preln", "preln_gated"), ("sas_p", "sas_p_gated"))


def _history(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _best_runs(results: dict, variant: str) -> list[dict]:
  """The finished runs of `variant` at its best learning rate (the report's best-of row)."""
  (row,) = [r for r in results["best_of_rows"] if r["variant"] == variant]
  return sorted((r for r in results["runs"] if r["variant"] == variant
                 and r["point"]["optimizer.learning_rate"] == row["best"]
                 and r.get("final_eval_loss") is not None), key=lambda r: r["seed"])


def steps_to_reach(target_run: dict, run: dict) -> int | None:
  """The first logged step at which `run`'s train loss is at or below `target_run`'s last."""
  target = [r["loss"] for r in _history(target_run["workdir"]) if "loss" in r][-1]
  for row in _history(run["workdir"]):
    if "loss" in row and row["loss"] <= target:
      return row["step"]
  return None


def ngpt_claim(results: dict) -> dict:
  preln = {r["seed"]: r for r in _best_runs(results, "preln")}
  ngpt = [r for r in _best_runs(results, "ngpt") if r["seed"] in preln]
  steps = {n["seed"]: steps_to_reach(preln[n["seed"]], n) for n in ngpt}
  preln = list(preln.values())
  total = preln[0]["steps"]
  return {"preln_rate": preln[0]["point"]["optimizer.learning_rate"],
          "ngpt_rate": ngpt[0]["point"]["optimizer.learning_rate"], "steps": total,
          "ngpt_steps_to_preln_final": steps,
          "speedups": {s: (total / v if v else None) for s, v in steps.items()}}


def attention_measures(workdir: str) -> dict:
  """(sink share, largest |activation|) of a run's final checkpoint on its first eval batches,
  through the reference model's explicit form (which sows A)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from simplified_flax.data import build_pipeline  # pylint: disable=import-outside-toplevel
  from simplified_flax.model import transformer  # pylint: disable=import-outside-toplevel
  from simplified_flax.training import evaluation  # pylint: disable=import-outside-toplevel
  config = evaluation.load_config(workdir)
  restored = evaluation.restore_read_only(workdir, config)
  model_config = config.model.copy_and_resolve_references()
  model_config.attention_impl = "explicit"
  model = transformer.build_model(model_config)
  pipeline = build_pipeline(config, workdir=workdir, process_index=0, process_count=1)

  @jax.jit
  def measures(params, constants, tokens_BT):
    _, state = model.apply({"params": params, **constants}, tokens_BT,
                           mutable=["intermediates"])
    leaves = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
    probs = [x for p, x in leaves if "attn_probs" in jax.tree_util.keystr(p)]
    hidden = [x for p, x in leaves if "hidden" in jax.tree_util.keystr(p)]
    sink = sum(p_BHQK[:, :, 1:, 0].mean() for p_BHQK in probs) / len(probs)
    return sink, jnp.max(jnp.stack([jnp.abs(h).max() for h in hidden]))

  sinks, peaks = [], []
  for batch in pipeline.eval_batches(EVAL_BATCHES):
    sink, peak = measures(restored.state.params, restored.state.constants, batch["inputs"])
    sinks.append(float(sink))
    peaks.append(float(peak))
  return {"first_token_attention": statistics.mean(sinks), "max_abs_activation": max(peaks)}


def gate_claim(results: dict) -> dict:
  T = _context_length(results)
  out = {"uniform_first_token_attention": float(np.mean(1.0 / np.arange(2, T + 1)))}
  for variant in {v for pair in GATE_PAIRS for v in pair}:
    runs = _best_runs(results, variant)
    measured = [attention_measures(r["workdir"]) for r in runs]
    out[variant] = {"rate": runs[0]["point"]["optimizer.learning_rate"],
                    **{k: statistics.mean(m[k] for m in measured) for k in measured[0]},
                    "per_seed": measured}
  return out


def _context_length(results: dict) -> int:
  with open(os.path.join(results["runs"][0]["workdir"], "config.json")) as f:
    return json.load(f)["model"]["context_length"]


def norm_free_claim(results: dict) -> dict:
  rows = {r["variant"]: r for r in results["best_of_rows"]}
  return {v: {k: rows[v][k] for k in ("best", "final_eval_loss_mean", "mean_difference", "low",
                                      "high", "verdict")}
          for v in ("preln_dyt", "preln_derf", "sas_p_dyt") if v in rows}


def markdown(claims: dict, report: str) -> str:
  n = claims["ngpt"]
  steps = ", ".join(f"seed {s}: {v if v is not None else 'never'}"
                    for s, v in n["ngpt_steps_to_preln_final"].items())
  speedups = [v for v in n["speedups"].values() if v]
  lines = [
      "# The follow-ups' own claims at the comparison's scale", "",
      f"From the runs of [report.md](report.md) (each variant at its own best learning rate), "
      f"by `python experiments/followup_claims.py --report={report}`.", "",
      "## nGPT: the same loss in fewer steps", "",
      f"The first logged step (every 25) at which nGPT's train loss (at {n['ngpt_rate']:g}) is at "
      f"or below Pre-LN's at its last step ({n['steps']}, at {n['preln_rate']:g}): {steps}"
      + (f"; {min(speedups):.2f}x to {max(speedups):.2f}x fewer steps." if speedups else "."),
      "The paper reports 4x to 20x at 1K to 8K context over billions of tokens; "
      "300 steps of 1,024 tokens cannot test that range.", "",
      "## Gated attention: no attention sink, no massive activations", "",
      f"From each final checkpoint, on the first {EVAL_BATCHES} eval batches, mean over seeds: "
      "the share of attention on the first token (mean over layers, heads and every query "
      "after the first) and the largest |activation| of any block's output.", "",
      "| variant | best rate | attention on the first token | largest \\|activation\\| |",
      "| --- | ---: | ---: | ---: |"]
  for plain, gated in GATE_PAIRS:
    for v in (plain, gated):
      g = claims["gated"][v]
      lines.append(f"| `{v}` | {g['rate']:g} | {g['first_token_attention']:.4f} | "
                   f"{g['max_abs_activation']:.2f} |")
  uniform = claims["gated"]["uniform_first_token_attention"]
  lines += ["", f"Attention spread evenly over the visible keys would put {uniform:.4f} on the "
            "first token (the mean of 1 / (q + 1) over the queries after the first). A sink is "
            "a share far above that. The paper measures it in models of billions of parameters "
            "trained on hundreds of billions of tokens; a row near the even share says no sink "
            "has formed at this budget, so the gate has none to remove here.", "",
            "## DyT and Derf: parity with the norm they replace", ""]
  for v, row in claims["norm_free"].items():
    diff = ("-" if row["mean_difference"] is None else
            f"{row['mean_difference']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]"
            if row["low"] is not None else f"{row['mean_difference']:+.4f}")
    best = "none learned" if row["best"] is None else f"{row['best']:g}"
    lines.append(f"- `{v}`: best rate {best}, against Pre-LN {diff}: **{row['verdict']}**.")
  lines += ["", "## CompleteP", "", "Its claim, a learning rate that transfers across depth, "
            "has its own sweep: [../completep_transfer/report.md](../completep_transfer/"
            "report.md).", ""]
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--report", required=True, help="The folder of the sweep's results.json.")
  args = parser.parse_args()
  with open(os.path.join(args.report, "results.json")) as f:
    results = json.load(f)
  claims = {"ngpt": ngpt_claim(results), "gated": gate_claim(results),
            "norm_free": norm_free_claim(results)}
  with open(os.path.join(args.report, "claims.json"), "w") as f:
    json.dump(claims, f, indent=2, default=lambda x: float(x) if isinstance(x, np.floating)
              else str(x))
  with open(os.path.join(args.report, "claims.md"), "w") as f:
    f.write(markdown(claims, args.report))
  print(f"Wrote {os.path.join(args.report, 'claims.md')}")


if __name__ == "__main__":
  main()
