"""Train the Kimi-K2-shaped MoE (model.py) with Muon (muon.py): continued pretraining on byte-level text.

The script reads top to bottom: flags, data, model, optimizer, loop, checkpoint. With no arguments it trains
the `tiny` preset in under three minutes on a laptop CPU, on text every Python install has (this project's
sources and the standard library's, ~4.7 MB of code: nothing to download);
`--data` takes a folder of text files or a pre-tokenized uint16 .bin file (nanoGPT's format) for real runs.
The RL stage (grpo.py, feedback.py) and torchrun (mesh.py) are wired in by later issues.

    python train.py                                   # tiny preset, CPU, ~2-3 minutes
    python train.py --preset small --steps 2000 --data DIR --out out-small
    python train.py --resume                          # continue from out/ckpt.pt
"""
import argparse
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from model import PRESETS, ModelConfig, Transformer, flops_per_token, param_counts
from muon import Muon, param_groups

# -----------------------------------------------------------------------------
# Flags

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
g = parser.add_argument_group("model")
g.add_argument("--preset", default="tiny", help=f"model size, one of {list(PRESETS)}")
g = parser.add_argument_group("run")
g.add_argument("--steps", type=int, default=500, help="optimizer steps in total (a resumed run stops here too)")
g.add_argument("--batch-size", type=int, default=16, help="sequences per step")
g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (at most the preset's max_seq_len)")
g.add_argument("--lr", type=float, default=4e-3,
               help="peak learning rate for both groups: Muon uses adjust_lr_fn='match_rms_adamw' so one "
                    "AdamW-style lr serves the matrices and the embeddings/head/router/norms alike")
g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
g.add_argument("--warmup", type=int, default=30, help="linear warmup steps, then cosine decay to 10%%")
g.add_argument("--seed", type=int, default=1337, help="seeds the weights and the data order")
g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
g = parser.add_argument_group("data and output")
g.add_argument("--data", default=None,
               help="a folder of text files or a uint16 .bin token file (val.bin beside it is used for "
                    "validation if present); default: this project's and Python's standard library's sources")
g.add_argument("--out", default="out", help="folder for metrics.jsonl and ckpt.pt")
g.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
g.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
g.add_argument("--eval-every", type=int, default=200, help="steps between validation evaluations")
g.add_argument("--eval-batches", type=int, default=8, help="batches per validation evaluation")
args = parser.parse_args()


def die(msg):
    """Bad input ends the run with one line naming the problem and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


if args.preset not in PRESETS:
    die(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
cfg: ModelConfig = PRESETS[args.preset]
for flag in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_batches"):
    if getattr(args, flag) <= 0:
        die(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
if args.seq_len > cfg.max_seq_len:
    die(f"--seq-len {args.seq_len} exceeds the {args.preset} preset's context of {cfg.max_seq_len} tokens")
if args.lr <= 0:
    die(f"--lr must be positive, got {args.lr}")
if args.device == "auto":
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
if args.device == "cuda" and not torch.cuda.is_available():
    die("--device cuda but no CUDA device is available")
device = torch.device(args.device)

# -----------------------------------------------------------------------------
# Data: one long stream of token ids; the last 10% (or val.bin) is held out for validation


def load_tokens(path):
    """-> (train, val) as 1-D numpy arrays of token ids; dies with one line on missing or empty data."""
    if path is None:  # text every Python install has: this project's sources and the standard library's
        here, stdlib = Path(__file__).resolve().parent, Path(sysconfig.get_paths()["stdlib"])
        files = sorted(here.glob("*.py")) + sorted(here.glob("*.md")) + sorted(stdlib.glob("*.py"))
        return split(tokenize_files(files))
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


def get_batch(data, gen):
    """B random windows of T+1 tokens -> inputs [B, T], targets [B, T] (nanoGPT's sampler)."""
    ix = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=gen).tolist()
    xy = torch.from_numpy(np.stack([data[i:i + args.seq_len + 1] for i in ix]).astype(np.int64)).to(device)
    return xy[:, :-1], xy[:, 1:]


# -----------------------------------------------------------------------------
# Model and optimizer

with torch.device("meta"):  # count first: a preset that cannot fit gets one line, not an out-of-memory crash
    total, active = param_counts(Transformer(cfg))
need = 16 * total  # bytes: fp32 weights, gradients and up to two optimizer states (AdamW's m and v)
if device.type == "cuda":
    available = torch.cuda.mem_get_info(device)[0]
else:
    pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in getattr(os, "sysconf_names", {}) else None
    available = pages * os.sysconf("SC_PAGE_SIZE") if pages else need  # unknown (macOS, Windows): try it
if need > available:
    die(f"preset {args.preset} has {total / 1e9:.1f}B parameters: ~{need / 2**30:,.0f} GiB of weights, gradients "
        f"and optimizer state, more than the {available / 2**30:,.0f} GiB free on {device}")
torch.manual_seed(args.seed)
model = Transformer(cfg).to(device)
optimizer = Muon(param_groups(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay),
                 adjust_lr_fn="match_rms_adamw")
train_gen = torch.Generator().manual_seed(args.seed)
start_step = 0
out = Path(args.out)
ckpt_path = out / "ckpt.pt"
if args.resume:
    if not ckpt_path.exists():
        die(f"--resume: no checkpoint at {ckpt_path}")
    try:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)  # plain data, no pickled code
        if ckpt["config"] != asdict(cfg):
            die(f"--resume: {ckpt_path} holds a different model (preset {ckpt['args']['preset']!r}, "
                f"vocab {ckpt['config']['vocab_size']}) than this run ({args.preset!r}, vocab {cfg.vocab_size})")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        train_gen.set_state(ckpt["train_gen"])
        start_step = ckpt["step"]
    except SystemExit:
        raise
    except Exception as e:  # truncated file, not a torch checkpoint, missing keys, wrong shapes
        die(f"--resume: checkpoint {ckpt_path} is corrupt or unreadable ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else 'no details'})")
    if start_step >= args.steps:
        die(f"--resume: the checkpoint is already at step {start_step} >= --steps {args.steps}")
