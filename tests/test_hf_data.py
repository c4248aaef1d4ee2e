"""Hugging Face data, offline: `hf:` corpora (parquet files, save_to_disk folders) with the
reference code's selection, train and eval data from two folders that share a split name,
`hf:` and trained "bpe" tokenizers, the reference code's windows, one-line errors, and a
train-CLI run that resumes exactly."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
tokenizers_lib = pytest.importorskip("tokenizers")

import configs  # pylint: disable=wrong-import-position
from simplified_flax import prepare
from simplified_flax.data import build_pipeline, hf_hub, preparation, tokenizers
from simplified_flax.data.corpus import open_corpora, open_corpus
from simplified_flax.data.errors import DataError
from simplified_flax.data.hf_tokenizer import HfTokenizer, train_bpe
from simplified_flax.data.sequences import ShardedRows
from simplified_flax.runs.config_checks import ConfigError, validate_run_config
from simplified_flax.training.evaluation import input_pipeline
from test_loop import REPO, TINY, kill_and_resume, log_tail, start_training, subprocess_env
from test_resume import RUN, _assert_same_run

_WORDS = ["def", "class", "return", "import", "self", "for", "in", "if", "else", "print",
          "value", "data", "(", ")", ":", "x", "y", "=", "+", "0", "1", "\n", "    "]


def _documents(n: int = 80) -> list[str]:
  rng = np.random.default_rng(0)
  return [" ".join(rng.choice(_WORDS, size=int(rng.integers(20, 900)))) for _ in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A parquet file, a save_to_disk folder (train + validation) and a BPE tokenizer.json."""
  root = tmp_path_factory.mktemp("hf")
  docs = _documents()
  dataset = datasets.Dataset.from_dict({"content": docs, "number": list(range(len(docs)))})
  dataset.to_parquet(str(root / "train.parquet"))
  datasets.DatasetDict({"train": dataset, "validation": dataset.select(range(20))}).save_to_disk(
      str(root / "saved"))
  (root / "tokenizer.json").write_text(train_bpe(docs, vocab_size=300, max_chars=10**6))
  return root


def _data(files, **overrides):
  config = configs.load("preln:cpu", {"data.name": f"hf:{files / 'train.parquet'}",
                                      "data.eval_name": f"hf:{files / 'saved'}",
                                      "data.tokenizer": f"hf:{files / 'tokenizer.json'}",
                                      "data.cache_dir": str(files / "shards"), **overrides})
  return config


