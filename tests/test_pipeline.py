"""build_pipeline on a tiny local corpus: batches, determinism, exact resume, process shards."""
import json
import pathlib

import numpy as np
import pytest

from configs import base
from simplified_flax.data import build_pipeline
from simplified_flax.data import local_files
from simplified_flax.data import preparation
from simplified_flax.data import sequences
from simplified_flax.data.batches import BatchMaker
from simplified_flax.data.tokenizers import ByteTokenizer
from simplified_flax.data.errors import DataError

T, BATCH = 16, 4


@pytest.fixture(scope="module")
def corpus_dirs(tmp_path_factory):
  """A tiny Python root (varied text, so rows rarely repeat) and a tfds data dir."""
  root = tmp_path_factory.mktemp("root")
  rng = np.random.default_rng(0)
  for i in range(24):
    names = ["".join(chr(97 + c) for c in rng.integers(0, 26, 6)) for _ in range(8)]
    (root / f"mod{i}.py").write_text(
        "\n".join(f"def {n}(x):\n    return x * {rng.integers(1000)}" for n in names) + "\n")
  return str(root), str(tmp_path_factory.mktemp("tfds"))


def _config(corpus_dirs, *switches, **data):
  root, data_dir = corpus_dirs
  config = base.get_config(",".join(["cpu", *switches]))
  config.model.context_length = T
  config.batch_size = BATCH
  config.data.roots = root
  config.data.tfds_data_dir = data_dir
  config.data.update(data)
  return config


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_decoder_batches_and_vocab_size(corpus_dirs):
  config = _config(corpus_dirs)
  assert config.model.vocab_size is None
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  assert config.model.vocab_size == pipeline.tokenizer.vocab_size == 259
  stream = _take(pipeline.train_iterator(), 10)
  batch = stream[0]
  assert list(batch) == ["inputs"]
  assert batch["inputs"].shape == (BATCH, T) and batch["inputs"].dtype == np.int32
  sources = [f.read_text() for f in sorted(pathlib.Path(corpus_dirs[0]).glob("*.py"))]
  for row in stream[0]["inputs"]:  # every window is a piece of one source file
    assert any(pipeline.tokenizer.decode(row) in text for text in sources)


def test_same_seed_same_batches_across_epochs(corpus_dirs):
  config = _config(corpus_dirs)
  a = _take(build_pipeline(config, process_index=0, process_count=1).train_iterator(), 40)
  b = _take(build_pipeline(config, process_index=0, process_count=1).train_iterator(), 40)
  _assert_same(a, b)
  config.seed = 1
  c = _take(build_pipeline(config, process_index=0, process_count=1).train_iterator(), 40)
  assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(a, c))


def test_epochs_are_reshuffled(corpus_dirs):
  pipeline = build_pipeline(_config(corpus_dirs), process_index=0, process_count=1)
  per_epoch = pipeline.description["rows_per_epoch"] // BATCH
  stream = _take(pipeline.train_iterator(), 2 * per_epoch)
  first = np.concatenate([b["inputs"] for b in stream[:per_epoch]])
  second = np.concatenate([b["inputs"] for b in stream[per_epoch:]])
  assert (first != second).any()
  assert sorted(map(bytes, first)) == sorted(map(bytes, second))  # the same rows, reordered


def test_restored_state_continues_with_the_next_batch(corpus_dirs):
  config = _config(corpus_dirs)
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  per_epoch = pipeline.description["rows_per_epoch"] // BATCH
  iterator = pipeline.train_iterator()
  _take(iterator, per_epoch - 2)
  state = json.loads(json.dumps(iterator.get_state()))  # what a checkpoint would hold
  expected = _take(iterator, 5)  # crosses into the next epoch
  restored = build_pipeline(config, process_index=0, process_count=1).train_iterator()
  _take(restored, 3)
  restored.set_state(state)
  _assert_same(_take(restored, 5), expected)
  assert restored.get_state()["batches_drawn"] == per_epoch + 3


