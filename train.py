"""Train the Kimi-K2-shaped MoE (model.py) with Muon (muon.py): continued pretraining, then RL, from one CPU
process to torchrun on many nodes.

The script reads top to bottom: flags and checks, the memory plan (--dry-run stops there), processes and
meshes, data, model and sharding, optimizer, pretraining loop, checkpoints, RL. With no arguments it trains the
`tiny` preset on a laptop CPU in under five minutes: pretraining on text every Python install has (this
project's sources and the standard library's: nothing to download) plus transcripts of the tool-use tasks
(tasks.py), then Dr. GRPO with textual feedback (grpo.py, feedback.py) on those tasks. For real runs `--data`
takes a folder of llm.c-style token shards (memory-mapped; the read position is checkpointed), a raw uint16
.bin file (nanoGPT's) or a folder of text. Under torchrun the same code shards dense weights with FSDP2/HSDP on
the dense mesh and expert weights on the expert mesh (mesh.py), with expert parallelism (--ep) and context
parallelism (--cp, pretraining only) folded onto the same ranks; in the RL stage each rank samples its own
rollouts. On CUDA it computes in bf16 (FSDP2's mixed precision, fp32 weights and reductions).

    python train.py                                            # tiny preset, CPU: pretraining, then RL
    python train.py --stage pretrain                           # pretraining only (--stage rl --resume: RL only)
    torchrun --nproc_per_node=4 train.py --cp 2 --ep 4 --stage pretrain   # FSDP x CP=2, EP=4 (gloo on CPU)
    torchrun --nproc_per_node=8 train.py --dp-replicate 2 --ep 4
    python train.py --resume                                   # continue from the newest checkpoint in out/
    python train.py --preset kimi-k2 --dry-run --world 512 --ep 64 --stage pretrain --seq-len 4096 --batch-size 512
"""
import argparse
import contextlib
import copy
import functools
import json
import logging
import math
import os
import random
import shutil
import sys
import sysconfig
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from mesh import CommCounter, LayoutError, build_meshes, init_distributed, make_layout
import tasks
from feedback import RULES, Feedback, FeedbackConfig
from grpo import GRPOConfig, grpo_loss, rollout
from model import (PRESETS, ModelConfig, MoE, Transformer, activation_elements, encode, flops_per_token,
                   param_counts)
from muon import Muon, param_groups

# -----------------------------------------------------------------------------
# Flags

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
g = parser.add_argument_group("model")
g.add_argument("--preset", default="tiny", help=f"model size, one of {list(PRESETS)}")
g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
g = parser.add_argument_group("run")
g.add_argument("--steps", type=int, default=800, help="optimizer steps in total (a resumed run stops here too)")
g.add_argument("--batch-size", type=int, default=16, help="global batch in sequences, whatever the layout")
g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (at most the preset's max_seq_len)")
g.add_argument("--lr", type=float, default=8e-3,
               help="peak learning rate for both groups: Muon uses adjust_lr_fn='match_rms_adamw' so one "
                    "AdamW-style lr serves the matrices and the embeddings/head/router/norms alike")
g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
g.add_argument("--warmup", type=int, default=30, help="linear warmup steps, then cosine decay to 10%%")
g.add_argument("--seed", type=int, default=1337, help="seeds the weights and the data order")
g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
g.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
               help="compute dtype; weights, gradient reduction and optimizer state stay fp32 (FSDP2's "
                    "MixedPrecisionPolicy under torchrun, autocast in one process). auto: bf16 on CUDA, fp32 on CPU")
g.add_argument("--activation-checkpointing", action="store_true",
               help="keep only each block's input for backward and recompute the rest")
g.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
g.add_argument("--dry-run", action="store_true",
               help="print the layout and the memory a rank needs (model built on the meta device), then exit")
g.add_argument("--world", type=int, default=None,
               help="with --dry-run: the world size to plan for (default: WORLD_SIZE)")
g = parser.add_argument_group("parallelism (torchrun; the shard degrees follow from the world size)")
g.add_argument("--dp-replicate", type=int, default=1, help="dense-weight replicas (HSDP); dp_shard = world/(dp_replicate*cp)")
g.add_argument("--cp", type=int, default=1, help="context parallelism: each sequence split over this many ranks")
g.add_argument("--ep", type=int, default=1, help="expert parallelism: experts split over this many ranks")
g.add_argument("--ep-replicate", type=int, default=1, help="expert-weight replicas; ep_shard = world/(ep_replicate*ep)")
g = parser.add_argument_group("data and output")
g.add_argument("--data", default=None,
               help="a folder of token shards (*.bin: llm.c's header, uint16 or uint32; names containing 'val' "
                    "are validation), one .bin file (with that header, or raw uint16 as nanoGPT's; val.bin beside "
                    "it is validation), or a folder of text files; default: this project's and Python's "
                    "standard library's sources")
g.add_argument("--out", default="out", help="folder for metrics.jsonl and the checkpoints (step-NNNNNNNN/)")
g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT")
g.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
g.add_argument("--eval-every", type=int, default=200, help="steps between validation evaluations and checkpoints")
g.add_argument("--eval-batches", type=int, default=8, help="batches per validation evaluation")
g = parser.add_argument_group("RL stage: Dr. GRPO with textual feedback on the tool-use tasks")
g.add_argument("--stage", default="both", choices=["pretrain", "rl", "both"],
               help="pretrain then RL, pretraining only, or RL only (from --resume or a fresh model)")