def test_importing_the_data_package_loads_neither_datasets_nor_tokenizers():
  code = ("import sys, simplified_flax.data, simplified_flax.train; "
          "print(sorted({'datasets', 'tokenizers'} & set(sys.modules)))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_hf_corpora_select_as_datasets_does(files):
  config = _data(files, **{"data.shuffle_seed": 0, "data.max_train_docs": 50,
                           "data.max_eval_docs": 5})
  corpus, evals = open_corpora(config.data)   # data.eval_name: a corpus per source
  expected = datasets.load_dataset("parquet", data_files=str(files / "train.parquet"),
                                   split="train").shuffle(seed=0).select(range(50))["content"]
  assert list(corpus.documents("train")) == expected
  assert list(corpus.documents("train", start=7)) == expected[7:]
  saved = datasets.load_from_disk(str(files / "saved"))["validation"]
  assert list(evals.documents("validation")) == saved.shuffle(seed=0).select(range(5))["content"]
  assert evals.identity.startswith("hf/saved-") and sorted(evals.splits) == ["validation"]
  assert open_corpus(config.data).identity == corpus.identity and sorted(corpus.splits) == [
      "train"]
  assert open_corpus(config.data).identity == corpus.identity       # stable
  config.data.max_train_docs = 49
  assert open_corpus(config.data).identity != corpus.identity       # other documents
  both, same = open_corpora(_data(files, **{"data.name": f"hf:{files / 'saved'}",
                                            "data.eval_name": None}).data)
  assert both is same   # one source: one corpus
  assert both.num_documents("train") == 80 and both.num_documents("validation") == 20


def test_streamed_hf_corpora_are_the_first_documents_of_the_downloaded_reading(files, tmp_path):
  plain = _data(files, **{"data.max_train_docs": 30, "data.max_eval_docs": 5})
  streamed = _data(files, **{"data.max_train_docs": 30, "data.max_eval_docs": 5,
                             "data.streaming": True})
  (ours, our_evals), (theirs, their_evals) = open_corpora(streamed.data), open_corpora(plain.data)
  assert type(ours.splits["train"]).__name__ == "IterableDataset"
  assert type(our_evals.splits["validation"]).__name__ == "Dataset"     # a save_to_disk folder
  expected = list(theirs.documents("train"))
  assert len(expected) == 30 and list(ours.documents("train")) == expected
  assert list(ours.documents("train", start=7)) == expected[7:]      # a resumed preparation
  assert list(our_evals.documents("validation")) == list(their_evals.documents("validation"))
  assert ours.num_documents("train") == 30
  assert open_corpus(streamed.data).identity == ours.identity        # stable
  streamed.data.max_train_docs = 29
  assert open_corpus(streamed.data).identity != ours.identity        # other documents
  tok = tokenizers.build_tokenizer(plain.data, None, list)           # the same shards' tokens
  shards = [preparation.prepare_split(c, "train", tok, str(tmp_path / name), shard_docs=7)
            for c, name in ((ours, "streamed"), (theirs, "plain"))]
  assert [s.num_docs for s in shards] == [30, 30]
  for index in range(shards[0].num_shards):
    np.testing.assert_array_equal(shards[0].shard(index).tokens_N, shards[1].shard(index).tokens_N)
  streamed.data.max_train_docs = 81
  with pytest.raises(DataError, match=r"data.max_train_docs is 81 but the (dataset has|"
                     r"streamed split 'train' ended after) 80 documents"):  # card, else the end
    list(open_corpus(streamed.data).documents("train"))
  (tmp_path / "three.jsonl").write_text("".join(json.dumps({"content": f"d{i}"}) + "\n"
                                                 for i in range(3)))
  jsonl = _data(files, **{"data.name": f"hf:{tmp_path / 'three.jsonl'}", "data.streaming": True,
                          "data.max_train_docs": 4})
  with pytest.raises(DataError, match=r"max_train_docs is 4 but the streamed split 'train' "
                     r"ended after 3 documents"):   # no card: found at the end of the stream
    list(open_corpus(jsonl.data).documents("train"))
  jsonl.data.text_key = "text"
  with pytest.raises(DataError, match=r"no column 'text'; its columns are \['content'\]"):
    list(open_corpus(jsonl.data).documents("train"))
  streamed.data.shuffle_seed = 0
  with pytest.raises(DataError, match=r"data.streaming=True with data.shuffle_seed=0: .* needs "
                     r"it downloaded \(data.streaming=False\)") as error:
    open_corpus(streamed.data)
  assert "\n" not in str(error.value)
  saved = _data(files, **{"data.name": f"hf:{files / 'saved'}", "data.eval_name": None,
                          "data.shuffle_seed": 0, "data.streaming": True})   # local: read as is
  assert open_corpus(saved.data).identity == open_corpus(
      _data(files, **{"data.name": f"hf:{files / 'saved'}", "data.eval_name": None,
                      "data.shuffle_seed": 0}).data).identity


def test_bad_hf_input_is_one_line_naming_what_to_set(files, monkeypatch):
  cases = [({"data.text_key": "text"}, r"no column 'text'; its columns are \['content', "
            r"'number'\]\. Set data\.text_key"),
           ({"data.text_key": "number"}, r"holds .*int64.*not text"),
           ({"data.name": f"hf:{files / 'saved'}", "data.eval_name": None,
             "data.eval_split": "test"}, r"has no split 'test' \(it has \['train', 'validation'"),
           ({"data.name": f"hf:{files / 'missing.parquet'}"}, r"names no existing file"),
           ({"data.max_train_docs": 81}, r"data.max_train_docs is 81 but the dataset has 80"),
           ({"data.name": "hf:nobody/no-such-dataset"}, r"'hf:nobody/no-such-dataset' cannot "
            r"be loaded .*save_to_disk\('DIR'\).*data\.name=hf:DIR")]
  monkeypatch.setattr(hf_hub, "reachable", lambda *a, **k: False)
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    monkeypatch.setenv(var, "1")
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  # Read at import, as datasets' is: without it the hub tokenizer below retries for ~23 s.
  monkeypatch.setattr(pytest.importorskip("huggingface_hub").constants, "HF_HUB_OFFLINE", True)
  for overrides, message in cases:
    with pytest.raises(DataError, match=message) as error:
      open_corpus(_data(files, **overrides).data)
    assert "\n" not in str(error.value)
  with pytest.raises(DataError, match=r"hub tokenizer 'hf:nobody/no-tokenizer' cannot be loaded"):
    tokenizers.build_tokenizer(_data(files, **{"data.tokenizer": "hf:nobody/no-tokenizer"}).data,
                               None, list)


def _two_folders(root, kind: str) -> tuple[list[str], list[str]]:
  """root/train and root/valid, each with only a `train` split (parquet files, or save_to_disk
  folders); their documents: lowercase words in train, uppercase ones in valid."""
  rng = np.random.default_rng(1)
  texts = {name: [" ".join(rng.choice(words, size=int(rng.integers(10, 60)))) for _ in range(n)]
           for name, words, n in (("train", ["alpha", "beta", "gamma"], 40),
                                  ("valid", ["EVAL", "ONLY", "TEXT"], 12))}
  for name, docs in texts.items():
    dataset = datasets.Dataset.from_dict({"content": docs})
    if kind == "parquet":
      (root / name).mkdir()
      dataset.to_parquet(str(root / name / "part-0.parquet"))
    else:
      datasets.DatasetDict({"train": dataset}).save_to_disk(str(root / name))
  return texts["train"], texts["valid"]


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_train_and_eval_from_two_folders_that_share_a_split_name(tmp_path, kind, monkeypatch):
  """data.name=hf:DIR/train, data.eval_name=hf:DIR/valid, data.eval_split=train: each source is
  a corpus of its own, its `train` split prepared into its own shards, which `prepare` writes
  and training (and a resumed run) reads."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  train_docs, valid_docs = _two_folders(tmp_path, kind)
  shards = tmp_path / "shards"
  def config():
    return configs.load("preln:cpu", {
        "data.name": f"hf:{tmp_path / 'train'}", "data.eval_name": f"hf:{tmp_path / 'valid'}",
        "data.eval_split": "train", "data.tokenizer": "byte", "data.cache_dir": str(shards),
        "model.context_length": 16, "batch_size": 8})
  validate_run_config(config())          # one split name, two sources: allowed
  directories = prepare.prepare(config(), workers=1, workdir=None)
  assert set(directories) == {"train", "eval_name:train"}
  assert sorted(os.path.basename(d) for d in directories.values()) == sorted(os.listdir(shards))
  names = sorted(os.listdir(shards))    # two directories, one per source, both of split `train`
  assert len(names) == 2 and names[0].startswith("hf_train-") and names[1].startswith(
      "hf_valid-") and all(".train." in name for name in names), names
  num_docs = {name: json.loads((shards / name / "manifest.json").read_text())["shard_num_docs"]
              for name in names}
  assert [sum(n) for n in num_docs.values()] == [40, 12]
  eval_shard = f"{directories['eval_name:train']}/tokens-00000.npy"   # --repair_shard finds it
  assert prepare.prepare(config(), workers=1, workdir=None, repair_shard=eval_shard) == {
      "eval_name:train": directories["eval_name:train"]}

  def must_not_run(*args, **kwargs):
    raise AssertionError("prepared again")
  monkeypatch.setattr(preparation, "_tokenize_shard", must_not_run)
  built = build_pipeline(config(), process_index=0, process_count=1)  # reads prepare's shards
  tok = built.tokenizer
  train_texts = [tok.decode(row) for row in next(built.train_iterator(prefetch=0))["inputs"]]
  eval_texts = [tok.decode(row) for b in built.eval_batches(3) for row in b["inputs"]]
  assert all(any(t in d for d in train_docs) and t == t.lower() for t in train_texts)
  assert all(any(t in d for d in valid_docs) and t == t.upper() for t in eval_texts)
  assert built.evals.source.num_rows == sum(len(d) // 16 for d in valid_docs)
  resumed = build_pipeline(config(), process_index=0, process_count=1)   # a resumed run
  assert resumed.description == built.description
  assert [tok.decode(row) for b in resumed.eval_batches(3) for row in b["inputs"]] == eval_texts


def test_one_source_and_one_split_for_train_and_eval_is_refused_in_one_line(files):
  message = (r"^data\.train_split == data\.eval_split == 'train' with one source: evaluation "
             r"would read the training documents\. Set data\.eval_split .* data\.eval_name "
             r".* --config\.data\.eval_split=train\.$")
  for overrides in ({"data.eval_name": None}, {"data.eval_name": f"hf:{files / 'train.parquet'}/"},
                    {"data.name": "python_code", "data.eval_name": None}):
    with pytest.raises(ConfigError, match=message):
      validate_run_config(_data(files, **{**overrides, "data.eval_split": "train"}))
  same_file = f"hf:{files}/../{files.name}/train.parquet"   # the same file, written otherwise
  with pytest.raises(DataError, match=r"^data\.eval_name names the source of data\.name .* "
                     r"evaluation would read the training documents\. Set data\.eval_name to "
                     r"another source or data\.eval_split to another split\.$"):
    open_corpus(_data(files, **{"data.eval_name": same_file, "data.eval_split": "train"}).data)


def test_hf_tokenizer_ids_fingerprint_and_bpe_reuse(files, tmp_path):
  tok = tokenizers.build_tokenizer(_data(files).data, None, list)
  assert (tok.pad_id, tok.eod_id, tok.mask_id, tok.first_regular_id) == (0, 1, 2, 3)
  assert tok.vocab_size == 300 and tok.decode(tok.encode("x = 1\n")) == "x = 1\n"
  # GPT-2 style: <|endoftext|> only; pad falls back to it, there is no mask.
  gpt2 = tokenizers_lib.Tokenizer(tokenizers_lib.models.BPE())
  gpt2.pre_tokenizer = tokenizers_lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
  gpt2.train_from_iterator(_documents(10), tokenizers_lib.trainers.BpeTrainer(
      vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=tokenizers_lib.pre_tokenizers.ByteLevel.alphabet()))
  (tmp_path / "gpt2").mkdir()
  gpt2.save(str(tmp_path / "gpt2" / "tokenizer.json"))
  other = tokenizers.build_tokenizer(_data(files, **{
      "data.tokenizer": f"hf:{tmp_path / 'gpt2'}"}).data, None, list)   # a folder
  assert (other.eod_id, other.pad_id, other.mask_id, other.first_regular_id) == (0, 0, None, 1)
  assert other.fingerprint != tok.fingerprint
  encoder = _data(files, **{"data.tokenizer": f"hf:{tmp_path / 'gpt2'}", "model.kind": "encoder"})
  with pytest.raises(DataError, match=r"has no mask token .* the MLM encoder needs"):
    build_pipeline(encoder, process_index=0, process_count=1)
  # "bpe": trained once on the corpus, saved in the workdir, reused on resume.
  calls = []
  config = _data(files, **{"data.tokenizer": "bpe", "data.bpe_vocab_size": 290}).data
  trained = tokenizers.build_tokenizer(config, str(tmp_path), lambda: calls.append(1) or
                                       iter(_documents()))
  again = tokenizers.build_tokenizer(config, str(tmp_path), lambda: calls.append(1) or iter([]))
  assert len(calls) == 1 and (tmp_path / "tokenizer.json").exists()
  assert trained.vocab_size == 290 and again.fingerprint == trained.fingerprint
  assert trained.fingerprint == HfTokenizer((tmp_path / "tokenizer.json").read_text()).fingerprint


def test_windows_are_the_reference_codes_per_document_windows(files):
  """data.packing=False cuts each document into full windows of T, as run_clm.py's tokenize:
  truncation to T with return_overflowing_tokens (stride 0), keeping the chunks of length T."""
  seq_len = 32
  config = _data(files, **{"data.shuffle_seed": 0, "data.max_train_docs": 60})
  corpus = open_corpus(config.data)
  tok = tokenizers.build_tokenizer(config.data, None, list)
  prepared = preparation.prepare_split(corpus, "train", tok, str(files / "windows"), shard_docs=7)
  rows = ShardedRows(prepared, seq_len=seq_len, packing=False, pad_id=tok.pad_id)
  ours_RxT, _ = rows.rows(np.arange(rows.num_rows))

  reference = tokenizers_lib.Tokenizer.from_file(str(files / "tokenizer.json"))
  reference.enable_truncation(max_length=seq_len, stride=0)
  texts = datasets.load_dataset("parquet", data_files=str(files / "train.parquet"),
                                split="train").shuffle(seed=0).select(range(60))["content"]
  chunks = [c.ids for e in reference.encode_batch(texts) for c in [e, *e.overflowing]]
  theirs_RxT = np.array([c for c in chunks if len(c) == seq_len], np.int32)
  assert len(chunks) > len(theirs_RxT) > 100       # some partial chunks were dropped
  np.testing.assert_array_equal(ours_RxT, theirs_RxT)


def test_codeparrot_switch_is_the_reference_recipe():
  c = configs.load("sas_p:codeparrot")
  assert (c.data.name, c.data.eval_name, c.data.text_key, c.data.tokenizer) == (
      "hf:huggingface-course/codeparrot-ds-train", "hf:huggingface-course/codeparrot-ds-valid",
      "content", "hf:huggingface-course/code-search-net-tokenizer")
  assert (c.data.max_train_docs, c.data.max_eval_docs, c.data.shuffle_seed) == (100_000, 2000, 0)
  assert (c.batch_size, c.dtype, c.num_train_steps, c.model.n_layer) == (128, "bfloat16", None, 18)
  o = c.optimizer
  assert (o.learning_rate, o.eps, o.weight_decay, o.warmup_fraction, o.schedule,
          o.grad_clip_norm) == (1e-3, 1e-8, 0.1, 0.05, "linear", 1.0)
  cpu = configs.load("preln:codeparrot,cpu", {"data.num_token_mult": 2})
  assert cpu.data.max_train_docs == 200_000 and cpu.dtype == "float32"
  with pytest.raises(ValueError, match="for decoder configs"):
    configs.load("bert_preln:codeparrot")


def test_one_epoch_is_derived_after_preparation_and_printed(files, tmp_path, capsys):
  config = _data(files, **{**TINY, "num_train_steps": None})
  pipeline = input_pipeline(config, str(tmp_path))
  steps = pipeline.train.batches_per_epoch
  assert config.num_train_steps == steps > 1
  rows = pipeline.train.source
  assert (f"Plan: one epoch of 80 documents = {rows.num_rows:,} windows of 16 tokens = "
          f"{steps:,} steps of 8 ({steps * 8 * 16:,} tokens).") in capsys.readouterr().out


def _cli(workdir, overrides, env, config="configs/preln.py:cpu"):
  return subprocess.run([sys.executable, "-m", "simplified_flax.train", f"--workdir={workdir}",
                         f"--config={config}",
                         *[f"--config.{k}={v}" for k, v in overrides.items()]],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_cli_on_hf_data_with_hf_tokenizer_runs_and_resumes_exactly(files, tmp_path):
  data = {"data.name": f"hf:{files / 'train.parquet'}", "data.eval_name": f"hf:{files / 'saved'}",
          "data.tokenizer": f"hf:{files / 'tokenizer.json'}", "data.shuffle_seed": 0,
          "data.max_eval_docs": 10, "data.cache_dir": str(tmp_path / "shards")}
  env = {**subprocess_env(cache_dir=str(tmp_path / "jax_cache")), "HF_HUB_OFFLINE": "1",
         "HF_HOME": str(tmp_path / "hf_home")}
  bad = _cli(tmp_path / "bad", {**TINY, **data, "data.text_key": "text"}, env)
  lines = bad.stderr.strip().splitlines()
  assert bad.returncode == 1 and "no column 'text'" in lines[-1], lines[-20:]
  assert not any("Traceback" in line for line in lines)
  offline = _cli(tmp_path / "cp", {}, env, config="configs/sas_p.py:codeparrot,cpu")
  lines = offline.stderr.strip().splitlines()
  assert offline.returncode == 1 and not any("Traceback" in line for line in lines), lines[-20:]
  assert ("'hf:huggingface-course/codeparrot-ds-train' cannot be loaded" in lines[-1]
          and "set data.name=hf:DIR" in lines[-1]), lines[-20:]
  # The recipe switch with `cpu` runs end to end on a local stand-in of its data.
  stand_in = {**TINY, **data, "eval_steps": 1, "data.max_train_docs": 40,
              "data.max_eval_docs": 10, "num_train_steps": 3}
  local = _cli(tmp_path / "cp_local", stand_in, env, config="configs/sas_p.py:codeparrot,cpu")
  assert local.returncode == 0, local.stderr[-2000:]
  assert "step 3/3" in local.stdout, local.stdout[-2000:]

  overrides = {**RUN, **data}
  straight = tmp_path / "straight"
  assert start_training(straight, overrides, env).wait(timeout=600) == 0, log_tail(straight)
  assert "prepare hf/train.parquet-" in log_tail(straight, 100_000)
  config = json.load(open(os.path.join(straight, "config.json")))
  assert config["model"]["vocab_size"] == 300
  killed = tmp_path / "killed"      # resumes mid-epoch: an epoch is more than 25 batches
  kill_and_resume(killed, overrides, env, after_rows=25, steps=RUN["num_train_steps"])
  _assert_same_run(killed, straight)
