"""Golden files of the follow-up variants, made by their authors' own code: tiny float32 runs
of each authors' module, saved to `tests/golden/*.npz` (inputs, weights, outputs, input- and
weight-gradients, or optimiser steps) for tests/test_golden_followups.py, which holds this
project's modules to them without torch (tests/golden/README.md; docs/beyond_the_paper.md,
"Held to the authors' code").

Run by hand when an authors' repository changes, never by CI; it needs numpy, torch and
transformers, not jax, and this project's code is not imported:

    python -m venv /work/torchvenv
    /work/torchvenv/bin/pip install torch==2.13.0 numpy transformers==4.57.6
    /work/torchvenv/bin/python experiments/make_golden_files.py --out tests/golden

`--mirrors=DIR` (default /work/.mirror) holds a git clone (bare is fine) of each repository
as DIR/<owner>+<name>/repo. Each module's source is read at the commit in `SOURCES` with `git
show COMMIT:PATH` and executed from memory or a temporary directory: their code is run, never
copied into this repository. The same commits, seeds and versions give the same files.

Where their module cannot run as it is on a CPU in float32, one named stand-in each:
  nGPT (NVIDIA/ngpt, model.py): flash_attn's `flash_attn_func` is torch's SDPA with the same
  causal mask and softmax scale; their bfloat16 casts (the Linear layers' dtype, the cast before
  attention) run in float32; `apply_rotary_position_embeddings` is the identity (their function
  is not a rotation, and this project's nGPT has no RoPE: positions are left out of the check).
  Gated attention (qiuzh20/gated_attention, modeling_qwen3.py): RoPE is given cos = 1, sin = 0
  through their `position_embeddings` argument (the identity; their code unchanged), q/k norm
  off, their v_proj and o_proj biases (config.qkv_bias puts one on every projection) held at
  0: this project's value and output projections have none.
  DyT, Derf: only the class definitions are executed (their files import timm, or are a patch).
"""
import argparse
import ast
import importlib
import os
import subprocess
import sys
import tempfile
import types

import numpy as np

SOURCES = {   # name: (repository, commit, file); each file is read at that commit
    "dyt": ("jiachenzhu/DyT", "aab5dde0bc1bdd4410f687dad404c87b31808f90", "dynamic_tanh.py"),
    "dyt_llama": ("jiachenzhu/DyT", "aab5dde0bc1bdd4410f687dad404c87b31808f90",
                  "other_tasks/LLaMA/fms_fsdp/models/llama.py"),
    "derf": ("zlab-princeton/Derf", "8dd9ea3cc70370f423a80a80af6f72466bc621db",
             "language model/model_derf.patch"),
    "gated_attention": ("qiuzh20/gated_attention", "49645df63aafe9e680bc44a9c0ca280d4aefa8e9",
                        "modeling_qwen3.py"),
    "ngpt": ("NVIDIA/ngpt", "ed19eb232380d41a9d71024b58d2403937d8f2c9", "model.py"),
    "completep": ("EleutherAI/nanoGPT-mup", "6f8bc3bdc744556141255f810a22387b2255b6c1",
                  "model.py"),   # the head of branch `completep`
}
B, T, D, H = 2, 5, 8, 2   # every case's shape: batch, time, width, heads


def git_show(mirrors: str, name: str, path: str | None = None) -> str:
  repo, commit, default_path = SOURCES[name]
  git_dir = os.path.join(mirrors, repo.replace("/", "+"), "repo")
  return subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path or default_path}"],
                        check=True, capture_output=True, text=True).stdout


def exec_classes(source: str, names: tuple[str, ...], namespace: dict) -> dict:
  """The top-level classes `names` of `source`, executed alone in `namespace`."""
  tree = ast.parse(source)
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name in names:
      code = compile(ast.Module([node], []), "<authors>", "exec")
      exec(code, namespace)  # pylint: disable=exec-used
  missing = set(names) - set(namespace)
  assert not missing, f"not in their source: {missing}"
  return namespace


def added_code(patch: str, wanted: str) -> str:
  """The run of a patch's added lines that defines `wanted` (a class), without the '+'s."""
  runs, run = [], []
  for line in patch.splitlines() + [""]:
    if line.startswith("+") and not line.startswith("+++"):
      run.append(line[1:])
    elif run:
      runs.append("\n".join(run))
      run = []
  return next(r for r in runs if f"class {wanted}(" in r)