g.add_argument("--rl-steps", type=int, default=20, help="RL optimizer steps")
g.add_argument("--group-size", type=int, default=8, help="rollouts per task (the GRPO group)")
g.add_argument("--tasks-per-step", type=int, default=4, help="tasks (groups) per RL step")
g.add_argument("--rl-lr", type=float, default=1e-3, help="RL learning rate (both groups)")
g.add_argument("--feedback-coef", type=float, default=0.1, help="lambda of the feedback KL (0: pure RL)")
g.add_argument("--feedback-rules", default="tool_not_found",
               help=f"comma-separated hint rules of feedback.py: {', '.join(name for name, _ in RULES)}")
g.add_argument("--feedback-estimator", default="full", choices=["full", "sampled"],
               help="full: exact KL over the vocabulary; sampled: the sampled-token estimator")
g.add_argument("--kl-coef", type=float, default=0.0, help="KL to the starting policy (k1, folded into the reward)")
g.add_argument("--rl-eval-every", type=int, default=10, help="RL steps between held-out evaluations")
g.add_argument("--rl-eval-tasks", type=int, default=32, help="held-out tasks a level (1 and 2) per evaluation; 0: none")
g.add_argument("--sampler-bits", type=int, default=0, choices=[0, 8],
               help="8: sample with 8-bit block-quantised weights (MXFP8-like), corrected by truncated importance weights")
g.add_argument("--count-comm", action="store_true",
               help="count the calls and bytes of every collective in the second step and print them")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# Checks, processes and meshes. Every check runs before the process group exists and sees the same flags on
# every rank, so a bad layout stops all ranks with the same line instead of leaving some waiting forever.

world_size = int(os.environ.get("WORLD_SIZE", "1"))
is_rank0 = int(os.environ.get("RANK", "0")) == 0


