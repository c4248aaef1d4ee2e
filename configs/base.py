"""Base config: the Pre-LN decoder at the paper's shape, with every knob of docs/model.md.

Variant files (`configs/<variant>.py`) start from `get_config` here and change only what
their block changes; they never copy numbers that are linked (see `get_ref` below).

Run (Pre-LN, CPU-sized):
    python -m simplified_flax.train --config=configs/preln.py:cpu --workdir=/tmp/preln

The optional argument after the file name is a comma-separated list of switches
(docs/configs.md, "Switches"):
    cpu         shrink model, batch and steps for a laptop CPU (L=6, D=256, 1,000 steps of
                16 x 128 tokens; sas_p:cpu took 7m42s on 2 idle cores of the development
                machine, corpus preparation included, 2026-12-07);
    encoder     switch to the bidirectional MLM encoder (used by the bert_* configs);
    codeparrot  the paper's data and recipe (CodeParrot, its tokenizer, one epoch; decoders).
"""
import ml_collections
from ml_collections import config_dict


def _placeholder(kind):
  return config_dict.placeholder(kind)


def _follow(parent: ml_collections.ConfigDict, name: str, kind):
  """A field that tracks `parent[name]` until it is set itself.

  Unlike `get_ref`, setting the follower leaves the followed field alone.
  """
  return config_dict.FieldReference(parent.get_ref(name), field_type=kind)


