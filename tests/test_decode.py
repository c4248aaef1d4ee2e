"""KV-cache decoding: cached logits equal the full forward pass; the loop compiles once."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DECODER_VARIANTS, tiny_config
from simplified_flax.model import attention
from simplified_flax.model import decode
from simplified_flax.model import transformer

V = 61
SEQ_LENGTHS = (16, 11, 7)      # one batch, three sequences of different lengths
PROMPT_LENGTHS = (5, 1, 3)     # right-padded to 5; row 1 decodes from its first token


def sequences():
  rng = np.random.default_rng(7)
  return [rng.integers(3, V, n).astype(np.int32) for n in SEQ_LENGTHS]


@functools.cache
def _variables(variant):
  """The variant's initial variables, perturbed; the same for both attention forms (their
  parameter trees are the same), so initialisation compiles once per variant, not per form."""
  model = transformer.build_model(tiny_config(variant, attention_impl="explicit").model)
  # Op by op: each op compiles once per shape in this process, shared by the variants (a
  # jitted init compiled each variant's whole init, about a second each). The forward passes
  # below are jitted: op by op, their many ops would be most of the file's time.
  variables = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  # Zero-initialised weights (SAS queries, reparameterised values) would hide position bugs.
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape, np.float32), variables)


def build(variant, impl="explicit"):
  return transformer.build_model(tiny_config(variant, attention_impl=impl).model), _variables(
      variant)


@jax.jit(static_argnums=0)
def full_logits(model, variables, tokens_BT):
  return model.apply(variables, tokens_BT)


apply_cached = jax.jit(decode.apply_cached, static_argnums=0)


def cached_logits(model, variables, prompt_lengths, cache):
  """Per row, the logits of `sequences()` from `cache` (empty): the prompts in one padded call
  (if any), then one teacher-forced token per row per step (token 0 past a row's end)."""
  seqs = sequences()
  num_steps = max(n - p for n, p in zip(SEQ_LENGTHS, prompt_lengths))
  cached = [[] for _ in seqs]
  if max(prompt_lengths):
    prompts_BT, lengths_B = decode.pad_prompts([s[:p] for s, p in zip(seqs, prompt_lengths)])
    prefill_BTV, cache = apply_cached(model, variables, cache, prompts_BT, lengths_B)
    cached = [list(prefill_BTV[b, :p]) for b, p in enumerate(prompt_lengths)]
  for t in range(num_steps):
    toks_B1 = np.array([[s[p + t] if p + t < len(s) else 0]
                        for s, p in zip(seqs, prompt_lengths)], np.int32)
    logits_B1V, cache = apply_cached(model, variables, cache, toks_B1)
    for b, (n, p) in enumerate(zip(SEQ_LENGTHS, prompt_lengths)):
      if p + t < n:
        cached[b].append(logits_B1V[b, 0])
  np.testing.assert_array_equal(cache["index"], [p + num_steps for p in prompt_lengths])
  return [np.stack(c) for c in cached]


@pytest.mark.parametrize("impl", ("explicit", "fused"))
@pytest.mark.parametrize("variant", DECODER_VARIANTS)
def test_cached_decoding_equals_the_full_forward_pass(variant, impl):
  model, variables = build(variant, impl)
  # The full pass of the three rows right-padded into one batch: in a causal model position t
  # reads tokens <= t only (tests/test_model.py checks it for every variant), so row b's first
  # n_b logits are the row's own; one compile instead of one per length.
  rows_BT = np.zeros((len(SEQ_LENGTHS), max(SEQ_LENGTHS)), np.int32)
  for b, s in enumerate(sequences()):
    rows_BT[b, :len(s)] = s
  full_BTV = full_logits(model, variables, rows_BT)
  full = [full_BTV[b, :n] for b, n in enumerate(SEQ_LENGTHS)]
  # One empty cache for both passes (arrays are immutable; apply_cached returns a new one).
  empty_cache = decode.init_cache(model, len(SEQ_LENGTHS), max(SEQ_LENGTHS))
  for prompt_lengths in (PROMPT_LENGTHS, (0, 0, 0)):   # prompts then steps; only steps
    for b, logits_TV in enumerate(cached_logits(model, variables, prompt_lengths, empty_cache)):
      np.testing.assert_allclose(logits_TV, full[b], atol=1e-5, rtol=1e-5,
                                 err_msg=f"row {b}, prompts of lengths {prompt_lengths}")


@pytest.mark.parametrize("impl", ("explicit", "fused"))
def test_per_row_query_offsets_equal_each_row_with_its_own_offset(impl):
  q, k, v = (jax.random.normal(jax.random.key(i), (2, n, 4, 8)) for i, n in enumerate((3, 9, 9)))
  gains = dict(resid_gain=jnp.full(4, 0.7), skip_gain=jnp.full(4, 1.1),
               centre_gain=jnp.full(4, 0.9))
  offsets = np.array([2, 6])

  @jax.jit   # one program (op by op, each op compiled apart, was slower)
  def both_and_alone(q, k, v):
    both = attention.shaped_attention(q, k, v, causal=True, query_offset=offsets, impl=impl,
                                      **gains)
    return both, [attention.shaped_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True,
                                             query_offset=int(offset), impl=impl, **gains)
                  for b, offset in enumerate(offsets)]

  both, alone = both_and_alone(q, k, v)
  for b in range(len(offsets)):
    np.testing.assert_allclose(both[b:b + 1], alone[b], atol=1e-6)


