"""Data for training: corpora (local files, Hugging Face datasets or tfds), tokenizers (byte,
SentencePiece, Hugging Face), prepared token shards, windows or packed rows, MLM, the
checkpointable iterator (docs/data.md).

    pipeline = build_pipeline(config, workdir=workdir)   # sets config.model.vocab_size if None
    it = pipeline.train_iterator()
    batch = next(it)            # numpy, b = config.batch_size // process_count rows
    state = it.get_state()      # JSON; the same on every process; it.set_state(state) resumes
    for batch in pipeline.eval_batches(config.eval_steps): ...   # the same every call and seed

decoder batch: {"inputs": int32[b, T]}; encoder batch: {"inputs": int32[b, T] masked,
"targets": int32[b, T], "weights": float32[b, T] (1.0 where scored), "key_mask": bool[b, T]
(True = real token)}; with data.packing both add "segment_ids": int32[b, T] (documents
1, 2, ... within a row, 0 on padding). Importing this package loads no TensorFlow, `datasets`
or `tokenizers`.
"""
from simplified_flax.data.errors import DataError
from simplified_flax.data.iterator import CheckpointableIterator
from simplified_flax.data.pipeline import Pipeline, build_pipeline
from simplified_flax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer

__all__ = ["build_pipeline", "Pipeline", "CheckpointableIterator", "DataError", "Tokenizer",
           "ByteTokenizer", "SentencePieceTokenizer"]
