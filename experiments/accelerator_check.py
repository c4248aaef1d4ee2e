"""Accelerator check: the papers' comparisons and our equalities on a GPU or TPU, in one command.

    # here (needs the data dependencies): the byte corpus, 16M tokens of Python as one .npy
    python experiments/accelerator_check.py --make_corpus=.accel/corpus.npy
    # on the accelerator host (jax, flax, optax, orbax-checkpoint and ml_collections suffice)
    python experiments/accelerator_check.py --corpus=.accel/corpus.npy \\
        --output=experiments/results/h200
    # on any CPU in about a minute (CI runs this): every part at toy sizes
    python experiments/accelerator_check.py --tiny --output=/tmp/accelerator_check

Parts, each written to `<output>/results.json`, `report.md` and PNGs:
  a. equalities: explicit == fused shaped attention (causal, padded bidirectional, packed) and a
     SAS-P model's logits, in float32 (at "highest" matmul precision) and bfloat16; on a GPU,
     cuDNN's attention against XLA's, and whether the fused path compiled to cuDNN.
  b. throughput at the paper's shape (18 layers, D=768, H=12, T=128, V=50,257, bfloat16, the
     largest batch up to 128 that fits) of Pre-LN, SAS, SAS-P and SAS-P without norms, with
     tokens/s, MFU against the measured and the nominal peak, memory, and each ratio to Pre-LN
     (paper, Table 1: 1.09, 1.16, 1.20), all on the default attention path
     (model.attention_impl="auto"); plus, paired with them, Pre-LN and SAS-P on the explicit
     path (the T x T form, the default before "auto"), Pre-LN scoring the full float32 logits
     (model.loss_vocab_chunk_size=0, the loss before chunking), Pre-LN with its head
     padded to a multiple of 128, and Pre-LN without the relu_matmul rule
     (model.grad_rules="auto,-relu_matmul": the Triton GEMM that takes the ReLU's derivative
     against cuBLAS's GEMM and XLA's kernel for it).
  c. long context: explicit vs fused SAS-P (2 layers, D=768, batch 1) at T=4,096 and 16,384:
     XLA's step memory and step time, or "out of memory".
  d. training: Pre-LN, SAS and SAS-P at 18 layers x 768 for 2,000 steps of 128 x 128 byte
     tokens, the same windows in the same order: loss vs step and vs training time.
  e. breakdown (with b, on its compiled steps): where Pre-LN's and SAS-P's step time goes
     (embedding, attention core, block matmuls, norms, head + loss, optimizer), with the
     FLOPs and bytes of each part (experiments/step_breakdown.py).
  g. compile to first step of SAS-P at b's shape: 18 layers unrolled, and 18 and 72 layers
     with model.scan_layers (experiments/compile_depth.py); the scanned 72/18 ratio should be
     <= 2.
  f. XLA flags: Pre-LN at b's shape in one benchmark process per flag set (XLA reads its flags
     at start-up), the first without extra flags: tokens/s ratios to it, and the matmul peak's
     ratio as the check on machine drift. Run last, so a time limit costs only this part.
Parts run in the order a, b + e, c, g, d, f; each is saved as it finishes.
Expected on one H200, from the parts' times in the last run there (a-c 190 s, d 324 s): about
8-9 minutes in all; every equality within tolerance.
"""
import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import configs  # pylint: disable=g-import-not-at-top
from experiments import accelerator_parts  # pylint: disable=g-import-not-at-top
from experiments import accelerator_report  # pylint: disable=g-import-not-at-top
from experiments import benchmark  # pylint: disable=g-import-not-at-top
from experiments import compile_depth  # pylint: disable=g-import-not-at-top
from experiments import report_lib  # pylint: disable=g-import-not-at-top

PAPER_SHAPE = {"model.n_layer": 18, "model.n_embd": 768, "model.n_head": 12,
               "model.context_length": 128, "dtype": "bfloat16"}
BYTE_VOCAB = 259
FULL = {
    "attention_shape": {"batch": 4, "seq_len": 1024, "heads": 12, "head_dim": 64},
    "model_check": {"model.n_layer": 2, "model.n_embd": 768, "model.n_head": 12,
                    "model.context_length": 512, "model.vocab_size": 50257},
    "bench": dict(PAPER_SHAPE, **{"model.vocab_size": 50257}),
    "bench_batches": (128, 64, 32, 16, 8), "rounds": 3, "steps": 5, "matmul_size": 8192,
    "long": {"model.n_layer": 2, "model.n_embd": 768, "model.n_head": 12, "batch_size": 1,
             "model.vocab_size": BYTE_VOCAB, "dtype": "bfloat16"},
    "lengths": (4096, 16384), "long_steps": 5,
    "train": dict(PAPER_SHAPE, **{"model.vocab_size": BYTE_VOCAB, "batch_size": 128,
                                  "num_train_steps": 2000}),
    "log_every": 50, "eval_every": 500, "eval_batches": 8, "corpus_tokens": 16 << 20,
    "breakdown_steps": 3,
    # Command buffers (CUDA graphs) batch many small kernels into one launch: off, then on
    # for loops and conditionals too (our loss and layer scans) with no minimum graph size.
    "xla_flag_sets": ("", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,"
                      "CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"),
    "flag_rounds": 3, "flag_steps": 5, "flag_timeout_s": 180,
    "depth": dict(PAPER_SHAPE, **{"model.vocab_size": 50257}), "depths": (18, 72),
}
_TINY_MODEL = {"model.n_layer": 1, "model.n_embd": 32, "model.n_head": 2,
               "model.context_length": 32, "model.vocab_size": BYTE_VOCAB}