def model_config() -> ml_collections.ConfigDict:
  """Every block/model knob (docs/model.md, "Knobs") with the Pre-LN defaults."""
  m = ml_collections.ConfigDict()
  m.kind = "decoder"                 # "decoder" (causal LM) or "encoder" (bidirectional MLM)
  m.vocab_size = _placeholder(int)   # None: taken from the tokenizer of config.data
  m.n_layer = 18
  m.n_embd = 768
  m.n_head = 12
  m.context_length = 128             # T of the training windows
  m.max_position_embeddings = 1024   # size of the learned position table (GPT-2)
  m.position_embedding = "learned"   # "learned" (a table added to the embedding, GPT-2) or
                                     # "rope" (q and k rotated by position: model/rope.py)
  m.rope_theta = 10_000.0            # "rope": the frequencies' base
  m.embedding_scale = "none"         # "learned": a learnable scalar from sqrt(n_embd) times the
                                     # embedding (DyT's and Derf's language models)
  m.embedding_scale_init = _placeholder(float)   # "learned": its initial value (None: sqrt(D))
  m.tie_head = True                  # False: the head has a table of its own (`lm_head`)
  m.mlp_width_mult = 4
  m.activation = "leaky_relu"        # "leaky_relu" or "gelu"
  m.lrelu_neg_slope = 0.0            # 0 makes leaky ReLU a ReLU (the paper's default)
  m.attention_impl = "auto"          # "auto" (the backend's fastest exact path), "explicit"
                                     # (T x T centering matrix) or "fused" (O(T x D) terms)
  m.grad_rules = "auto"              # speed-only gradient rules: auto (where each helps), on,
                                     # off; "auto,-RULE" leaves RULE out (model/grad_rules.py)
  m.scan_layers = False              # one nn.scan over the layers that share their structure
  m.remat = False                    # recompute each block's activations in the backward pass
  m.scan_residuals = "matmuls"       # scanned, no remat: keep matmul/kernel outputs, or "all"

  # Norms (docs/model.md, "The block").
  m.norm_type = "rmsnorm"            # "ln", "rmsnorm", "dyt", "derf" or "none"
  m.norm_position = "pre"            # "pre", "post" or "peri" (Peri-LN: also each branch's
                                     # output and the embedding normed)
  m.norm_eps = 1e-5
  # DyT's and Derf's alpha_0, for the attention norms, the MLP norms and the final norm apart
  # (the other norm types have no alpha; Zhu et al. 2025 Sec. 4: 0.5 for non-LLM models).
  m.alpha_init_attn_norm = 0.5
  m.alpha_init_mlp_norm = 0.5
  m.alpha_init_final_norm = 0.5
  m.parallel_layers = False
  m.qk_norm_type = "none"            # "none" or "rmsnorm" (per-head, OP block)
  m.dot_norm_type = "none"           # "none" or "tanh" (30*tanh(logits/30) soft-cap)
  m.attn_output_gate = False         # gated attention (Qiu et al. 2025): the attention output
                                     # times sigmoid(x W_g) before Proj (docs/model.md)

  # Block gains (scalars).
  m.attn_block_resid_gain = 1.0
  m.attn_block_skip_gain = 1.0
  m.mlp_block_resid_gain = 1.0
  m.mlp_block_skip_gain = 1.0
  m.trainable_attn_block_gains = False
  m.trainable_mlp_block_gains = False

  # Shaped attention alpha*I + beta*A - gamma*C (paper Sec. 4.1): alpha = attn_mat_skip_gain,
  # beta = attn_mat_resid_gain, gamma = centre_attn_gain, all per head.
  m.centre_attn = False
  m.attn_mat_resid_gain = 1.0
  m.attn_mat_skip_gain = 0.0
  m.centre_attn_gain = _follow(m, "attn_mat_resid_gain", float)
  m.trainable_attn_mat_gains = False

  # Value / output projections (docs/model.md, "Value and Proj"). skip gain None -> plain linear.
  m.value_resid_gain = 1.0
  m.value_skip_gain = _placeholder(float)
  m.val_init_type = "normal"         # "normal", "orth" or "id"
  m.trainable_value_gains = False
  m.first_layer_value_resid_gain = _placeholder(float)
  m.proj_resid_gain = _follow(m, "value_resid_gain", float)
  m.proj_skip_gain = _follow(m, "value_skip_gain", float)
  m.proj_init_type = _follow(m, "val_init_type", str)
  m.trainable_proj_gains = _follow(m, "trainable_value_gains", bool)
  m.last_layer_proj_resid_gain = _placeholder(float)
  m.tie_valproj_init = "none"        # "none", "all_blocks" or "last_block"

  # Optional re-initialisations (None: keep the default init).
  m.query_init_std = _placeholder(float)
  m.key_init_std = _placeholder(float)
  m.val_proj_init_std = _placeholder(float)
  m.mlp_proj_init_std = _placeholder(float)

  # nGPT (Loshchilov et al., ICLR 2025; model/ngpt.py, docs/model.md "nGPT"): hidden states
  # and weight vectors on the unit sphere, no norm layers, Norm(h + alpha (Norm(F(h)) - h))
  # updates; the optimiser renormalises the weights after every step (training/optimizer.py).
  m.ngpt = False
  # CompleteP (Dey et al. 2025, depth-muP; docs/model.md "CompleteP"): every residual branch
  # times (L_base / L)^alpha, and the optimiser's learning rate times m_L^(alpha - 1) and
  # AdamW eps times m_L^-alpha inside the blocks, m_L = n_layer / depth_mup_base_layers.
  m.depth_mup_alpha = _placeholder(float)        # None: off; CompleteP: 1.0 (0.5: Yang et al.)
  m.depth_mup_base_layers = _placeholder(int)    # L_base, where the block is Pre-LN's exactly

  m.dropout_rate = 0.0               # embedding, attention and residual dropout

  # The tied head and its loss (docs/training.md, "The loss"): training and evaluation score
  # the final hidden states against the embedding this many vocabulary entries at a time,
  # never holding the [tokens, V] logits (0: the full float32 logits, as before); the head's
  # matmul width (and each chunk's) is rounded up to a multiple of vocab_pad_multiple (1: no
  # padding).
  m.loss_vocab_chunk_size = 8192
  m.vocab_pad_multiple = 1
  # The chunked loss's backward reads the logits its forward kept (in the compute dtype: the
  # [tokens, V] logits at 2 bytes each in bfloat16); False recomputes them chunk by chunk,
  # holding one chunk at a time, for one more head matmul. Same values and gradients (to
  # float32 round-off). Kept, the training step takes the whole vocabulary as one chunk.
  m.loss_keep_logits = True
  return m


