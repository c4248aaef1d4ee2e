"""What the data checks cost the input pipeline (docs/reliability.md): the crc32 of each shard
file as the shard is first opened, and the token-id range check of every batch. Used by
experiments/benchmark_data.py (`--verification_only` runs only this)."""
import contextlib
import glob
import json
import os
import statistics
import time


from etils import epath

from simplified_flax.data import build_pipeline
from simplified_flax.data import shard_checks

REPEATS = 5       # alternated runs with and without the checks
MAX_COST = 0.05   # the target: the checks cost at most 5% of pipeline throughput


@contextlib.contextmanager
def _checks_off():
  """The shard checksum and the token-id check replaced by no-ops (what `verification_cost`
  compares against); restored on exit."""
  saved = (shard_checks.verify_checksum, shard_checks.crc32_of_file, shard_checks.crc32_of_bytes,
           shard_checks.ids_in_range)
  shard_checks.verify_checksum = lambda *args: None
  shard_checks.crc32_of_file = shard_checks.crc32_of_bytes = lambda data: 0
  shard_checks.ids_in_range = lambda *args: True
  try:
    yield
  finally:
    (shard_checks.verify_checksum, shard_checks.crc32_of_file, shard_checks.crc32_of_bytes,
     shard_checks.ids_in_range) = saved


@contextlib.contextmanager
def _timed_id_check(spent: list):
  """`shard_checks.ids_in_range` (the batch's id check) wrapped in a timer: each call's
  seconds appended to `spent`."""
  real = shard_checks.ids_in_range
  def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
      return real(*args, **kwargs)
    finally:
      spent.append(time.perf_counter() - start)
  shard_checks.ids_in_range = timed
  try:
    yield
  finally:
    shard_checks.ids_in_range = real


def verification_cost(config, num_batches: int, warmup_batches: int = 50) -> dict:
  """What the checks cost, in one process. Per batch: `num_batches` drawn after
  `warmup_batches` (by then the shuffle has opened, so checksummed, every shard) with the id
  check and without, alternated `REPEATS` times: the ratio of the median tokens/s, and (less
  noisy on a shared host) the share of the draw's time spent inside the check, timed from
  within. Once per process: the seconds to checksum every shard file. Over one epoch of the
  split: both together, against the epoch's time."""
  def steady(checks: bool) -> tuple[float, float]:
    spent = []
    with _timed_id_check(spent) if checks else _checks_off():
      iterator = build_pipeline(config, process_index=0, process_count=1).train_iterator()
      for _ in range(warmup_batches):
        next(iterator)
      spent.clear()
      start = time.perf_counter()
      tokens = sum(next(iterator)["inputs"].size for _ in range(num_batches))
      seconds = time.perf_counter() - start
      iterator.close()
    return tokens / seconds, sum(spent) / seconds
  runs, shares = {"with_checks": [], "without_checks": []}, []
  for _ in range(REPEATS):
    tokens_per_s, share = steady(True)
    runs["with_checks"].append(tokens_per_s)
    shares.append(share)
    runs["without_checks"].append(steady(False)[0])
  with_checks, without = (statistics.median(runs[k]) for k in ("with_checks", "without_checks"))
  (split,) = glob.glob(os.path.join(config.data.cache_dir, f"*.{config.data.train_split}.*"))
  files = sorted(glob.glob(os.path.join(split, "tokens-*.npy")) +
                 glob.glob(os.path.join(split, "docs-*.npy")))
  start = time.perf_counter()
  for path in files:
    shard_checks.crc32_of_file(epath.Path(path))
  checksum_s = time.perf_counter() - start
  with open(os.path.join(split, "manifest.json"), encoding="utf-8") as f:
    epoch_tokens = sum(json.load(f)["shard_num_tokens"])
  share, epoch_s = statistics.median(shares), epoch_tokens / with_checks
  return {"setting": "decoder, T=128, windows", "batches": num_batches,
          "warmup_batches": warmup_batches, "runs_tokens_per_s": runs,
          "with_checks_tokens_per_s": with_checks, "without_checks_tokens_per_s": without,
          "measured_per_batch_cost": 1 - with_checks / without, "id_check_shares": shares,
          "per_batch_cost": share, "checksum_s": checksum_s,
          "shard_bytes": sum(os.path.getsize(p) for p in files), "epoch_tokens": epoch_tokens,
          "epoch_s": epoch_s, "epoch_cost": (checksum_s + share * epoch_s) / epoch_s}


def lines(results: dict) -> str:
  v = results["verification"]
  runs = {k: ", ".join(f"{x:,.0f}" for x in xs) for k, xs in v["runs_tokens_per_s"].items()}
  return "\n".join([
      f"Data checks, {v['setting']}, one process. Per batch (the token-id range check): "
      f"{v['batches']} batches after {v['warmup_batches']} of warm-up (every shard opened by "
      f"then), {len(v['runs_tokens_per_s']['with_checks'])} alternated runs each:", "",
      "| | median tokens/s | runs |", "|---|---|---|",
      f"| with the id check | {v['with_checks_tokens_per_s']:,.0f} | {runs['with_checks']} |",
      f"| id check replaced by a no-op | {v['without_checks_tokens_per_s']:,.0f} | "
      f"{runs['without_checks']} |", "",
      f"The ratio of the medians puts the id check at {100 * v['measured_per_batch_cost']:.1f}%"
      " (the runs vary more than that on a shared host). Timed from within (a timer around "
      f"each call, during the runs with it), the check takes {100 * v['per_batch_cost']:.2f}% "
      "of the draw's time (median of the runs). Once per process, the crc32 of every shard file "
      f"({v['shard_bytes'] / 2**20:.0f} MiB) takes {v['checksum_s']:.2f} s. Over one epoch of the "
      f"split ({v['epoch_tokens']:,} tokens, {v['epoch_s']:.1f} s) the checks together cost "
      f"{100 * v['epoch_cost']:.1f}% of pipeline throughput (target <= "
      f"{100 * MAX_COST:.0f}%: {'met' if v['epoch_cost'] <= MAX_COST else 'MISSED'}"
      "); a run shorter than an epoch pays the checksums in full, a longer one less.", ""])


def report(results: dict) -> str:
  return "\n".join(["# What the data checks cost", "", f"    {results['command']}", "",
                    f"{results['date']}; {results['machine']}, shared (load average "
                    f"{results['load_average_1m']:.1f} when done). Corpus: the interpreter's "
                    "stdlib, byte tokenizer, 17 shards (prepared in "
                    f"{results['prepare_s']:.1f} s).", "", lines(results)])
