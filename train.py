"""Train the Kimi-K2-shaped MoE (model.py) with Muon (muon.py): continued pretraining, then RL, from one CPU
process to torchrun on many nodes.

The script reads top to bottom: flags, processes and meshes, data, model and sharding, optimizer, pretraining
loop, checkpoints, RL. With no arguments it trains the `tiny` preset on a laptop CPU in under five minutes:
pretraining on text every Python install has (this project's sources and the standard library's: nothing to
download) plus transcripts of the tool-use tasks (tasks.py), then Dr. GRPO with textual feedback (grpo.py,
feedback.py) on those tasks. `--data` takes a folder of text files or a pre-tokenized uint16 .bin file
(nanoGPT's format) for real runs. Under torchrun the same code shards dense weights with FSDP2/HSDP on the dense
mesh and expert weights on the expert mesh (mesh.py), with expert parallelism (--ep) and context parallelism
(--cp, pretraining only) folded onto the same ranks; in the RL stage each rank samples its own rollouts.

    python train.py                                            # tiny preset, CPU: pretraining, then RL
    python train.py --stage pretrain                           # pretraining only (--stage rl --resume: RL only)
    torchrun --nproc_per_node=4 train.py --cp 2 --ep 4 --stage pretrain   # FSDP x CP=2, EP=4 (gloo on CPU)
    torchrun --nproc_per_node=8 train.py --dp-replicate 2 --ep 4
    python train.py --resume                                   # continue from the newest checkpoint in out/
"""
import argparse
import contextlib
import copy
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
from model import PRESETS, ModelConfig, MoE, Transformer, encode, flops_per_token, param_counts
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
g = parser.add_argument_group("parallelism (torchrun; the shard degrees follow from the world size)")
g.add_argument("--dp-replicate", type=int, default=1, help="dense-weight replicas (HSDP); dp_shard = world/(dp_replicate*cp)")
g.add_argument("--cp", type=int, default=1, help="context parallelism: each sequence split over this many ranks")
g.add_argument("--ep", type=int, default=1, help="expert parallelism: experts split over this many ranks")
g.add_argument("--ep-replicate", type=int, default=1, help="expert-weight replicas; ep_shard = world/(ep_replicate*ep)")
g = parser.add_argument_group("data and output")
g.add_argument("--data", default=None,
               help="a folder of text files or a uint16 .bin token file (val.bin beside it is used for "
                    "validation if present); default: this project's and Python's standard library's sources")
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

rank, local_rank, world_size, device = init_distributed(None if args.device == "auto" else args.device)
dense_mesh, expert_mesh, dense_fsdp_mesh, expert_fsdp_mesh = build_meshes(layout, device.type)
dp_rank, cp_rank = layout.coords(rank)
B_local, T_local = args.batch_size // layout.dp, args.seq_len // layout.cp  # this rank's share of the batch

# -----------------------------------------------------------------------------
# Data: one long stream of token ids; the last 10% (or val.bin) is held out for validation


TOOL_SHARE = 0.9


def load_tokens(path):
    """-> (train, val) as 1-D numpy arrays of token ids; dies with one line on missing or empty data."""
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
        return np.concatenate([train, tools[0]]), np.concatenate([val, tools[1]])
    p = Path(path)
    if not p.exists():
        die(f"--data {path}: no such file or folder")
    if p.is_file() and p.suffix == ".bin":
        if p.stat().st_size < 2 or p.stat().st_size % 2:
            die(f"--data {path}: a uint16 .bin file needs an even, non-zero number of bytes "
                f"(got {p.stat().st_size})")
        train = np.memmap(p, dtype=np.uint16, mode="r")
        val_path = p.with_name("val.bin")
        if val_path.exists() and val_path != p and val_path.stat().st_size >= 2:
            return train, np.memmap(val_path, dtype=np.uint16, mode="r")
        return split(train)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    tokens = tokenize_files(files)
    if not tokens.size:
        die(f"--data {path}: no text found (the folder is empty or its files are blank)")
    return split(tokens)