def optimizer_config() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.name = "adamw"                   # "adamw" or "muon" (training/optimizer.py; docs/training.md)
  o.learning_rate = 1e-3
  o.schedule = "linear"              # "linear", "cosine", "rsqrt" or "constant"
  o.warmup_fraction = 0.05
  o.warmup_steps = _placeholder(int)  # overrides warmup_fraction when set
  o.weight_decay = 0.1
  o.b1 = 0.9
  o.b2 = 0.999
  o.eps = 1e-8
  o.grad_clip_norm = 1.0
  o.muon_beta = 0.95                 # muon: Nesterov momentum of the orthogonalised matrices
  o.muon_rms = 0.2                   # muon: RMS of each matrix update (AdamW-like; same lr)
  return o


def data_config() -> ml_collections.ConfigDict:
  """Corpus, tokenizer and batching (simplified_flax/data; docs/data.md)."""
  d = ml_collections.ConfigDict()
  d.name = "python_code"             # "python_code", "text_files", "hf:<hub name | folder |
                                     # files>" (Hugging Face datasets) or any tfds text dataset
  d.text_key = "content"             # tfds feature / hf column holding the text (tfds: its only
                                     # Text one if absent)
  d.train_split = "train"
  d.eval_split = "validation"
  d.eval_name = _placeholder(str)    # hf: eval documents from this second source (its
                                     # eval_split, which may be train_split: two folders saved
                                     # with only `train`: --config.data.name=hf:DIR/train
                                     # --config.data.eval_name=hf:DIR/valid
                                     # --config.data.eval_split=train)
  d.max_train_docs = 0               # hf: the first N after the shuffle (0: all)
  d.max_eval_docs = 0
  d.shuffle_seed = _placeholder(int)  # hf: datasets' shuffle(seed) before the selection
                                      # (None: the dataset's order)
  d.streaming = False                # hf: read a hub name / data files as an IterableDataset
                                     # (first N by .take; not with shuffle_seed: the exact
                                     # selection needs the dataset downloaded)
  d.roots = _placeholder(str)        # comma-separated roots for python_code (default: stdlib)
  d.paths = _placeholder(str)        # comma-separated files/globs for text_files
  d.json_key = "text"                # field of each JSON-lines record that holds the text
  d.tfds_data_dir = _placeholder(str)  # default: tfds's own (~/tensorflow_datasets)
  d.cache_dir = _placeholder(str)    # root of prepared token shards (local or gs://);
                                     # default: <tfds_data_dir>/token_shards
  d.shard_docs = 50_000              # documents per prepared shard (part of the shards' address)
  d.tokenizer = "byte"               # "byte", "sentencepiece", "bpe" or "hf:<tokenizer.json |
                                     # folder | hub name>" (Hugging Face tokenizers)
  d.spm_vocab_size = 8192
  d.spm_model_path = _placeholder(str)  # an existing SentencePiece model (else train one)
  d.spm_train_chars = 10_000_000     # SentencePiece trains on this many leading characters
  d.bpe_vocab_size = 8192            # "bpe": ids of the byte-level BPE (3 special + 256 bytes +
  d.bpe_train_chars = 10_000_000     # merges), trained on this many leading characters
  d.packing = False                  # False: windows of T per document (the paper's way)
  d.mlm_rate = 0.15
  d.prefetch = 2                     # batches made ahead by a background thread (0: none)
  return d


def with_switch(arg: str, switch: str) -> str:
  """`arg` with one more comma-separated switch (how the bert_* files select the encoder)."""
  return ",".join(s for s in (arg, switch) if s)