def die(msg):
    """Bad input ends the run on every rank with one line naming the problem and exit code 2."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def print0(*a):
    if is_rank0:
        print(*a, flush=True)


if args.preset not in PRESETS:
    die(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
cfg: ModelConfig = PRESETS[args.preset]
if args.num_experts is not None:
    if not cfg.top_k <= args.num_experts:
        die(f"--num-experts {args.num_experts} is fewer than the {args.preset} preset's top-{cfg.top_k} routing")
    cfg = ModelConfig(**{**asdict(cfg), "num_experts": args.num_experts})
for flag in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
    if getattr(args, flag) <= 0:
        die(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
if args.seq_len > cfg.max_seq_len:
    die(f"--seq-len {args.seq_len} exceeds the {args.preset} preset's context of {cfg.max_seq_len} tokens")
if args.lr <= 0:
    die(f"--lr must be positive, got {args.lr}")
if args.device == "cuda" and not torch.cuda.is_available():
    die("--device cuda but no CUDA device is available")
if args.world is not None and (not args.dry_run or args.world < 1 or world_size > 1):
    die("--world plans a layout with --dry-run in one process (torchrun sets the real world size)")
if args.dry_run:
    world_size = args.world or world_size
try:
    layout = make_layout(world_size, args.dp_replicate, args.cp, args.ep, args.ep_replicate,
                         num_experts=cfg.num_experts, seq_len=args.seq_len, batch_size=args.batch_size)
except LayoutError as e:
    die(f"layout: {e}")
if args.stage != "pretrain":
    if min(args.rl_steps, args.tasks_per_step, args.rl_lr, args.rl_eval_every) <= 0 or args.group_size < 2:
        die("the RL stage needs --rl-steps, --tasks-per-step, --rl-lr and --rl-eval-every > 0, --group-size >= 2")
    unknown = set(args.feedback_rules.split(",")) - {name for name, _ in RULES}
    if unknown:
        die(f"--feedback-rules: unknown rule(s) {', '.join(sorted(unknown))}; choose from {', '.join(n for n, _ in RULES)}")
    if args.cp > 1:
        die(f"--cp {args.cp} with the RL stage: rollouts are a few hundred tokens, sampled whole on each rank; "
            f"context parallelism has nothing to split there (use --stage pretrain, or --cp 1)")
    if args.tasks_per_step % world_size:
        die(f"--tasks-per-step {args.tasks_per_step} does not split over {world_size} ranks (each samples its own "
            f"groups); use a multiple of {world_size}")


# -----------------------------------------------------------------------------
# Memory plan: what a rank holds at its peak, from shapes alone, so a layout can be sized before any GPU is
# booked (--dry-run) and a preset that cannot fit stops with one line instead of an out-of-memory crash.


def memory_plan(cfg, bf16):
    """-> ({kind: bytes a rank}, model on the meta device). fp32 weights, fp32 gradients and optimizer state
    (Muon: one momentum; AdamW: two moments), sharded as below: dense weights over dp_shard * cp ranks, experts
    over ep * ep_shard. FSDP's unsharded working set: the two largest units in the compute dtype (the current
    one and the prefetched next) plus one unit's fp32 gradient before its reduce-scatter; in one process with
    bf16, autocast's bf16 copy of every weight instead. Activations of this rank's tokens: model.py's
    activation_elements per layer (under activation checkpointing only each block's input, plus one block
    being recomputed) in the compute dtype, and the fp32 logits with their gradient."""
    with torch.device("meta"):
        m = Transformer(cfg)
    expert_ids = {id(p) for moe in m.moe_layers() for p in moe.experts.parameters()}
    muon_ids = {id(p) for p in param_groups(m.named_parameters(), lr=1.0, weight_decay=0.0)[0]["params"]}
    plan = dict.fromkeys(["weights", "gradients", "optimizer", "working copies", "activations"], 0.0)
    for p in m.parameters():
        n = p.numel() / (layout.ep * layout.ep_shard if id(p) in expert_ids else layout.dp_shard * layout.cp)
        plan["weights"] += 4 * n
        plan["gradients"] += 4 * n
        plan["optimizer"] += (4 if id(p) in muon_ids else 8) * n
    compute = 2 if bf16 else 4
    if layout.world > 1:
        units = [*m.layers, m.embed, [m.norm, m.lm_head]]  # the fully_shard units below
        unit = max(sum(p.numel() / (layout.ep if id(p) in expert_ids else 1)
                       for mod in (u if isinstance(u, list) else [u]) for p in mod.parameters()) for u in units)
        plan["working copies"] = unit * (2 * compute + 4)
    elif bf16:
        plan["working copies"] = 2 * sum(p.numel() for p in m.parameters())
    per_layer = [activation_elements(cfg, i, cp=layout.cp) for i in range(cfg.n_layer)]
    per_token = cfg.n_layer * cfg.dim + max(per_layer) if args.activation_checkpointing else sum(per_layer)
    tokens = args.batch_size // layout.dp * (args.seq_len // layout.cp)
    plan["activations"] = tokens * (per_token * compute + 2 * 4 * cfg.vocab_size)
    return plan, m


def in_gib(plan):
    return ", ".join(f"{k} {v / 2**30:,.2f}" for k, v in plan.items())


if args.dry_run:  # everything above ran as it would under torchrun; nothing below is allocated
    bf16 = args.precision != "fp32"  # plans are for GPUs, where auto means bf16
    plan, meta_model = memory_plan(cfg, bf16)
    total, active = param_counts(meta_model)
    print(f"preset {args.preset}: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active | world {world_size}: "
          f"dense (dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard}, cp={layout.cp}), experts "
          f"(ep_replicate={layout.ep_replicate}, ep_shard={layout.ep_shard}, ep={layout.ep}), "
          f"{cfg.num_experts // layout.ep} experts a rank | {args.batch_size // layout.dp} x "
          f"{args.seq_len // layout.cp} tokens a rank | {'bf16' if bf16 else 'fp32'} compute"
          f"{', activation checkpointing' if args.activation_checkpointing else ''}")
    print(f"memory a rank (GiB): {in_gib(plan)} | total {sum(plan.values()) / 2**30:,.2f}")
    sys.exit(0)

rank, local_rank, world_size, device = init_distributed(None if args.device == "auto" else args.device)
bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
dense_mesh, expert_mesh, dense_fsdp_mesh, expert_fsdp_mesh = build_meshes(layout, device.type)
dp_rank, cp_rank = layout.coords(rank)
B_local, T_local = args.batch_size // layout.dp, args.seq_len // layout.cp  # this rank's share of the batch

# -----------------------------------------------------------------------------
# Data: token shards (numpy arrays, memory-mapped from disk for real runs) cut into windows of seq_len + 1
# tokens. Training visits the windows in a seeded order: each epoch shuffles the shards and the windows inside
# each shard, so every window is read once an epoch and the order is a pure function of (seed, position). The
# position (windows consumed by all ranks together) goes into the checkpoint, so a resumed run continues on
# the next unseen window. Shards are read one after another, so mixing sources is the tokenizer's job, as for
# llm.c's shards: shuffle documents before cutting them into shards. Every rank computes the whole global
# batch's window list (cheap) and reads only its rows and its context-parallel chunk of each: every layout
# sees the same data.

TOOL_SHARE = 0.9
SHARD_MAGIC, SHARD_HEADER = 20240520, 256  # llm.c's token shards: 256 int32 [magic, version, n_tokens, ...]


def load_tokens(path):
    """-> (train shards, val shards, vocab size or None): lists of 1-D token arrays; dies with one line on
    missing, empty or corrupt data."""
    if path is None:  # text every Python install has: this project's sources and the standard library's
        here, stdlib = Path(__file__).resolve().parent, Path(sysconfig.get_paths()["stdlib"])
        files = sorted(here.glob("*.py")) + sorted(here.glob("*.md")) + sorted(stdlib.glob("*.py"))
        train, val = split(tokenize_files(files))
        # plus transcripts of the tool-use tasks, repeated to make TOOL_SHARE of the tokens: the RL stage needs a
        # model that knows the format and copies a call's arguments, which the tiny model learns only after a few
        # hundred steps of them (a run sees far fewer windows than there are distinct transcripts)
        tools = [np.array(encode(tasks.corpus(n, seed=seed), specials=True), dtype=np.uint16)
                 for n, seed in ((20000, 1), (1000, 2))]
        tools = [np.tile(t, max(1, round(TOOL_SHARE / (1 - TOOL_SHARE) * len(code) / len(t))))
                 for t, code in zip(tools, (train, val))]
        return [np.concatenate([train, tools[0]])], [np.concatenate([val, tools[1]])], None  # one shard: mixed
    p = Path(path)
    if not p.exists():
        die(f"--data {path}: no such file or folder")
    bins = [p] if p.suffix == ".bin" else sorted(p.glob("*.bin")) if p.is_dir() else []
    if bins:
        if p.is_file():  # one file: val.bin beside it is validation
            val = [p.with_name("val.bin")] if p.with_name("val.bin").is_file() and p.name != "val.bin" else []
        else:  # a folder of shards: llm.c names them *_train_000001.bin, *_val_000000.bin
            val = [b for b in bins if "val" in b.name]
            bins = [b for b in bins if b not in val]
        if not bins:
            die(f"--data {path}: no training shards (every .bin name contains 'val')")
        train, val = [read_shard(b) for b in bins], [read_shard(b) for b in val]
        vocab = max((v for _, v in train + val if v), default=None)
        train, val = [t for t, _ in train], [t for t, _ in val]
        if not val:  # hold out the tail of the last shard
            train[-1], tail = split(train[-1])
            val = [tail]
        return train, val, vocab
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    tokens = tokenize_files(files)
    if not tokens.size:
        die(f"--data {path}: no text found (the folder is empty or its files are blank)")
    train, val = split(tokens)
    return [train], [val], None


def read_shard(path):
    """A .bin file -> (memmap of its tokens, vocab size or None). With llm.c's header (int32 magic 20240520):
    version 1 = uint16 tokens, 2 = uint32, then the token count; our 4th slot gives the vocab size (0: the
    default of the version, GPT-2's 50257 or Llama 3's 128256). Without it: raw uint16, nanoGPT's train.bin."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER) if size >= 4 * SHARD_HEADER else None
    if header is not None and header[0] == SHARD_MAGIC:
        if header[1] not in (1, 2):
            die(f"--data {path}: shard header version {header[1]}; expected 1 (uint16) or 2 (uint32)")
        dtype = np.dtype(np.uint16 if header[1] == 1 else np.uint32)
        n, body = int(header[2]), size - 4 * SHARD_HEADER
        if n <= 0 or n * dtype.itemsize != body:
            die(f"--data {path}: the header promises {n} tokens ({n * dtype.itemsize} bytes) but {body} bytes "
                f"follow it (truncated or corrupt shard)")
        vocab = int(header[3]) or (50257 if header[1] == 1 else 128256)
        return np.memmap(path, dtype=dtype, mode="r", offset=4 * SHARD_HEADER, shape=(n,)), vocab
    if size < 2 or size % 2:
        die(f"--data {path}: a raw uint16 .bin file needs an even, non-zero number of bytes (got {size})")
    return np.memmap(path, dtype=np.uint16, mode="r"), None