def tokenize_files(files):
    """Byte-level tokens (model.encode, done in bulk) of the files joined by blank lines, as uint16."""
    text = b"\n\n".join(f.read_bytes().strip() for f in files).strip()
    return np.frombuffer(text, dtype=np.uint8).astype(np.uint16)


def split(tokens):
    n = int(len(tokens) * 0.9)
    return tokens[:n], tokens[n:]


train_data, val_data = load_tokens(args.data)
for name, d in (("training", train_data), ("validation", val_data)):
    if len(d) < args.seq_len + 2:
        die(f"--data: the {name} split has {len(d)} tokens, fewer than --seq-len + 2 = {args.seq_len + 2}")
vocab_size = max(cfg.vocab_size, int(train_data.max()) + 1, int(val_data.max()) + 1)
if vocab_size != cfg.vocab_size:  # a .bin from another tokenizer (e.g. GPT-2's 50257): widen the embedding
    cfg = ModelConfig(**{**asdict(cfg), "vocab_size": vocab_size})


def get_batch(data, seed):
    """The global batch is B random windows drawn from `seed` alone, so every layout sees the same data; this
    rank reads its B/dp sequences and its T/cp chunk of each. -> inputs, targets [B_local, T_local], pos [T_local]"""
    ix = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,),
                       generator=torch.Generator().manual_seed(seed)).tolist()
    t0 = cp_rank * T_local
    rows = [data[i + t0:i + t0 + T_local + 1] for i in ix[dp_rank * B_local:(dp_rank + 1) * B_local]]
    xy = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
    return xy[:, :-1], xy[:, 1:], torch.arange(t0, t0 + T_local, device=device)


# -----------------------------------------------------------------------------
# Model, sharding and optimizer

with torch.device("meta"):  # count first: a preset that cannot fit gets one line, not an out-of-memory crash
    total, active = param_counts(Transformer(cfg))
need = 16 * total / world_size  # bytes a rank: fp32 weights, gradients and up to two optimizer states, sharded
if device.type == "cuda":
    available = torch.cuda.mem_get_info(device)[0]
else:
    pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in getattr(os, "sysconf_names", {}) else None
    available = pages * os.sysconf("SC_PAGE_SIZE") / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) \
        if pages else need  # unknown (macOS, Windows): try it
if need > available:
    die(f"preset {args.preset} has {total / 1e9:.1f}B parameters: ~{need / 2**30:,.0f} GiB of weights, gradients "
        f"and optimizer state per rank, more than the {available / 2**30:,.0f} GiB free on {device}")
torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its shards
model = Transformer(cfg).to(device)

# FSDP shards the experts over the ranks that hold the same ones: on dim 1 when there are fewer experts than ranks
expert_shard_dim = 0 if cfg.num_experts // layout.ep >= layout.ep_shard else 1
if world_size > 1:
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    for block in model.layers:
        block.attn.cp_group = dense_mesh["cp"].get_group() if layout.cp > 1 else None
        if isinstance(block.ffn, MoE):
            experts = block.ffn.experts
            if layout.ep > 1:  # expert parallelism: rank i of the EP group keeps experts [i*E/ep, (i+1)*E/ep)
                for name, p in list(experts.named_parameters()):
                    experts.register_parameter(name, nn.Parameter(
                        distribute_tensor(p.data, expert_mesh["ep"], [Shard(0)], src_data_rank=None)))
            fully_shard(experts, mesh=expert_fsdp_mesh, shard_placement_fn=lambda p: Shard(expert_shard_dim))
            # Each expert's gradient already sums the tokens of the whole EP group (the all-to-all carries them
            # home), and FSDP averages over the world/ep ranks holding that expert: dividing by world, not by
            # world/ep, keeps it the mean over the global batch (the "EP factor" bug of other stacks).
            experts.set_gradient_divide_factor(world_size)
            if device.type == "cpu" and layout.ep_shard > 1:
                # gloo lacks the PREMUL_SUM reduction a custom factor uses: sum, then divide. Not with a
                # shard group of one: FSDP (torch 2.13) would then divide twice, once without reducing.
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense_fsdp_mesh)
    fully_shard(model, mesh=dense_fsdp_mesh)