for group in optimizer.param_groups:
    group.setdefault("initial_lr", group["lr"])


def lr_factor(step):
    """Linear warmup, then cosine from 1 down to 0.1 at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def measure_matmul_peak():
    """FLOP/s of a square fp32 matmul, best of a few tries: the MFU denominator on this machine."""
    n = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = 0.0
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n ** 3 * 4 / (time.perf_counter() - t0))
    return best


@torch.no_grad()
def evaluate():
    """Mean loss over a fixed set of batches of each split (nanoGPT's estimate_loss), so evaluations at
    different steps compare. -> (train_loss, val_loss)"""
    model.eval()
    losses = []
    for data in (train_data, val_data):
        gen = torch.Generator().manual_seed(0)
        losses.append(sum(model(*get_batch(data, gen))[1].item() for _ in range(args.eval_batches)) /
                      args.eval_batches)
    model.train()
    return losses


def save_checkpoint(step):
    """Atomic: write a temporary file, then rename over the old one, so a crash never leaves half a file."""
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "config": asdict(cfg), "args": vars(args), "train_gen": train_gen.get_state()}, tmp)
    os.replace(tmp, ckpt_path)


# -----------------------------------------------------------------------------
# Training loop

out.mkdir(parents=True, exist_ok=True)
metrics_path = out / "metrics.jsonl"
kept = []  # on resume keep the records up to the checkpoint's step: steps after it are about to be redone
if args.resume and metrics_path.exists():
    kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start_step]
metrics = open(metrics_path, "w")
metrics.writelines(ln + "\n" for ln in kept)
tokens_per_step = args.batch_size * args.seq_len
flops_per_step = flops_per_token(model, args.seq_len) * tokens_per_step
peak = measure_matmul_peak()
print(f"preset {args.preset}: {total / 1e6:.2f}M parameters, {active / 1e6:.2f}M active | "
      f"{len(train_data):,} train / {len(val_data):,} val tokens | {device} | "
      f"matmul peak {peak / 1e9:.1f} GFLOP/s")
if start_step == 0:
    train_loss, val_loss = evaluate()
    print(f"step {0:5d} | train loss {train_loss:.4f} | val loss {val_loss:.4f}")
    metrics.write(json.dumps({"step": 0, "loss": train_loss, "val_loss": val_loss}) + "\n")
else:
    print(f"resumed from {ckpt_path} at step {start_step}")

model.train()
t_log, n_log = time.perf_counter(), 0
for step in range(start_step + 1, args.steps + 1):
    t0 = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lr_factor(step - 1)
    x, y = get_batch(train_data, train_gen)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    balance = model.update_router_bias()  # max/mean expert load of this step, then nudge the biases
    loss = loss.item()  # syncs the device, so the timing below is real
    if not math.isfinite(loss):
        die(f"loss became {loss} at step {step}; lower --lr (now {args.lr})")
    dt = time.perf_counter() - t0
    record = {"step": step, "loss": loss, "lr": optimizer.param_groups[0]["lr"], "ms": 1000 * dt,
              "balance": balance}
    n_log += 1
    if step % args.log_every == 0 or step == args.steps:
        elapsed = (time.perf_counter() - t_log) / n_log
        print(f"step {step:5d} | loss {loss:.4f} | {1000 * elapsed:6.1f} ms/step | "
              f"{tokens_per_step / elapsed:8.0f} tok/s | MFU {100 * flops_per_step / elapsed / peak:5.1f}% | "
              f"load max/mean {balance:.2f}")
        t_log, n_log = time.perf_counter(), 0
    if step % args.eval_every == 0 or step == args.steps:
        record["train_loss_eval"], record["val_loss"] = evaluate()
        print(f"step {step:5d} | train loss {record['train_loss_eval']:.4f} | val loss {record['val_loss']:.4f}")
        save_checkpoint(step)
        t_log = time.perf_counter()  # evaluation and saving are not training time
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
metrics.close()
print(f"done: {args.steps} steps, checkpoint {ckpt_path}, metrics {metrics_path}")