def tokenize_files(files):
    """Byte-level tokens (model.encode, done in bulk) of the files joined by blank lines, as uint16."""
    text = b"\n\n".join(f.read_bytes().strip() for f in files).strip()
    return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)


def split(tokens):
    n = int(len(tokens) * 0.9)
    return tokens[:n], tokens[n:]


class Windows:
    """The shards as windows of `length` tokens in a seeded order; pos = windows consumed so far (all ranks)."""

    def __init__(self, shards, length, seed):
        self.shards, self.length, self.seed, self.pos = shards, length, seed, 0
        self.sizes = [len(s) // length for s in shards]  # whole windows a shard; the ragged tail is never read
        self.total = sum(self.sizes)
        self.perm = functools.lru_cache(maxsize=8)(lambda n, *key: np.random.default_rng([seed, *key]).permutation(n))

    def window(self, k):
        """The k-th window of the order -> (shard, first token)."""
        epoch, r = divmod(k, self.total)
        order = self.perm(len(self.shards), epoch)  # the shards' order this epoch
        ends = np.cumsum([self.sizes[i] for i in order])
        j = int(np.searchsorted(ends, r, side="right"))
        shard = int(order[j])
        return shard, int(self.perm(self.sizes[shard], epoch, shard)[r - (ends[j] - self.sizes[shard])]) * self.length

    def next(self, n):
        """The next n windows (a global batch) -> [(shard, first token)]."""
        self.pos += n
        return [self.window(k) for k in range(self.pos - n, self.pos)]


train_shards, val_shards, shard_vocab = load_tokens(args.data)
for name, shards in (("training", train_shards), ("validation", val_shards)):
    if not sum(len(s) // (args.seq_len + 1) for s in shards):
        die(f"--data: the {name} split has {sum(map(len, shards))} tokens, fewer than one window of "
            f"--seq-len + 1 = {args.seq_len + 1}")
# a tokenizer's vocab from the shard header, else the largest id (a small corpus); a .bin from another
# tokenizer (e.g. GPT-2's 50257) widens the embedding
vocab_size = max(cfg.vocab_size, shard_vocab or 1 + max(int(s.max()) for s in train_shards + val_shards if len(s)))
if vocab_size != cfg.vocab_size:
    cfg = ModelConfig(**{**asdict(cfg), "vocab_size": vocab_size})
train_windows = Windows(train_shards, args.seq_len + 1, args.seed)
eval_windows = {name: Windows(shards, args.seq_len + 1, seed=0).next(args.eval_batches * args.batch_size)
                for name, shards in (("train", train_shards), ("val", val_shards))}  # the same for every run


def get_batch(shards, windows):
    """The global batch's windows [(shard, first token)] -> this rank's B/dp rows and T/cp chunk of each:
    inputs, targets [B_local, T_local], pos [T_local]."""
    t0 = cp_rank * T_local
    rows = [shards[s][i + t0:i + t0 + T_local + 1] for s, i in windows[dp_rank * B_local:(dp_rank + 1) * B_local]]
    xy = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
    return xy[:, :-1], xy[:, 1:], torch.arange(t0, t0 + T_local, device=device)


# -----------------------------------------------------------------------------
# Model, sharding and optimizer

plan, meta_model = memory_plan(cfg, bf16)  # first: a preset that cannot fit gets one line, not an OOM crash
total, active = param_counts(meta_model)
need = max(sum(plan.values()), 4 * total)  # each rank builds the whole fp32 model once before sharding it
if device.type == "cuda":
    available = torch.cuda.mem_get_info(device)[0]
else:
    pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in getattr(os, "sysconf_names", {}) else None
    available = pages * os.sysconf("SC_PAGE_SIZE") / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) \
        if pages else need  # unknown (macOS, Windows): try it
if need > available:
    die(f"preset {args.preset} ({total / 1e9:.1f}B parameters) needs ~{need / 2**30:,.0f} GiB a rank (the whole "
        f"model while it is built, then {in_gib(plan)} GiB), more than the {available / 2**30:,.0f} GiB free on "
        f"{device}; see --dry-run")
torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its shards
model = Transformer(cfg).to(device)
for block in model.layers:
    block.checkpoint = args.activation_checkpointing
    if args.compile:  # the block's computation, inside activation checkpointing and FSDP's hooks (as torchtitan)
        block._forward = torch.compile(block._forward)
amp = torch.autocast(device.type, torch.bfloat16, enabled=bf16 and world_size == 1)  # one process: autocast

# FSDP shards the experts over the ranks that hold the same ones: on dim 1 when there are fewer experts than ranks
expert_shard_dim = 0 if cfg.num_experts // layout.ep >= layout.ep_shard else 1
if world_size > 1:
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    # bf16: FSDP gathers bf16 copies of the fp32 shards for compute and reduce-scatters fp32 gradients
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.layers:
        block.attn.cp_group = dense_mesh["cp"].get_group() if layout.cp > 1 else None
        if isinstance(block.ffn, MoE):
            experts = block.ffn.experts
            if layout.ep > 1:  # expert parallelism: rank i of the EP group keeps experts [i*E/ep, (i+1)*E/ep)
                for name, p in list(experts.named_parameters()):
                    experts.register_parameter(name, nn.Parameter(
                        distribute_tensor(p.data, expert_mesh["ep"], [Shard(0)], src_data_rank=None)))
            fully_shard(experts, mesh=expert_fsdp_mesh, shard_placement_fn=lambda p: Shard(expert_shard_dim),
                        mp_policy=mp)
            # Each expert's gradient already sums the tokens of the whole EP group (the all-to-all carries them
            # home), and FSDP averages over the world/ep ranks holding that expert: dividing by world, not by
            # world/ep, keeps it the mean over the global batch (the "EP factor" bug of other stacks).
            experts.set_gradient_divide_factor(world_size)
            if device.type == "cpu" and layout.ep_shard > 1:
                # gloo lacks the PREMUL_SUM reduction a custom factor uses: sum, then divide. Not with a
                # shard group of one: FSDP (torch 2.13) would then divide twice, once without reducing.
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense_fsdp_mesh, mp_policy=mp)
    # the embedding and the output head are units of their own: for Kimi K2 each is a layer's worth of weights
    fully_shard(model.embed, mesh=dense_fsdp_mesh, mp_policy=mp)
    fully_shard([model.norm, model.lm_head], mesh=dense_fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dense_fsdp_mesh, mp_policy=mp)

