"""Does the input pipeline outrun the accelerator? Tokens/s per host, pipeline alone.

    python experiments/benchmark_data.py --output=experiments/results/cpu/data_pipeline

On the default corpus (the interpreter's stdlib, byte tokenizer), prepared once into shards
(timed, with one worker process per core, 100 documents per shard so batches gather
across shards as they do at scale), this draws batches from `train_iterator()` (the
background prefetch thread included, nothing consuming them) at T=128 and T=1024, windows
and packed, for the decoder and the MLM encoder, with 16,384 tokens per batch (the paper's
128 x 128). It also times a resume deep into a run (set_state at batch 10^7, then the next
batch). Beside these it puts what training consumes at the paper's shape: the Pre-LN step of
experiments/results/cpu/throughput (this CPU) and the H200 figure the target is set from.
The target: the pipeline delivers at least 10x what one accelerator consumes.

It also prices the data checks (docs/reliability.md; experiments/data_checks_cost.py): the
token-id check per batch (decoder, T=128, windows, with it and without it, alternated in one
process) and the shard checksums once per process, as a share of one epoch's pipeline time
(target: <= 5%). `--verification_only` measures just that (and the preparation it needs).

With --compare_grain (needs `pip install grain`), each setting is also drawn through grain,
in the same process, right after the hand-written iterator: "grain rows" lets grain shuffle,
batch and prefetch the row ids (`MapDataset.range(R).shuffle(seed).repeat().batch(B)`, rows
gathered by this package), "grain batches" lets grain only iterate and prefetch this
package's batches (`MapDataset.range(...).map(train_batch)`).
"""
import argparse
import datetime
import importlib.util
import json
import platform
import os
import sys
import tempfile
import time

# Run as a script from anywhere: the repository root holds `configs` and `simplified_flax`.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import configs  # pylint: disable=g-import-not-at-top
from simplified_flax import prepare  # pylint: disable=g-import-not-at-top
from simplified_flax.data import build_pipeline  # pylint: disable=g-import-not-at-top
from experiments import data_checks_cost  # pylint: disable=g-import-not-at-top

TOKENS_PER_BATCH = 128 * 128
TARGET_RATIO = 10


def _config(cache_dir: str, seq_len: int, packing: bool, kind: str):
  config = configs.load("preln" + (":encoder" if kind == "encoder" else ""))
  config.model.context_length = seq_len
  config.model.max_position_embeddings = max(seq_len, 1024)
  config.batch_size = TOKENS_PER_BATCH // seq_len
  config.data.packing = packing
  config.data.cache_dir = cache_dir
  config.data.shard_docs = 100  # 17 shards: every batch gathers across shards, as at scale
  return config


def _tokens_per_second(iterator, num_batches: int) -> float:
  next(iterator)  # starts the prefetch thread
  start = time.perf_counter()
  tokens = sum(next(iterator)["inputs"].size for _ in range(num_batches))
  seconds = time.perf_counter() - start
  getattr(iterator, "close", lambda: None)()
  return tokens / seconds


def pipeline_tokens_per_second(config, num_batches: int) -> dict:
  iterator = build_pipeline(config, process_index=0, process_count=1).train_iterator()
  tokens_per_s = _tokens_per_second(iterator, num_batches)
  return {"tokens_per_s": tokens_per_s, "batches": num_batches,
          "seconds": num_batches * TOKENS_PER_BATCH / tokens_per_s}


def grain_tokens_per_second(config, num_batches: int) -> dict:
  """Tokens/s of the hand-written iterator and of the two grain streams (see the module doc),
  one after the other, each on a freshly built pipeline."""
  import grain  # pylint: disable=g-import-not-at-top
  read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)

  def grain_rows(maker):
    rows = grain.MapDataset.range(maker.source.num_rows).shuffle(seed=config.seed).repeat()
    return rows.batch(maker.global_batch, drop_remainder=True).map_with_index(
        lambda k, ids_B: maker._batch(ids_B, [config.seed, k]))  # pylint: disable=protected-access

  streams = {"hand_written": lambda pipeline: pipeline.train_iterator(),
             "grain_rows": lambda pipeline: iter(grain_rows(pipeline.train).to_iter_dataset(read)),
             "grain_batches": lambda pipeline: iter(grain.MapDataset.range(10**15).map(
                 pipeline.train.train_batch).to_iter_dataset(read))}
  result = {}
  for name, stream in streams.items():
    pipeline = build_pipeline(config, process_index=0, process_count=1)
    result[name] = _tokens_per_second(stream(pipeline), num_batches)
  return {**result, "grain_rows_ratio": result["grain_rows"] / result["hand_written"],
          "grain_batches_ratio": result["grain_batches"] / result["hand_written"],
          "grain_version": grain.__version__}