def test_state_is_the_same_on_every_process(corpus_dirs):
  config = _config(corpus_dirs)
  states = []
  for index in range(2):
    iterator = build_pipeline(config, process_index=index, process_count=2).train_iterator()
    _take(iterator, 3)
    states.append(iterator.get_state())
  assert states[0] == states[1]


def test_state_of_another_data_config_is_rejected(corpus_dirs):
  iterator = build_pipeline(_config(corpus_dirs), process_index=0,
                            process_count=1).train_iterator()
  next(iterator)
  state = iterator.get_state()
  config = _config(corpus_dirs)
  config.seed = 7
  other = build_pipeline(config, process_index=0, process_count=1).train_iterator()
  with pytest.raises(DataError, match=r"seed: 0 -> 7.*same data settings"):
    other.set_state(state)
  with pytest.raises(DataError, match=r"Not a data-iterator state"):
    other.set_state({"step": 3})


def test_two_process_shards_split_each_global_batch(corpus_dirs):
  config = _config(corpus_dirs)
  whole = _take(build_pipeline(config, process_index=0, process_count=1).train_iterator(), 12)
  shards = [_take(build_pipeline(config, process_index=p, process_count=2).train_iterator(), 12)
            for p in range(2)]
  for k, batch in enumerate(whole):
    assert shards[0][k]["inputs"].shape == (BATCH // 2, T)
    np.testing.assert_array_equal(
        np.concatenate([shards[0][k]["inputs"], shards[1][k]["inputs"]]), batch["inputs"])


def test_process_shards_are_disjoint_and_cover_an_epoch(tmp_path):
  # Unique token ids make every window identifiable; two shards of 4 documents each.
  lengths = np.arange(1, 9) * 4
  flat = np.concatenate([np.arange(1000 * d + 10, 1000 * d + 10 + n)
                         for d, n in enumerate(lengths)])
  split = sequences.join_documents(flat, lengths, 1, 80_000)
  address = preparation.Address("hand-made", "train", "byte-v1", 4)
  directory = address.directory(str(tmp_path))
  for index in range(2):
    part = sequences.join_documents(flat[lengths[:4 * index].sum():lengths[:4 * index + 4].sum()],
                                    lengths[4 * index:4 * index + 4], 1, 80_000)
    preparation.write_shard(directory, index, part)
  preparation.write_manifest(directory, address, 2)
  source = sequences.ShardedRows(preparation.PreparedSplit.open(str(tmp_path), address), seq_len=4,
                                 packing=False, pad_id=0)
  assert source.num_rows == 36
  seen = []
  for p in range(2):
    maker = BatchMaker(source, kind="decoder", mlm_rate=0.15, tokenizer=ByteTokenizer(),
                       global_batch=6, process_index=p, process_count=2, seed=3)
    rows = np.concatenate([maker.train_batch(k)["inputs"] for k in range(maker.batches_per_epoch)])
    seen.append({tuple(r) for r in rows})
    assert len(seen[-1]) == len(rows) == 18
  assert not seen[0] & seen[1]
  all_windows = sequences.gather_windows(split.tokens_N, sequences.window_starts(split, 4), 4)
  assert seen[0] | seen[1] == {tuple(r) for r in all_windows}


def test_second_build_reads_the_prepared_shards(corpus_dirs, monkeypatch):
  build_pipeline(_config(corpus_dirs), process_index=0, process_count=1)

  def must_not_run(*args, **kwargs):
    raise AssertionError("rebuilt")

  monkeypatch.setattr(preparation, "_tokenize_shard", must_not_run)
  monkeypatch.setattr(local_files, "read_documents", must_not_run)
  pipeline = build_pipeline(_config(corpus_dirs), process_index=0, process_count=1)
  next(pipeline.train_iterator())


def test_eval_batches_are_fixed(corpus_dirs):
  config = _config(corpus_dirs)
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  first = list(pipeline.eval_batches(6))  # more than the tiny eval split holds: wraps around
  assert len(first) == 6
  _assert_same(first, list(pipeline.eval_batches(6)))
  config.seed = 5
  _assert_same(first, list(build_pipeline(config, process_index=0,
                                          process_count=1).eval_batches(6)))


def test_prefetch_does_not_change_the_stream(corpus_dirs):
  eager = build_pipeline(_config(corpus_dirs, prefetch=0), process_index=0, process_count=1)
  ahead = build_pipeline(_config(corpus_dirs, prefetch=4), process_index=0, process_count=1)
  _assert_same(_take(eager.train_iterator(), 10), _take(ahead.train_iterator(), 10))


def test_packed_rows_carry_segment_ids(corpus_dirs):
  pipeline = build_pipeline(_config(corpus_dirs, packing=True), process_index=0,
                            process_count=1)
  tok = pipeline.tokenizer
  for batch in _take(pipeline.train_iterator(), 20):
    inputs, segments = batch["inputs"], batch["segment_ids"]
    assert segments.dtype == np.int32
    assert (segments[:, 0] <= 1).all()  # each row restarts at document 1 (0: all padding)
    steps = np.diff(segments, axis=1)
    new_doc = steps == 1
    assert ((steps == 0) | new_doc | (segments[:, 1:] == 0)).all()
    assert (inputs[:, :-1][new_doc] == tok.eod_id).all()  # a document ends with eod
    assert (inputs[segments == 0] == tok.pad_id).all()


def test_encoder_batches_mask_at_the_configured_rate(corpus_dirs):
  config = _config(corpus_dirs, "encoder")
  assert config.data.mlm_rate == 0.25
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  stream = _take(pipeline.train_iterator(), 60)
  batch = stream[0]
  assert set(batch) == {"inputs", "targets", "weights", "key_mask"}
  assert batch["key_mask"].dtype == bool and batch["key_mask"].all()
  assert batch["weights"].dtype == np.float32 and batch["targets"].dtype == np.int32
  weights = np.stack([b["weights"] for b in stream])
  assert abs(weights.mean() - 0.25) < 4 * np.sqrt(0.25 * 0.75 / weights.size)
  masked = np.stack([b["inputs"] for b in stream]) == pipeline.tokenizer.mask_id
  assert (weights[masked] == 1).all()


def test_packed_encoder_never_scores_padding(corpus_dirs):
  config = _config(corpus_dirs, "encoder", packing=True)
  config.batch_size = 64  # big enough to draw the padded last row
  pipeline = build_pipeline(config, process_index=0, process_count=1)
  for batch in _take(pipeline.train_iterator(), 4):
    np.testing.assert_array_equal(batch["key_mask"], batch["segment_ids"] > 0)
    assert (batch["weights"][~batch["key_mask"]] == 0).all()
  # Several epochs, so the padded last row is drawn even if one epoch's leftover skips it.
  padded = [b for b in _take(pipeline.train_iterator(), 24) if not b["key_mask"].all()]
  assert padded


def test_batch_larger_than_the_split_is_an_error(corpus_dirs):
  config = _config(corpus_dirs)
  config.batch_size = 1 << 20
  with pytest.raises(DataError, match=r"split 'train' of 'python_code/roots-.*' gives \d+ rows "
                     r"of 16 tokens, fewer than the 1048576 a batch needs"):
    build_pipeline(config, process_index=0, process_count=1)


def test_batch_that_does_not_divide_over_processes_is_an_error(corpus_dirs):
  with pytest.raises(DataError, match=r"batch_size 4 \(global\) does not divide over 3"):
    build_pipeline(_config(corpus_dirs), process_index=0, process_count=3)


def test_fixed_vocab_size_too_small_is_an_error(corpus_dirs):
  config = _config(corpus_dirs)
  config.model.vocab_size = 100
  with pytest.raises(DataError, match=r"model.vocab_size is 100 but the tokenizer has 259"):
    build_pipeline(config, process_index=0, process_count=1)