ns_dtype = torch.float32 if args.precision == "fp32" else None  # None: Newton-Schulz in bf16 on CUDA, fp32 on CPU
optimizer = Muon(param_groups(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay),
                 adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
for group in optimizer.param_groups:
    group["initial_lr"] = group["lr"]


def clip_grad_norm(max_norm):
    """Clip by the global gradient norm over parameters that live on two meshes: a sum of squares per mesh
    (one all-reduce each, as a DTensor resolves its partial sum), then combined. -> the norm before clipping"""
    by_mesh = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    total_sq = torch.zeros((), device=device)
    for grads in by_mesh.values():
        sq = sum(g.float().pow(2).sum() for g in grads)
        total_sq += sq.full_tensor() if isinstance(sq, DTensor) else sq
    norm = total_sq.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for grads in by_mesh.values():
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
    return norm


def lr_factor(step):
    """Linear warmup, then cosine from 1 down to 0.1 at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def mean_over_ranks(x):
    """A float averaged over all ranks (each holds an equal share of tokens); as is at world size 1."""
    if world_size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world_size


@torch.no_grad()
def evaluate():
    """Mean loss over a fixed set of batches of each split (nanoGPT's estimate_loss), so evaluations at
    different steps and layouts compare. -> (train_loss, val_loss)"""
    model.eval()
    losses = []
    for shards, windows in ((train_shards, eval_windows["train"]), (val_shards, eval_windows["val"])):
        total = 0.0
        for i in range(0, len(windows), args.batch_size):
            x, y, pos = get_batch(shards, windows[i:i + args.batch_size])
            with amp:
                total += model(x, y, pos=pos)[1].item()
        losses.append(mean_over_ranks(total / args.eval_batches))
    model.train()
    return losses


PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, NVIDIA datasheets


def device_peak():
    """-> (FLOP/s, its source), the MFU denominator: a known GPU's datasheet bf16 peak when computing in bf16,
    else the best of a few square matmuls in the compute dtype, measured here."""
    if device.type == "cuda" and bf16:
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_BF16.items():
            if all(word in name for word in key.split()):
                return flops, f"{key} bf16 datasheet"
    dtype = torch.bfloat16 if bf16 else torch.float32
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(10):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n ** 3 * 8 / (time.perf_counter() - t0))
    return best, f"measured {str(dtype).removeprefix('torch.')} matmul"


def peak_memory():
    """Bytes this rank has held at most: the CUDA allocator's high-water mark, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# -----------------------------------------------------------------------------
# Checkpoints: torch.distributed.checkpoint (DCP) writes every rank's shards into one folder a step, which loads
# at any world size and layout. Atomic: written as step-N.tmp, renamed when complete, older ones removed after.

out = Path(args.out)
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process: intended


def checkpoints():
    return sorted(p for p in out.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def barrier():
    if world_size > 1:
        dist.barrier()


def save_checkpoint(step):
    path, tmp = out / f"step-{step:08d}", out / f"step-{step:08d}.tmp"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, no_dist=world_size == 1)
    if is_rank0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "data_pos": train_windows.pos, "config": asdict(cfg),
                                                   "args": vars(args)}))
        if path.exists():  # left by an earlier run in the same folder
            shutil.rmtree(path)
        os.replace(tmp, path)
        for old in checkpoints():
            if old != path:
                shutil.rmtree(old)
    barrier()