def _count_decode_traces():
  """An interceptor counting traced `Transformer.__call__(..., decode=True)` calls."""
  calls = []

  def intercept(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, transformer.Transformer):
      calls.append(kwargs.get("decode", False))
    return next_fun(*args, **kwargs)
  return calls, intercept


def test_generation_compiles_once_and_matches_step_by_step_greedy_decoding():
  model, variables = build("sas_p", "fused")
  seqs = sequences()
  prompts_BT, lengths_B = decode.pad_prompts([s[:p] for s, p in zip(seqs, PROMPT_LENGTHS)])
  calls, intercept = _count_decode_traces()
  with nn.intercept_methods(intercept):
    out = decode.generate(model, variables, prompts_BT, lengths_B, jax.random.key(0),
                          max_new_tokens=12, sampling=decode.Sampling(temperature=0))
    traced_once = len(calls)
    decode.generate(model, variables, prompts_BT[::-1], lengths_B[::-1], jax.random.key(1),
                    max_new_tokens=12, sampling=decode.Sampling(temperature=0))
  # init_cache's shape pass, the prefill and the loop body: the same for any max_new_tokens.
  assert traced_once == 3 and all(calls)
  assert len(calls) == traced_once, "a second call with the same shapes retraced"

  np.testing.assert_array_equal(out.num_tokens, [12] * 3)
  # Greedy by re-running the full forward pass on a growing, right-padded (causal) buffer.
  buffer_BT = np.zeros((3, max(PROMPT_LENGTHS) + 12), np.int32)
  buffer_BT[:, :prompts_BT.shape[1]] = prompts_BT
  for t in range(12):
    logits_BTV = full_logits(model, variables, buffer_BT)
    for b, p in enumerate(PROMPT_LENGTHS):
      buffer_BT[b, p + t] = int(jnp.argmax(logits_BTV[b, p + t - 1]))
  for b, p in enumerate(PROMPT_LENGTHS):
    np.testing.assert_array_equal(out.tokens[b], buffer_BT[b, p:p + 12])


def test_rows_stop_at_end_of_document_and_pad_after_it():
  model, variables = build("sas", "explicit")
  prompts_BT, lengths_B = decode.pad_prompts([s[:p] for s, p in zip(sequences(),
                                                                     PROMPT_LENGTHS)])
  greedy = decode.Sampling(temperature=0)
  free = decode.generate(model, variables, prompts_BT, lengths_B, jax.random.key(0),
                         max_new_tokens=6, sampling=greedy)
  eod = int(free.tokens[0, 2])   # row 0 emits it third (other rows may too, or never)
  out = decode.generate(model, variables, prompts_BT, lengths_B, jax.random.key(0),
                        max_new_tokens=6, sampling=greedy, eod_id=eod, pad_id=0)
  for b in range(3):
    row = list(np.asarray(free.tokens[b]))
    n = row.index(eod) + 1 if eod in row else 6
    assert int(out.num_tokens[b]) == n
    np.testing.assert_array_equal(out.tokens[b, :n], row[:n])
    assert not np.any(out.tokens[b, n:])
  assert int(out.num_tokens[0]) <= 3


def test_sampling_filters():
  logits_BV = jnp.log(jnp.array([[0.5, 0.2, 0.2, 0.1], [0.05, 0.05, 0.1, 0.8]]))
  kept = lambda x: np.isfinite(np.asarray(x))
  np.testing.assert_array_equal(kept(decode.top_k_filter(logits_BV, 1)),
                                [[1, 0, 0, 0], [0, 0, 0, 1]])
  np.testing.assert_array_equal(kept(decode.top_k_filter(logits_BV, 2)),
                                [[1, 1, 1, 0], [0, 0, 1, 1]])   # the tie at 0.2 is kept
  np.testing.assert_array_equal(kept(decode.top_p_filter(logits_BV, 0.6)),
                                [[1, 1, 1, 0], [0, 0, 0, 1]])
  np.testing.assert_array_equal(kept(decode.top_p_filter(logits_BV, 0.85)),
                                [[1, 1, 1, 0], [0, 0, 1, 1]])
  np.testing.assert_array_equal(kept(decode.top_p_filter(logits_BV, 1e-3)),
                                [[1, 0, 0, 0], [0, 0, 0, 1]])

  rng = jax.random.key(0)
  greedy = decode.sample(rng, logits_BV, decode.Sampling(temperature=0))
  np.testing.assert_array_equal(greedy, [0, 3])
  np.testing.assert_array_equal(decode.sample(rng, logits_BV, decode.Sampling(top_k=1)), greedy)
  draws = jax.jit(jax.vmap(lambda k: decode.sample(k, logits_BV, decode.Sampling(top_p=0.6))))(
      jax.random.split(rng, 2000))
  assert set(np.unique(draws[:, 0])) == {0, 1, 2} and set(np.unique(draws[:, 1])) == {3}
  share = np.mean(np.asarray(draws[:, 0]) == 0)
  assert abs(share - 0.5 / 0.9) < 0.05   # renormalised over the kept set
  with pytest.raises(ValueError):
    decode.Sampling(top_p=0)


def test_pad_prompts():
  prompts_BT, lengths_B = decode.pad_prompts([[5, 6, 7], [8]], pad_id=0, multiple=4)
  np.testing.assert_array_equal(prompts_BT, [[5, 6, 7, 0], [8, 0, 0, 0]])
  np.testing.assert_array_equal(lengths_B, [3, 1])
  with pytest.raises(ValueError):
    decode.pad_prompts([[5], []])