# b, d, f and g at one batch size and step count (the schedule is part of the step): their
# one-layer Pre-LN and SAS-P steps are then the same programs, which a persistent compilation
# cache (JAX_COMPILATION_CACHE_DIR, as tests/test_accelerator_check.py sets) compiles once.
_TINY_RUN = dict(_TINY_MODEL, batch_size=4, num_train_steps=20)
TINY = {   # float32: XLA:CPU compiles it faster than bfloat16, and CPU time is what CI has
    "attention_shape": {"batch": 2, "seq_len": 64, "heads": 4, "head_dim": 16},
    "model_check": _TINY_MODEL,
    "bench": _TINY_RUN, "bench_batches": (4,), "rounds": 2, "steps": 1, "matmul_size": 256,
    "long": dict(_TINY_MODEL, batch_size=1), "lengths": (64,), "long_steps": 2,
    "train": _TINY_RUN,
    "log_every": 5, "eval_every": 10, "eval_batches": 2, "corpus_tokens": 1 << 18,
    "breakdown_steps": 2, "xla_flag_sets": ("", "--xla_cpu_enable_fast_math=false"),
    "flag_rounds": 1, "flag_steps": 1, "flag_timeout_s": 300,
    "depth": _TINY_RUN, "depths": (2, 4),
}
BENCH_VARIANTS = ("preln", "sas", "sas_p", "sas_p_nonorm")
TRAIN_VARIANTS = ("preln", "sas", "sas_p")
BREAKDOWN_VARIANTS = ("preln", "sas_p")