def import_from_source(package: str, module_name: str, files: dict[str, str], stubs=None):
  """Writes `files` {file name: text} as the package `package` in a temporary directory and
  imports `package.module_name`, with `stubs` {module: module object} in sys.modules first."""
  sys.modules.update(stubs or {})
  root = tempfile.mkdtemp(prefix="authors_")
  os.makedirs(os.path.join(root, package))
  for name, text in {"__init__.py": "", **files}.items():
    with open(os.path.join(root, package, name), "w") as f:
      f.write(text)
  sys.path.insert(0, root)
  return importlib.import_module(f"{package}.{module_name}")


def tensor(x, grad=True):
  import torch  # pylint: disable=import-outside-toplevel
  return torch.tensor(np.asarray(x, np.float32), requires_grad=grad)


def run_and_save(out: str, name: str, module, inputs: dict, sources: tuple, forward=None):
  """`forward(**inputs)` (default: the module's) -> out; the gradients of sum(out * cotangent)
  with respect to every input and every parameter of `module`; saved with the sources."""
  y = (forward or module)(**inputs)
  y = y[0] if isinstance(y, tuple) else y
  cotangent = np.random.default_rng(99).normal(size=y.shape).astype(np.float32)
  (y * tensor(cotangent, grad=False)).sum().backward()
  arrays = {"out": y.detach().numpy(), "cotangent": cotangent}
  for key, x in inputs.items():
    arrays[f"input/{key}"] = x.detach().numpy()
    if x.requires_grad:
      arrays[f"grad/input/{key}"] = x.grad.numpy()
  for key, p in module.named_parameters():
    arrays[f"param/{key}"] = p.detach().numpy()
    arrays[f"grad/param/{key}"] = p.grad.numpy()
  save(out, name, arrays, sources)


def save(out: str, name: str, arrays: dict, sources: tuple):
  """`out/name.npz`: float32 arrays (integer and string ones kept), and `source/<name>` the
  "repository@commit:file" of each source."""
  meta = {f"source/{s}": np.array(f"{SOURCES[s][0]}@{SOURCES[s][1]}:{SOURCES[s][2]}")
          for s in sources}
  arrays = {k: np.asarray(v) if np.asarray(v).dtype.kind in "iU" else np.asarray(v, np.float32)
            for k, v in arrays.items()}
  np.savez_compressed(os.path.join(out, f"{name}.npz"), **arrays, **meta)
  print(f"{name}.npz: {len(arrays)} arrays from {', '.join(SOURCES[s][0] for s in sources)}")


def norm_cases(mirrors: str, out: str):
  """DyT (top-level DynamicTanh, LLaMA's LayerNormParameterized) and Derf's Dynamic_erf."""
  import torch  # pylint: disable=import-outside-toplevel
  from torch import nn  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  x = lambda: tensor(2.0 * rng.normal(size=(B, T, D)))   # into tanh / erf's non-linear range
  ns = {"torch": torch, "nn": nn}
  dyt = exec_classes(git_show(mirrors, "dyt"), ("DynamicTanh",), dict(ns))["DynamicTanh"]
  llama = exec_classes(git_show(mirrors, "dyt_llama"), ("LayerNormParameterized",),
                       dict(ns))["LayerNormParameterized"]
  derf = exec_classes(added_code(git_show(mirrors, "derf"), "Dynamic_erf"), ("Dynamic_erf",),
                      dict(ns))["Dynamic_erf"]
  cases = {"dyt": (dyt(D, channels_last=True), "dyt"),
           "dyt_llama": (llama(D, alpha_init_value=0.5), "dyt_llama"),
           "derf": (derf(D), "derf")}
  for name, (module, source) in cases.items():
    with torch.no_grad():   # every parameter off its initial value
      for key, p in module.named_parameters():
        value = {"alpha": 0.8, "shift": 0.3, "weight": 1.0 + 0.3 * rng.normal(size=p.shape),
                 "bias": 0.3 * rng.normal(size=p.shape)}[key]
        p.copy_(torch.full(p.shape, value) if np.isscalar(value) else torch.tensor(value))
    run_and_save(out, name, module, {"x": x()}, (source,))