optimizer = Muon(param_groups(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay),
                 adjust_lr_fn="match_rms_adamw")
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
    losses = [mean_over_ranks(sum(model(*xy[:2], pos=xy[2])[1].item()
                                  for xy in (get_batch(data, 10**9 + i) for i in range(args.eval_batches)))
                              / args.eval_batches) for data in (train_data, val_data)]
    model.train()
    return losses


def measure_matmul_peak():
    """FLOP/s of a square fp32 matmul, best of a few tries: the MFU denominator on this machine."""
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
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
    return best


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
        (tmp / "meta.json").write_text(json.dumps({"step": step, "config": asdict(cfg), "args": vars(args)}))
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
peak = measure_matmul_peak()  # per rank
world_group = dist.group.WORLD if world_size > 1 else None
print0(f"preset {args.preset}: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active | "
       f"{len(train_data):,} train / {len(val_data):,} val tokens | {world_size} x {device} "
       f"({torch.get_num_threads()} threads each) | dense mesh (dp_replicate={layout.dp_replicate}, "
       f"dp_shard={layout.dp_shard}, cp={layout.cp}) expert mesh (ep_replicate={layout.ep_replicate}, "
       f"ep_shard={layout.ep_shard}, ep={layout.ep})" + (f", {cfg.num_experts // layout.ep} experts a rank, FSDP "
       f"Shard({expert_shard_dim})" if world_size > 1 else "") + f" | matmul peak {peak / 1e9:.1f} GFLOP/s a rank")


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
t_log, n_log = time.perf_counter(), 0
for step in range(start_step + 1, args.steps + 1 if args.stage != "rl" else start_step + 1):
    t0 = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lr_factor(step - 1)
    x, y, pos = get_batch(train_data, args.seed * 1_000_003 + step)
    comm = CommCounter() if args.count_comm and step == start_step + 2 else contextlib.nullcontext()
    with comm:
        _, loss = model(x, y, pos=pos)  # mean over this rank's tokens; FSDP averages the gradients over ranks
        loss.backward()
        grad_norm = clip_grad_norm(args.grad_clip)
        optimizer.step()
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
              "ms": 1000 * dt, "balance": balance}
    n_log += 1
    if step % args.log_every == 0 or step == args.steps:
        elapsed = (time.perf_counter() - t_log) / n_log
        print0(f"step {step:5d} | loss {loss:.4f} | {1000 * elapsed:6.1f} ms/step | "
               f"{tokens_per_step / elapsed / world_size:8.0f} tok/s a rank | "
               f"MFU {100 * flops_per_step / elapsed / (peak * world_size):5.1f}% | load max/mean {balance:.2f}")
        t_log, n_log = time.perf_counter(), 0
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
    feedback = Feedback(sampler, FeedbackConfig(coef=args.feedback_coef),
                        rules=[rule for rule in RULES if rule[0] in args.feedback_rules.split(",")])
    reference = copy.deepcopy(sampler).requires_grad_(False) if args.kl_coef else None
    # A fresh optimizer: the pretraining momentum points nowhere useful for RL. Muon's update has the same size
    # whatever the gradient's, so the RL learning rate alone sets how far a step moves.
    optimizer = Muon(param_groups(model.named_parameters(), lr=args.rl_lr, weight_decay=0.0),
                     adjust_lr_fn="match_rms_adamw")
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
        loss, stats, _, logits = grpo_loss(model, trajs, rl, ref=reference)
        fb = {}
        if args.feedback_coef:  # lambda = 0 leaves the RL loss exactly as it is
            fb_loss, fb = feedback.loss(model, trajs, len(trajs) * rl.max_gen_tokens, logits=logits, current=sampler)
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