SWITCHES = ("cpu", "encoder", "codeparrot")   # what may follow the file name, comma-separated


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  switches = {s for s in arg.split(",") if s}
  unknown = switches - set(SWITCHES)
  if unknown:
    raise ValueError(f"Unknown config switch(es) {sorted(unknown)}; known: {', '.join(SWITCHES)}.")

  c = ml_collections.ConfigDict()
  c.seed = 0
  c.batch_size = 128                 # global, in sequences
  c.grad_accum_steps = 1
  c.num_train_steps = 40_000
  c.log_every_steps = 50
  c.eval_every_steps = 1_000
  c.eval_steps = 20
  c.checkpoint_every_steps = 1_000
  c.max_to_keep = 3                  # the latest N checkpoints, and ...
  c.keep_every_steps = 0             # ... every step divisible by K (0: none); docs/resuming.md
  c.restore_step = _placeholder(int)  # None: the latest good step; N: rewind to N; 0: start over
  c.dtype = "float32"                # compute dtype: "float32" or "bfloat16"
  c.diagnostics_every = 0            # 0: never compute the signal-propagation diagnostics
  c.compilation_cache_dir = _placeholder(str)  # JAX's compiled programs (docs/training.md,
                                     # "Compilation cache"); None:
                                     # $XDG_CACHE_HOME/simplified_flax/jax (else
                                     # ~/.cache/...); "off": no cache; the same-named flag wins
  c.storage_retry_budget_s = 120.0   # seconds one remote (gs://) read or write may spend
                                     # retrying HTTP 429/5xx, timeouts and resets before the
                                     # run stops with one line (docs/reliability.md)
  c.model = model_config()
  c.optimizer = optimizer_config()
  c.data = data_config()
  c.parallel = ml_collections.ConfigDict()
  c.parallel.mode = "jit"            # "jit" (Mesh + NamedSharding) or "pmap"
  c.parallel.fsdp = 1                # devices along the parameter-sharding axis
  c.parallel.shard_update = False    # jit: optimiser state split over every device, each
                                     # updating its slice: 1/N of its memory for an all-gather
                                     # of the weights a step (docs/distributed.md)

  if "encoder" in switches:
    if "codeparrot" in switches:
      raise ValueError("The codeparrot switch is for decoder configs: its tokenizer has no mask "
                       "token for the MLM encoder.")
    _make_encoder(c)
  if "codeparrot" in switches:
    _use_codeparrot(c, on_accelerator="cpu" not in switches)
  if "cpu" in switches:
    _shrink_for_cpu(c)
  return c


def _make_encoder(c: ml_collections.ConfigDict) -> None:
  """Crammed-BERT setting of the paper's Sec. 5 (docs/model.md, "Training settings")."""
  c.model.kind = "encoder"
  c.model.n_layer = 16
  c.data.mlm_rate = 0.25
  c.optimizer.b2 = 0.98
  c.optimizer.eps = 1e-12
  c.optimizer.grad_clip_norm = 0.5
  c.optimizer.learning_rate = 3e-3


def _use_codeparrot(c: ml_collections.ConfigDict, on_accelerator: bool) -> None:
  """The paper's data and recipe as the reference code's run_clm.py has them: CodeParrot,
  `shuffle(seed=0).select(range(num_token_mult * 100_000))` training documents and 2,000
  validation ones, the code-search-net GPT-2 tokenizer (50K ids), full 128-token windows per
  document, one epoch (steps derived once the data is prepared), AdamW 1e-3 / eps 1e-8 /
  wd 0.1, 5% warmup then linear decay, clipping at 1, batch 128, bf16 (not with `cpu`)."""
  d = c.data
  d.name = "hf:huggingface-course/codeparrot-ds-train"
  d.eval_name = "hf:huggingface-course/codeparrot-ds-valid"
  d.text_key, d.train_split, d.eval_split = "content", "train", "validation"
  d.tokenizer = "hf:huggingface-course/code-search-net-tokenizer"
  d.packing = False                  # the reference code's windows (data/sequences.py)
  d.num_token_mult = 1               # the reference code's config.yaml default
  d.max_train_docs = d.get_ref("num_token_mult") * 100_000
  d.max_eval_docs = 2_000
  d.shuffle_seed = 0
  c.model.context_length = 128
  c.batch_size = 128
  c.num_train_steps = _placeholder(int)   # None: one epoch, set after preparation
  o = c.optimizer
  o.name, o.learning_rate, o.eps, o.weight_decay = "adamw", 1e-3, 1e-8, 0.1
  o.schedule, o.warmup_fraction, o.grad_clip_norm = "linear", 0.05, 1.0
  if on_accelerator:
    c.dtype = "bfloat16"


def _shrink_for_cpu(c: ml_collections.ConfigDict) -> None:
  """A run for a laptop CPU on the embedded corpus (docs/training.md, "Measured": sas_p:cpu
  took 7m42s on 2 idle cores, corpus preparation included)."""
  c.model.n_layer = 6
  c.model.n_embd = 256
  c.model.n_head = 8
  c.model.context_length = 128
  c.batch_size = 16
  c.num_train_steps = 1_000
  c.log_every_steps = 25
  c.eval_every_steps = 250
  c.eval_steps = 8
  c.checkpoint_every_steps = 250