def gated_attention_case(mirrors: str, out: str):
  """Their Qwen3Attention with the elementwise output gate, eager, causal."""
  import torch  # pylint: disable=import-outside-toplevel
  files = {f: git_show(mirrors, "gated_attention", f)
           for f in ("modeling_qwen3.py", "configuration_qwen3.py")}
  qwen3 = import_from_source("authors_gated_attention", "modeling_qwen3", files)
  config = qwen3.Qwen3Config(
      hidden_size=D, num_attention_heads=H, num_key_value_heads=H, head_dim=D // H,
      use_qk_norm=False, elementwise_attn_output_gate=True, qkv_bias=True,
      attention_dropout=0.0)
  attn = qwen3.Qwen3Attention(config, layer_idx=0).eval()
  rng = np.random.default_rng(1)
  with torch.no_grad():
    for key, p in attn.named_parameters():
      zero = key in ("v_proj.bias", "o_proj.bias")   # this project has no such biases
      p.copy_(torch.zeros_like(p) if zero else torch.tensor(
          0.5 * rng.normal(size=p.shape), dtype=torch.float32))
  mask = np.triu(np.full((T, T), np.finfo(np.float32).min, np.float32), k=1)
  rope_identity = (torch.ones(B, T, D // H), torch.zeros(B, T, D // H))
  forward = lambda hidden_states: attn(
      hidden_states, attention_mask=tensor(np.broadcast_to(mask, (B, 1, T, T)), grad=False),
      position_embeddings=rope_identity)[0]
  run_and_save(out, "gated_attention", attn, {"hidden_states": tensor(rng.normal(
      size=(B, T, D)))}, ("gated_attention",), forward)


def ngpt_module(mirrors: str):
  """Their model.py with the three stand-ins of the module docstring."""
  import torch  # pylint: disable=import-outside-toplevel

  def flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, **_):   # q, k, v [B, T, H, d]
    y = torch.nn.functional.scaled_dot_product_attention(
        *(a.transpose(1, 2) for a in (q, k, v)), is_causal=causal, scale=softmax_scale)
    return y.transpose(1, 2)

  class Float32Torch(types.ModuleType):   # torch, with bfloat16 meaning float32
    def __getattr__(self, name):
      return torch.float32 if name == "bfloat16" else getattr(torch, name)

  stub = types.ModuleType("flash_attn")
  stub.flash_attn_func, stub.flash_attn_qkvpacked_func = flash_attn_func, None
  model = import_from_source("authors_ngpt", "model", {"model.py": git_show(mirrors, "ngpt")},
                             {"flash_attn": stub})
  model.torch = Float32Torch("torch")
  model.apply_rotary_position_embeddings = lambda sinusoidal_pos, q, k: (q, k)
  return model


def ngpt_normalize(module, rng):
  """Scales stored off their initial values; every matrix normalised along the embedding
  dimension as their train.py's `normalize_matrices` does."""
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    for key, p in module.named_parameters():
      leaf = key.split(".")[-2:]
      if leaf[-1] == "weight":
        axis = 0 if leaf[0] in ("att_c_proj", "mlp_c_proj") else 1
        w = rng.normal(size=p.shape)
        p.copy_(torch.tensor(w / np.linalg.norm(w, axis=axis, keepdims=True)))
      else:   # alpha [D] to ~0.3 (their 0.05 moves h too little to test), the others ~1
        base = {"attn_alpha": 6.0 * D ** -0.5, "mlp_alpha": 6.0 * D ** -0.5,
                "sqk": D ** -0.5, "sz": D ** -0.5}.get(leaf[-1], 1.0)
        p.copy_(torch.tensor(base * (1 + 0.3 * rng.uniform(-1, 1, size=p.shape))))


def ngpt_cases(mirrors: str, out: str):
  """Their nGPT Block; their GPT at one layer (its logits with s_z, its loss)."""
  import torch  # pylint: disable=import-outside-toplevel
  model = ngpt_module(mirrors)
  config = model.GPTConfig(block_size=T, vocab_size=11, n_layer=1, n_head=H, n_embd=D,
                           base_scale=D ** -0.5, use_nGPT=1, bias=False)
  rng = np.random.default_rng(2)
  block = model.Block(config, 0)
  ngpt_normalize(block, rng)
  h = rng.normal(size=(B, T, D))
  run_and_save(out, "ngpt_block", block, {"h": tensor(h / np.linalg.norm(h, axis=-1,
                                                                          keepdims=True))},
               ("ngpt",))

  torch.manual_seed(0)
  gpt = model.GPT(config)
  ngpt_normalize(gpt, rng)
  with torch.no_grad():   # this project ties the head to the token table: same values here
    gpt.lm_head.weight.copy_(gpt.transformer.wte.weight)
  idx, targets = (torch.tensor(rng.integers(0, 11, size=(B, T))) for _ in range(2))
  logits, loss = gpt(idx, targets)
  loss.backward()
  arrays = {"logits": logits.detach().numpy(), "loss": loss.detach().numpy(),
            "input/idx": idx.numpy(), "input/targets": targets.numpy()}
  for key, p in gpt.named_parameters():
    arrays[f"param/{key}"], arrays[f"grad/param/{key}"] = p.detach().numpy(), p.grad.numpy()
  save(out, "ngpt_model", arrays, ("ngpt",))


def completep_case(mirrors: str, out: str, alpha: float, depth_multiplier: float):
  """Two steps of their AdamW with their CompleteP parameter groups (mup_enabled,
  depth_alpha_enabled, width multiplier 1), the learning rate of each group set as their
  train.py sets it before each step (lr * lr_scale), on given gradients. Every parameter
  tensor, in their `named_parameters` order (`names`, `shapes` "4x12"), raveled into one flat
  array per moment: param0 (before), grad1, param1 (after step 1), grad2, param2; `group`
  [n, 3] holds the [lr_scale, weight_decay, eps] of each tensor's group."""
  import torch  # pylint: disable=import-outside-toplevel
  model = import_from_source("authors_completep", "model",
                             {"model.py": git_show(mirrors, "completep")})
  config = model.GPTConfig(block_size=T, vocab_size=11, n_layer=2, n_head=1, n_embd=4,
                           bias=True, mup_enabled=True, depth_alpha_enabled=True,
                           depth_multiplier=depth_multiplier, depth_alpha_exp=alpha)
  torch.manual_seed(0)
  gpt = model.GPT(config)
  hyper = dict(learning_rate=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-3)
  opt = gpt.configure_optimizers(hyper["weight_decay"], hyper["learning_rate"],
                                 (hyper["beta1"], hyper["beta2"]), hyper["adam_eps"], "cpu")
  params = dict(gpt.named_parameters())
  flat = lambda tensors: np.concatenate([np.ravel(t) for t in tensors])
  group_of = {id(p): [g["lr_scale"], g["weight_decay"], g["eps"]]
              for g in opt.param_groups for p in g["params"]}
  arrays = {"names": np.array(list(params)),
            "shapes": np.array(["x".join(map(str, p.shape)) for p in params.values()]),
            "group": np.array([group_of[id(p)] for p in params.values()]),
            "param0": flat(p.detach().numpy() for p in params.values())}
  rng = np.random.default_rng(3)
  for step in (1, 2):
    grads = [rng.normal(size=p.shape) * 10.0 ** rng.uniform(-4, 0, size=p.shape)
             for p in params.values()]   # magnitudes 1e-4..1: eps matters for some
    for p, g in zip(params.values(), grads):
      p.grad = torch.tensor(g, dtype=torch.float32)
    for group in opt.param_groups:   # their train.py, before each step
      group["lr"] = hyper["learning_rate"] * group.get("lr_scale", 1.0)
    opt.step()
    arrays[f"grad{step}"] = flat(grads)
    arrays[f"param{step}"] = flat(p.detach().numpy() for p in params.values())
  arrays.update({f"hyper/{k}": v for k, v in dict(hyper, alpha=alpha, n_layer=2,
                                                   depth_multiplier=depth_multiplier).items()})
  save(out, f"completep_alpha{str(alpha).replace('.', '')}", arrays, ("completep",))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="tests/golden", help="folder for the .npz files")
  parser.add_argument("--mirrors", default="/work/.mirror",
                      help="folder of the authors' git clones, DIR/<owner>+<name>/repo")
  args = parser.parse_args()
  import torch  # pylint: disable=import-outside-toplevel
  torch.use_deterministic_algorithms(True)
  os.makedirs(args.out, exist_ok=True)
  norm_cases(args.mirrors, args.out)
  gated_attention_case(args.mirrors, args.out)
  ngpt_cases(args.mirrors, args.out)
  completep_case(args.mirrors, args.out, alpha=1.0, depth_multiplier=2.0)
  completep_case(args.mirrors, args.out, alpha=0.5, depth_multiplier=2.0)


if __name__ == "__main__":
  main()