start_step = 0
if not args.resume and checkpoints():  # a new run would delete them as it saves its own
    die(f"--out {out} already holds {checkpoints()[-1].name}; pass --resume to continue from it, or another --out")
if args.resume:
    found = checkpoints()
    if not found:
        die(f"--resume: no checkpoint in {out} (expected a step-NNNNNNNN folder)")
    path = found[-1]
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta["config"] != asdict(cfg):
            die(f"--resume: {path} holds a different model (preset {meta['args']['preset']!r}, vocab "
                f"{meta['config']['vocab_size']}) than this run ({args.preset!r}, vocab {cfg.vocab_size})")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        logging.disable(logging.ERROR)  # DCP logs tracebacks of what it cannot read; we report it in one line
        dcp.load(state, checkpoint_id=path, no_dist=world_size == 1)  # reshards: any writer layout loads
        logging.disable(logging.NOTSET)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start_step = meta["step"]
        train_windows.pos = meta.get("data_pos", start_step * args.batch_size)  # the next unseen window
    except SystemExit:
        raise
    except (Exception, CheckpointException) as e:  # missing or truncated files, not a checkpoint, wrong shapes
        msg = str(e).strip().splitlines()[-1][:160] if str(e).strip() else "no details"
        die(f"--resume: checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {msg})")
    if start_step >= args.steps and args.stage != "rl":
        die(f"--resume: the checkpoint is already at step {start_step} >= --steps {args.steps}")
    for group in optimizer.param_groups:  # the schedule comes from this run's flags
        group["initial_lr"] = args.lr

# -----------------------------------------------------------------------------
# Training loop

metrics_path = out / "metrics.jsonl"
if is_rank0:
    out.mkdir(parents=True, exist_ok=True)
    kept = []  # on resume keep the records up to the checkpoint's step: steps after it are about to be redone
    if args.resume and metrics_path.exists():
        kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start_step]
    metrics = open(metrics_path, "w")
    metrics.writelines(ln + "\n" for ln in kept)
barrier()
tokens_per_step = args.batch_size * args.seq_len
flops_per_step = flops_per_token(model, args.seq_len) * tokens_per_step
peak, peak_source = device_peak()  # per rank
world_group = dist.group.WORLD if world_size > 1 else None
print0(f"preset {args.preset}: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active | "
       f"{sum(map(len, train_shards)):,} train / {sum(map(len, val_shards)):,} val tokens in {len(train_shards)} + "
       f"{len(val_shards)} shards | {world_size} x {device} "
       f"({torch.get_num_threads()} threads each) | dense mesh (dp_replicate={layout.dp_replicate}, "
       f"dp_shard={layout.dp_shard}, cp={layout.cp}) expert mesh (ep_replicate={layout.ep_replicate}, "
       f"ep_shard={layout.ep_shard}, ep={layout.ep})" + (f", {cfg.num_experts // layout.ep} experts a rank, FSDP "
       f"Shard({expert_shard_dim})" if world_size > 1 else "") + f" | {'bf16' if bf16 else 'fp32'} compute | peak "
       f"{peak / 1e9:,.1f} GFLOP/s a rank ({peak_source})")