def make_corpus(path: str, num_tokens: int) -> np.ndarray:
  """Byte tokens of the Python standard library (the default corpus), documents joined by the
  end-of-document id, as uint16: training documents first, then validation documents filling
  the last 1/32 (`split_corpus`). Written to `path` when given."""
  # pylint: disable-next=import-outside-toplevel
  from simplified_flax.data import local_files, tokenizers
  tokenizer = tokenizers.ByteTokenizer()
  splits = local_files.assign_splits(local_files.python_documents([local_files.stdlib_root()]))
  parts_by_split = []
  for split, budget in (("train", num_tokens - num_tokens // 32), ("validation", num_tokens // 32)):
    pieces, total = [], 0
    for text in local_files.read_documents(splits[split], json_key="text"):
      ids = np.append(tokenizer.encode_array(text), tokenizer.eod_id).astype(np.uint16)
      pieces.append(ids[:budget - total])
      total += len(pieces[-1])
      if total >= budget:
        break
    parts_by_split.append(np.concatenate(pieces))
  tokens_N = np.concatenate(parts_by_split)
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.save(path, tokens_N)
  return tokens_N


def split_corpus(tokens_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  cut = len(tokens_N) - len(tokens_N) // 32
  return tokens_N[:cut], tokens_N[cut:]


def throughput_configs(overrides: dict) -> dict:
  """Part b's configs by name: the variants on the default path, then paired alternatives."""
  named = {v: configs.load(v, overrides) for v in BENCH_VARIANTS}
  alternatives = {"preln/explicit": ("preln", {"model.attention_impl": "explicit"}),
                  "sas_p/explicit": ("sas_p", {"model.attention_impl": "explicit"}),
                  "preln/full_logits_loss": ("preln", {"model.loss_vocab_chunk_size": 0}),
                  "preln/vocab_pad_128": ("preln", {"model.vocab_pad_multiple": 128}),
                  # The MLP's ReLU derivative in XLA's own kernel, not in a Triton GEMM (GPU).
                  "preln/no_relu_matmul": ("preln", {"model.grad_rules": "auto,-relu_matmul"})}
  for name, (variant, change) in alternatives.items():
    named[name] = configs.load(variant, dict(overrides, **change))
  return named


def depth_rows(overrides: dict, depths) -> list:
  """Part g: SAS-P's seconds to the first step, unrolled at the shallowest depth (the
  reference; the deep unrolled compile is what the scan avoids, and the device budget has no
  room for it) and scanned at every depth."""
  return [{"variant": "sas_p", "scan_layers": scan, "seconds": compile_depth.compile_seconds(
      "sas_p", dict(overrides, **{"model.scan_layers": scan}), scan_depths)}
          for scan, scan_depths in ((False, depths[:1]), (True, depths))]


def run_check(settings: dict, corpus_N: np.ndarray, parts_wanted: str, save) -> dict:
  """Runs the wanted parts ("abcdefg" or a subset; e runs with b; f last); `save(results)`
  after each, so a run stopped by a time limit keeps what it finished."""
  results = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
             "device_count": jax.device_count(), "jax": jax.__version__,
             "date": datetime.date.today().isoformat(), "wall_s": 0.0}
  started = time.perf_counter()

  def done(key, value):
    results[key] = value
    results["wall_s"] = time.perf_counter() - started
    save(results)

  if "a" in parts_wanted:
    done("equalities", accelerator_parts.attention_equalities(settings["attention_shape"])
         + accelerator_parts.model_equalities("sas_p", settings["model_check"]))
  if "b" in parts_wanted or "e" in parts_wanted:
    named = throughput_configs(settings["bench"])
    if "b" not in parts_wanted:
      named = {v: named[v] for v in BREAKDOWN_VARIANTS}
    # The paired alternatives compile after the variants: where an alternative's step is a
    # variant's program (on a CPU "auto" is explicit, and relu_matmul, a GPU rule, is off) a
    # persistent compilation cache hands it over instead of compiling it again.
    alternatives = {n: c for n, c in named.items() if n not in BENCH_VARIANTS}
    runners = accelerator_parts.make_runners(
        [{n: c for n, c in named.items() if n not in alternatives}, alternatives],
        settings["bench_batches"])
    if "b" in parts_wanted:
      done("throughput", benchmark.measure(list(runners.values()), settings["rounds"],
                                           settings["steps"], settings["matmul_size"]))
      print(benchmark.table(results["throughput"]), flush=True)
    if "e" in parts_wanted:
      done("breakdown", accelerator_parts.breakdowns(runners, BREAKDOWN_VARIANTS,
                                                     settings["breakdown_steps"]))
    del runners
  if "c" in parts_wanted:
    done("long_context", accelerator_parts.long_context(
        "sas_p", settings["long"], settings["lengths"], settings["long_steps"]))
  if "g" in parts_wanted:
    done("compile_depth", depth_rows(settings["depth"], settings["depths"]))
  if "d" in parts_wanted:
    train_N, eval_N = split_corpus(corpus_N)
    done("training", accelerator_parts.train_comparison(
        {v: configs.load(v, settings["train"]) for v in TRAIN_VARIANTS}, train_N, eval_N,
        log_every=settings["log_every"], eval_every=settings["eval_every"],
        eval_batches=settings["eval_batches"]))
  if "f" in parts_wanted:
    batch_size = results.get("throughput", {}).get("preln", {}).get(
        "batch_size", settings["bench_batches"][0])
    done("xla_flags", accelerator_parts.xla_flag_runs(
        "preln", dict(settings["bench"], batch_size=batch_size), settings["xla_flag_sets"],
        rounds=settings["flag_rounds"], steps=settings["flag_steps"],
        matmul_size=settings["matmul_size"], timeout_s=settings["flag_timeout_s"]))
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tiny", action="store_true", help="every part at toy sizes (CPU, CI)")
  parser.add_argument("--corpus", help="the byte corpus .npy (--make_corpus); default: made "
                      "now from the standard library (needs the data dependencies)")
  parser.add_argument("--parts", default="abcdefg", help="which parts to run (see above)")
  parser.add_argument("--make_corpus", metavar="PATH", help="only write the corpus .npy")
  parser.add_argument("--output", default=None, help="report folder (default "
                      "experiments/results/<device>)")
  args = parser.parse_args(argv)
  settings = TINY if args.tiny else FULL
  if args.make_corpus:
    tokens_N = make_corpus(args.make_corpus, settings["corpus_tokens"])
    print(f"Wrote {len(tokens_N):,} tokens ({tokens_N.nbytes / 2**20:.1f} MiB) to "
          f"{args.make_corpus}")
    return 0
  if args.corpus and not os.path.exists(args.corpus):
    parser.error(f"--corpus={args.corpus} does not exist; write it first with "
                 f"--make_corpus={args.corpus}")
  corpus_N = (np.load(args.corpus) if args.corpus
              else make_corpus("", settings["corpus_tokens"]))
  device = jax.devices()[0].device_kind.lower().replace("nvidia ", "").replace(" ", "_")
  output = args.output or os.path.join(report_lib.REPO_ROOT, "experiments", "results", device)
  os.makedirs(output, exist_ok=True)
  command = "python experiments/accelerator_check.py " + " ".join(argv or sys.argv[1:])

  def save(results):
    results["command"] = command
    report_lib.write_report(output, accelerator_report.report(results, output, command),
                            results)

  results = run_check(settings, corpus_N, args.parts, save)
  failed = [r["check"] + " " + r["dtype"] for r in results.get("equalities", [])
            if r["ok"] is False]
  print(f"Wrote {output}/report.md, results.json and plots; "
        + (f"FAILED equalities: {failed}" if failed else "every equality holds."))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