def resume_seconds(config, batch_index: int) -> float:
  """Seconds from nothing to the batch after a checkpointed position: build, restore, draw."""
  start = time.perf_counter()
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  iterator = pipeline.train_iterator()
  state = iterator.get_state()
  iterator.set_state({**state, "batches_drawn": batch_index})
  next(iterator)
  iterator.close()
  return time.perf_counter() - start


def training_consumption() -> dict:
  """Tokens/s a training step consumes at the paper's shape (L=18, D=768, T=128, batch 128),
  as measured by the committed accelerator check and CPU throughput runs (those present)."""
  consumers = {}
  h200 = os.path.join(REPO, "experiments/results/h200/results.json")
  if os.path.exists(h200):
    with open(h200, encoding="utf-8") as f:
      results = json.load(f)
    for name, run in results.get("training", {}).items():   # byte vocabulary, as here
      consumers[f"h200 {name}, V=259 (experiments/results/h200)"] = run["tokens_per_sec"]
    for name, run in results.get("throughput", {}).items():
      if "/" not in name and "+" not in name:   # the plain variants, V=50,257
        consumers[f"h200 {name}, V=50,257 (experiments/results/h200)"] = run["tokens_per_sec"]
  cpu = os.path.join(REPO, "experiments/results/cpu/throughput/benchmark.json")
  if os.path.exists(cpu):
    with open(cpu, encoding="utf-8") as f:
      consumers["cpu_paper_shape_preln (experiments/results/cpu/throughput)"] = (
          json.load(f)["preln"]["tokens_per_sec"])
  return consumers


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batches", type=int, default=300, help="batches timed per setting")
  parser.add_argument("--cache_dir", default=None, help="shard root (default: a temp dir)")
  parser.add_argument("--output", default=None, help="write results.json and report.md here")
  parser.add_argument("--verification_only", action="store_true",
                      help="only measure what the shard checksum and id checks cost")
  parser.add_argument("--compare_grain", action="store_true",
                      help="also draw every setting through grain (pip install grain)")
  args = parser.parse_args()
  if args.compare_grain and importlib.util.find_spec("grain") is None:
    parser.error("--compare_grain needs grain: pip install grain")
  cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="benchmark_data_")

  start = time.perf_counter()
  prepare.prepare(_config(cache_dir, 128, False, "decoder"), workers=os.cpu_count() or 1,
                      workdir=None)
  prepare_s = time.perf_counter() - start
  verification = data_checks_cost.verification_cost(_config(cache_dir, 128, False, "decoder"),
                                                    args.batches)
  print(f"data checks: {verification['with_checks_tokens_per_s']:,.0f} tokens/s with, "
        f"{verification['without_checks_tokens_per_s']:,.0f} without; checksums "
        f"{verification['checksum_s']:.2f} s once; over one epoch "
        f"{100 * verification['epoch_cost']:.1f}% (target <= "
        f"{100 * data_checks_cost.MAX_COST:.0f}%)",
        flush=True)
  machine = {"command": "python experiments/benchmark_data.py " + " ".join(sys.argv[1:]),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
             "host_cpus": os.cpu_count()}
  if args.verification_only:
    results = {**machine, "load_average_1m": os.getloadavg()[0], "prepare_s": prepare_s,
               "verification": verification}
    _write(args.output, results, data_checks_cost.report(results))
    return
  rows, grain_rows = [], []
  for kind, seq_len, packing in [("decoder", 128, False), ("decoder", 128, True),
                                 ("decoder", 1024, False), ("decoder", 1024, True),
                                 ("encoder", 128, False), ("encoder", 128, True)]:
    setting = {"kind": kind, "T": seq_len, "packing": packing,
               "batch": TOKENS_PER_BATCH // seq_len}
    config = _config(cache_dir, seq_len, packing, kind)
    result = pipeline_tokens_per_second(config, args.batches)
    rows.append({**setting, **result})
    print(f"{kind:8s} T={seq_len:5d} packing={packing!s:5s}: "
          f"{result['tokens_per_s']:14,.0f} tokens/s", flush=True)
    if args.compare_grain:
      grain_rows.append({**setting, **grain_tokens_per_second(config, args.batches)})
      print(f"  grain rows / hand-written: {grain_rows[-1]['grain_rows_ratio']:.2f}x, grain "
            f"batches / hand-written: {grain_rows[-1]['grain_batches_ratio']:.2f}x", flush=True)
  resume_s = resume_seconds(_config(cache_dir, 128, False, "decoder"), 10**7)
  consumers = training_consumption()
  slowest = min(r["tokens_per_s"] for r in rows)
  results = {**machine, "load_average_1m": os.getloadavg()[0],
             "prepare_s": prepare_s, "verification": verification, "resume_at_batch_1e7_s":
             resume_s, "pipeline": rows, "consumers_tokens_per_s": consumers,
             "slowest_pipeline_over_consumer": {k: slowest / v for k, v in consumers.items()}}
  if grain_rows:
    results["grain"] = grain_rows
  print(f"prepare (stdlib, both splits): {prepare_s:.1f} s; resume at batch 1e7: "
        f"{resume_s:.2f} s")
  for name, value in consumers.items():
    ratio = slowest / value
    print(f"slowest pipeline setting / {name} ({value:,.0f} tokens/s) = {ratio:,.1f}x "
          f"(target >= {TARGET_RATIO}x: {'met' if ratio >= TARGET_RATIO else 'MISSED'})")
  _write(args.output, results, _report(results) + "\n" + data_checks_cost.lines(results))


def _report(results: dict) -> str:
  lines = ["# Input pipeline throughput (pipeline alone, one host)", "",
           f"    {results['command']}", "",
           f"Host: {results['host_cpus']} CPU cores, shared (load average "
           f"{results['load_average_1m']:.1f} when done). Corpus: the interpreter's stdlib "
           "(30M bytes), byte tokenizer, prepared once into 17 shards in "
           f"{results['prepare_s']:.1f} s. 16,384 tokens per batch.", "",
           "| model | T | packing | batch | tokens/s |", "|---|---|---|---|---|"]
  lines += [f"| {r['kind']} | {r['T']} | {r['packing']} | {r['batch']} | "
            f"{r['tokens_per_s']:,.0f} |" for r in results["pipeline"]]
  lines += ["", f"Resume deep in a run (build, set_state at batch 10^7, next batch): "
            f"{results['resume_at_batch_1e7_s']:.2f} s.", "",
            "| training step at the paper's shape | tokens/s | slowest pipeline setting / it |",
            "|---|---|---|"]
  lines += [f"| {k} | {v:,.0f} | {results['slowest_pipeline_over_consumer'][k]:,.1f}x |"
            for k, v in results["consumers_tokens_per_s"].items()]
  if "grain" in results:
    lines += ["", f"grain {results['grain'][0]['grain_version']} against the hand-written "
              "iterator (same pipeline, one after the other; tokens/s, ratio to hand-written):",
              "", "| model | T | packing | hand-written | grain rows | grain batches |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['T']} | {r['packing']} | {r['hand_written']:,.0f} | "
              f"{r['grain_rows']:,.0f} ({r['grain_rows_ratio']:.2f}x) | "
              f"{r['grain_batches']:,.0f} ({r['grain_batches_ratio']:.2f}x) |"
              for r in results["grain"]]
  return "\n".join(lines) + "\n"


def _write(output: str | None, results: dict, report: str) -> None:
  if output:
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "results.json"), "w", encoding="utf-8") as f:
      json.dump(results, f, indent=2)
    with open(os.path.join(output, "report.md"), "w", encoding="utf-8") as f:
      f.write(report)
    print(f"Wrote {output}/results.json and report.md")


if __name__ == "__main__":
  main()