def log(record):
    if is_rank0:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()


if start_step == 0:
    train_loss, val_loss = evaluate()
    print0(f"step {0:5d} | train loss {train_loss:.4f} | val loss {val_loss:.4f}")
    log({"step": 0, "loss": train_loss, "val_loss": val_loss})
else:
    print0(f"resumed from {checkpoints()[-1]} at step {start_step}")

model.train()
t_log, n_log, t_opt_sum = time.perf_counter(), 0, 0.0
for step in range(start_step + 1, args.steps + 1 if args.stage != "rl" else start_step + 1):
    t0 = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lr_factor(step - 1)
    x, y, pos = get_batch(train_shards, train_windows.next(args.batch_size))
    comm = CommCounter() if args.count_comm and step == start_step + 2 else contextlib.nullcontext()
    with comm:
        with amp:
            _, loss = model(x, y, pos=pos)  # mean over this rank's tokens; FSDP averages the gradients over ranks
        loss.backward()
        grad_norm = clip_grad_norm(args.grad_clip)  # .item() inside: the backward has finished
        t_opt = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_opt = time.perf_counter() - t_opt
        optimizer.zero_grad(set_to_none=True)
        balance = model.update_router_bias(world_group)  # loads summed over all ranks, every bias nudged alike
    if isinstance(comm, CommCounter):
        kinds = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
        stats = [mean_over_ranks(float(d.get(k, 0))) for d in (comm.bytes, comm.calls) for k in kinds]
        print0(f"step {step:5d} | communication a rank, mean over ranks: " + ", ".join(
            f"{k} {b / 2**20:.2f} MiB in {c:.0f} calls" for k, b, c in zip(kinds, stats[:4], stats[4:])))
    loss = mean_over_ranks(loss.item())  # .item() syncs the device, so the timing below is real
    if not math.isfinite(loss):
        die(f"loss became {loss} at step {step}; lower --lr (now {args.lr})")
    dt = time.perf_counter() - t0
    record = {"step": step, "loss": loss, "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
              "ms": 1000 * dt, "optimizer_ms": 1000 * t_opt, "balance": balance, "data_pos": train_windows.pos}
    n_log, t_opt_sum = n_log + 1, t_opt_sum + t_opt
    if step % args.log_every == 0 or step == args.steps:
        elapsed = (time.perf_counter() - t_log) / n_log
        print0(f"step {step:5d} | loss {loss:.4f} | {1000 * elapsed:6.1f} ms/step | "
               f"{tokens_per_step / elapsed / world_size:8.0f} tok/s a rank | "
               f"MFU {100 * flops_per_step / elapsed / (peak * world_size):5.1f}% | optimizer "
               f"{1000 * t_opt_sum / n_log:.1f} ms | peak mem {peak_memory() / 2**30:.2f} GiB | "
               f"load max/mean {balance:.2f}")
        t_log, n_log, t_opt_sum = time.perf_counter(), 0, 0.0
    if step % args.eval_every == 0 or step == args.steps:
        record["train_loss_eval"], record["val_loss"] = evaluate()
        print0(f"step {step:5d} | train loss {record['train_loss_eval']:.4f} | val loss {record['val_loss']:.4f}")
        save_checkpoint(step)
        t_log = time.perf_counter()  # evaluation and saving are not training time
    log(record)

# -----------------------------------------------------------------------------
# RL: groups of rollouts on tool-use tasks at the sampler's difficulty, Dr. GRPO + lambda * feedback KL.
# Sampling runs no collectives, so ranks may write rollouts of different lengths: each rank samples its own
# groups with a plain full copy of the policy (the shards gathered once a step; at world size 1 the model
# itself), which also serves as the feedback teacher. The one forward and backward a step run on the sharded
# model; each rank normalises by its own trajectories x max_gen_tokens, the same constant everywhere, and
# FSDP's mean over ranks makes it the global one.


def sum_over_ranks(xs):
    """Floats summed over all ranks; as is at world size 1."""
    if world_size == 1:
        return list(xs)
    t = torch.tensor(list(xs), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


if args.stage != "pretrain":
    base = start_step if args.stage == "rl" else args.steps  # the optimizer steps before RL, for step numbers
    rl = GRPOConfig(group_size=args.group_size, kl_coef=args.kl_coef, sampler_bits=args.sampler_bits)
    sampler = model if world_size == 1 else Transformer(cfg).to(device)

    @torch.no_grad()
    def refresh_sampler():
        if sampler is not model:  # an all-gather per tensor, in the same order on every rank
            sampler.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                                     for k, v in model.state_dict().items()})

    @torch.no_grad()
    def rl_eval(rl_step, per_level=args.rl_eval_tasks):
        """Pass rate and tool-not-found rate on the same held-out tasks every time (levels 1 and 2, sampling
        seeded alike), so evaluations differ only by the policy; the tasks are split over the ranks."""
        rng, gen_eval = random.Random(10**6), torch.Generator().manual_seed(10**6 + rank)
        held_out = [(lvl, tasks.make_tool_task(rng, lvl)) for lvl in (1, 2) for _ in range(per_level)]
        mine = held_out[rank::world_size]
        envs = [tasks.ToolEnv(task) for _, task in mine]
        trajs = rollout(sampler, envs, rl, gen_eval)
        sums = sum_over_ranks([sum(t.reward for t, (lvl, _) in zip(trajs, mine) if lvl == 1),
                               sum(t.reward for t, (lvl, _) in zip(trajs, mine) if lvl == 2),
                               sum(e.tool_errors for e in envs), sum(e.tool_calls for e in envs)])
        record = {"stage": "rl_eval", "step": base + rl_step, "rl_step": rl_step,
                  "pass_level1": sums[0] / per_level, "pass_level2": sums[1] / per_level,
                  "tool_error_rate": sums[2] / max(1, sums[3])}
        log(record)
        print0(f"rl eval after {rl_step:3d} steps | held-out pass rate level 1 {record['pass_level1']:.3f}, "
               f"level 2 {record['pass_level2']:.3f} | tool not found {record['tool_error_rate']:.3f} of calls")

    refresh_sampler()
    rl_eval(0)
    feedback = Feedback(sampler, FeedbackConfig(coef=args.feedback_coef, estimator=args.feedback_estimator),
                        rules=[rule for rule in RULES if rule[0] in args.feedback_rules.split(",")])
    reference = copy.deepcopy(sampler).requires_grad_(False) if args.kl_coef else None
    # A fresh optimizer: the pretraining momentum points nowhere useful for RL. Muon's update has the same size
    # whatever the gradient's, so the RL learning rate alone sets how far a step moves.
    optimizer = Muon(param_groups(model.named_parameters(), lr=args.rl_lr, weight_decay=0.0),
                     adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype)
    difficulty = tasks.DifficultySampler()
    level_rng, task_rng = random.Random(args.seed), random.Random(args.seed * 1000 + rank)  # same level everywhere
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    groups = args.tasks_per_step // world_size  # this rank's share of the step's tasks
    print0(f"RL: {args.rl_steps} steps x {args.tasks_per_step} tasks x {args.group_size} rollouts "
           f"({groups} tasks a rank), lr {args.rl_lr}, feedback lambda {args.feedback_coef}, KL coef {args.kl_coef}")
    for rl_step in range(1, args.rl_steps + 1):
        t0 = time.perf_counter()
        level = difficulty.sample(level_rng)
        envs = [tasks.ToolEnv(task) for task in (tasks.make_tool_task(task_rng, level) for _ in range(groups))
                for _ in range(args.group_size)]
        trajs = rollout(sampler, envs, rl, gen)
        with amp:
            loss, stats, _, logits = grpo_loss(model, trajs, rl, ref=reference)
            fb = {}
            if args.feedback_coef:  # lambda = 0 leaves the RL loss exactly as it is
                fb_loss, fb = feedback.loss(model, trajs, len(trajs) * rl.max_gen_tokens, logits=logits,
                                            current=sampler)
                loss = loss + args.feedback_coef * fb_loss
        loss.backward()
        clip_grad_norm(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for moe in model.moe_layers():  # the router bias stays as pretraining left it: an RL batch is small and
            moe.tokens_per_expert.zero_()  # padded, so its load counts would mostly count padding
        refresh_sampler()
        feedback.update(sampler)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64, device=device)
        if world_size > 1:  # every rank's rewards move the one difficulty sampler
            gathered = [torch.empty_like(rewards) for _ in range(world_size)]
            dist.all_gather(gathered, rewards)
            rewards = torch.cat(gathered)
        for r in rewards.tolist():
            difficulty.update(level, r)
        calls, errors, malformed, tokens, targets, kl_sum = sum_over_ranks([
            sum(e.tool_calls for e in envs), sum(e.tool_errors for e in envs), sum(e.malformed for e in envs),
            stats["gen_tokens"] * len(trajs), fb.get("feedback_targets", 0),
            fb.get("feedback_kl", 0.0) * fb.get("feedback_targets", 0)])
        n = len(rewards)
        record = {"stage": "rl", "step": base + rl_step, "rl_step": rl_step, "level": level,
                  "reward": rewards.mean().item(), "tool_error_rate": errors / max(1, calls), "malformed_rate": malformed / n,
                  "gen_tokens": tokens / n, "feedback_targets": targets, "feedback_kl": kl_sum / max(1, targets),
                  "clip_frac": mean_over_ranks(stats["clip_frac"]), "ms": 1000 * (time.perf_counter() - t0)}
        log(record)
        if rl_step % max(1, args.log_every // 4) == 0 or rl_step == args.rl_steps:
            print0(f"rl step {rl_step:4d} | level {level} | reward {record['reward']:.3f} | tool not found "
                   f"{record['tool_error_rate']:.3f} of calls | malformed {record['malformed_rate']:.2f} a rollout | "
                   f"feedback KL {record['feedback_kl']:.4f} | {record['gen_tokens']:.0f} tokens | {record['ms']:.0f} ms")
        if rl_step % args.rl_eval_every == 0 or rl_step == args.rl_steps:
            rl_eval(rl_step)
    save_checkpoint(base + args.rl_steps)
print0(f"done: checkpoint {checkpoints()[-1]}, metrics {metrics_path}")
if world_size > 1:
    dist.barrier()
    dist.destroy_process_group()
