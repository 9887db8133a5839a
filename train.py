r"""Train the Kimi-K2-shaped MoE (model.py) with Muon (muon.py): continued pretraining, then RL, from one CPU
process to torchrun on many nodes.

main() reads as the recipe: the flags, the run (processes and meshes, the run folder, data, model and
optimizer), pretrain(), then rl(); the machinery follows in the order main() needs it, the run folder (lock,
resume, checkpoints, metrics, signals) as one object, then the data, the checks and the flags.

With no arguments it trains the `tiny` preset on a laptop CPU as a coding agent: pretraining on generated
transcripts of coding episodes on micro-repositories (tasks.py: nothing to download, nothing read from files,
so the same seed trains the same model whatever else the checkout holds), then Dr. GRPO with textual feedback
(grpo.py, feedback.py) on feature-deletion tasks that `make` builds from fresh micro-repositories while it
trains, each episode (tasks.CodeEnv) rewarded by verify: the task's tests and the hidden oracle. `--rl-tasks
tools` trains on tool-use tasks instead (no sandbox; about three minutes).

For real runs `--data` takes a folder of llm.c-style token shards (memory-mapped; the read position is
checkpointed), a raw uint16 .bin file (nanoGPT's) or a folder of text. Under torchrun the same code shards
dense weights with FSDP2/HSDP on the dense mesh and expert weights on the expert mesh (mesh.py), with expert
parallelism (--ep) and context parallelism (--cp; in RL the cp ranks act as data-parallel ones) folded onto
the same ranks; in the RL stage each rank samples its own rollouts, or with --rollout-ranks K the last K ranks
only sample, up to --max-staleness policy versions ahead of the ranks that train (asynchronous RL). On CUDA it
computes in bf16 (FSDP2's mixed precision, fp32 weights and reductions).

Checkpoints are checksummed and written atomically; --resume continues from any of them (or falls back past a
damaged one), and Ctrl-C or SIGTERM saves the current step and prints the command that resumes. --init-from
starts from a released checkpoint in the Hugging Face layout (DeepSeek-V3, Kimi K2/K2.5, Moonlight; each rank
reads only its shards) and --save-hf writes the trained model back in that layout.

    python train.py                                      # tiny preset, CPU: pretraining, then RL as a coding
                                                         # agent on feature-deletion tasks
    python train.py --stage pretrain --out pre           # pretraining only; then RL from its checkpoint:
    python train.py --stage rl --resume --out pre
    python train.py --rl-tasks tools                     # RL on tool-use tasks instead
    torchrun --nproc_per_node=4 train.py --cp 2 --ep 4   # FSDP x CP=2, EP=4 (gloo on CPU)
    torchrun --nproc_per_node=8 train.py --dp-replicate 2 --ep 4
    torchrun --nproc_per_node=4 train.py --stage rl --resume --rollout-ranks 1 --max-staleness 1  # async RL
    python train.py --resume                             # continue from the newest intact checkpoint in out/
    python train.py --plot out                           # draw out/metrics.jsonl into out/plot.png
    python train.py --init-from DIR --data SHARDS --save-hf OUT  # continued pretraining of a released model
    python train.py --preset kimi-k2 --dry-run --world 512 --ep 64 --stage pretrain --seq-len 4096 \
        --batch-size 512                                 # plan the 1T model on 512 GPUs
"""

import argparse
import ast
import atexit
import contextlib
import difflib
import errno
import faulthandler
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from harness.sandbox import sandbox_problem
from mesh import (CommCounter, LayoutError, build_meshes, expert_shard_dim, init_distributed, make_layout,
                  parallelize)
import tasks
from feedback import RULES, Feedback, FeedbackConfig
from grpo import (SUMMARY_REQUEST, Bridge, GRPOConfig, PeerLost, Weights, grpo_loss, logprobs, minibatches,
                  pack_policy, rollout, serve_rollouts)
from model import (BYTES, PRESETS, VOCAB_SIZE, CheckpointError, ContextParallel, HFTokenizer,
                   ModelConfig, TOKENIZER_FILES, TokenizerError, Transformer, encode, flops_per_token,
                   hf_config, load_hf, memory_plan, param_counts, save_hf)
from muon import Muon, param_groups

# what runs on this machine keep between them: the corpus's tokens, the measured peak, the held-out coding
# tasks (held_out_folder)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "composer-stack"
# --rl-tasks code: an assistant message holds an edit of a few lines; a segment holds the opening, a file's
# lines and the edits (past the budget, a summary); a reply is cut to what that context holds; a task made
# serves CODE_USES steps, a group each (make takes about 4 s a micro-repository task on a 2-core CPU); the
# transcripts mix has CODE_SHARE coding episodes, and with --delete-share DELETE_SHARE of them the deletion
# role's (the task-maker's).
CODE_MESSAGE, CODE_BUDGET, CODE_REPLY, CODE_USES, CODE_SHARE, DELETE_SHARE = 64, 480, 200, 4, 0.9, 0.25
# Other weights the RL stage keeps for the policy (grpo.Weights: this rank's shards only), and the flag that
# asks for each: the KL reference (the policy RL started from) and a frozen or EMA feedback teacher
RL_COPIES = {"reference": "--kl-coef > 0", "teacher": "--feedback-teacher frozen or ema"}


def main(argv=None):
    """The recipe: continued pretraining, then RL on coding (or tool-use) tasks with textual feedback."""
    faulthandler.enable()  # a crash in native code (a segfault) prints every thread's Python stack first
    started = time.time()  # metrics' "elapsed" and the progress lines count from here

    # 1. The flags, each checked before any process group exists: every rank sees the same flags, so a bad
    # layout stops all ranks with the same line instead of leaving some waiting forever.
    args = parse_flags(argv)
    if args.plot:  # draws runs' metrics and exits: no model, no data, no process group
        return plot_command(args)
    job = check(args)  # -> the model config, the layout, the tokenizer RL speaks
    if args.dry_run:  # the memory plan of a rank, from shapes alone: nothing is allocated
        return dry_run(job)

    # 2. The processes: with --rollout-ranks K the last K only sample rollouts for the others
    rank, _, world_size, device, bridge = init_distributed(None if args.device == "auto" else args.device,
                                                           args.rollout_ranks)
    bridge = Bridge(bridge, job.trainers) if bridge is not None else None
    work = RLTasks(job, rank, world_size)  # RL's tasks, shared by trainer and rollout ranks
    if bridge is not None and launch_rank() >= job.trainers:
        return rollout_rank(job, work, rank, world_size, device, bridge)

    # 3. The run: the layout's meshes, the run folder (lock, the checkpoint to resume), data, then the model
    # sharded over the meshes (FSDP2, EP, CP) and its optimizer (Muon), loaded from the checkpoint
    t = Trainer(job, work, rank, world_size, device, bridge)
    t.run = Run(t, started)
    if job.code and args.stage != "pretrain" and args.rl_eval_tasks and not args.task_dir:
        work.make_held_out()  # the evaluations' coding tasks, before pretraining
    t.data = Data(t)
    build_model(t)
    t.run.begin(t)  # the metrics' start record, the signal handlers, the banner line

    # 4. Continued pretraining: next-token loss on the transcripts (or --data)
    step = pretrain(t) if args.stage != "rl" and not t.run.rl_resumed else t.run.start_step

    # 5. RL: Dr. GRPO + lambda x the feedback KL, on groups of rollouts
    if args.stage != "pretrain":
        rl(t, step)
    finish(t)


# -----------------------------------------------------------------------------
# Pretraining loop


def pretrain(t):
    """Pretraining from the run's start step to --steps: a step is --grad-accum micro-batches, one optimizer
    step, QK-Clip and the router bias; evaluations and checkpoints every --eval-every. -> the last step"""
    args, model, optimizer, run = t.args, t.model, t.optimizer, t.run
    start_step = run.start_step
    # on the transcripts (this project's bytes), the copy probe beside each evaluation
    probe = (lambda: copy_probe(model, t.job.code, t.device)) if not args.data and t.layout.cp == 1 else dict
    said = lambda r: "".join(f" | {k.replace('_', ' ')} {r[k]:.3f}" for k in ("copy_digits", "copy_rest")
                             if k in r)
    if not run.resume_path:
        train_loss, val_loss = evaluate(t)
        record = {"step": 0, "loss": train_loss, "val_loss": val_loss, **probe()}
        print0(f"step {0:5d} | train loss {train_loss:.4f} | val loss {val_loss:.4f}" + said(record))
        run.log(record)
    tokens_per_step = args.batch_size * args.seq_len
    flops_per_step = flops_per_token(model, args.seq_len) * tokens_per_step
    t_log, n_log, t_opt_sum = time.perf_counter(), 0, 0.0
    t_loop = t_log  # time left: the mean step so far (evaluations and checkpoints included) x the steps to go
    step = start_step
    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(args, step - 1)
        windows, loss = t.data.train_windows.next(args.batch_size), 0.0
        comm = CommCounter() if args.count_comm and step == start_step + 2 else contextlib.nullcontext()
        with comm:
            # gradients add up; FSDP reduce-scatters after the last micro-batch
            for k in range(args.grad_accum):
                x, y, pos = t.data.batch(t.data.train_shards, windows[k * t.micro:(k + 1) * t.micro])
                if t.world_size > 1:
                    last = k == args.grad_accum - 1
                    model.set_requires_gradient_sync(args.reduce_every_micro_batch or last)
                with t.amp:
                    _, micro_loss = model(x, y, pos=pos)  # mean over these tokens; FSDP averages over ranks
                (micro_loss / args.grad_accum).backward()  # equal token counts: the mean over the whole batch
                loss += micro_loss.detach() / args.grad_accum
            grad_norm = clip_grad_norm(t, args.grad_clip)  # .item() inside: the backward has finished
            t_opt = time.perf_counter()
            optimizer.step()
            if t.device.type == "cuda":
                torch.cuda.synchronize()
            t_opt = time.perf_counter() - t_opt
            optimizer.zero_grad(set_to_none=True)
            # QK-Clip -> (largest logit, heads clipped); router loads summed over ranks, every bias nudged
            # alike
            qk = model.qk_clip(args.qk_clip, t.world_group) if args.qk_clip else None
            balance = model.update_router_bias(t.world_group)
        if isinstance(comm, CommCounter):
            kinds = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
            stats = [mean_over_ranks(t, float(d.get(k, 0))) for d in (comm.bytes, comm.calls) for k in kinds]
            print0(f"step {step:5d} | communication a rank, mean over ranks: " + ", ".join(
                f"{k} {b / 2**20:.2f} MiB in {c:.0f} calls" for k, b, c in zip(kinds, stats[:4], stats[4:])))
        # .item() syncs, so the timing is real
        loss, stopping = sum_over_ranks(t, [loss.item(), run.stop_signal is not None])
        loss /= t.world_size
        if not math.isfinite(loss):
            die(f"loss became {loss} at step {step}; lower --lr (now {args.lr})")
        dt = time.perf_counter() - t0
        record = {"step": step, "loss": loss, "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                  "ms": 1000 * dt, "optimizer_ms": 1000 * t_opt, "balance": balance,
                  "data_pos": t.data.train_windows.pos,
                  **({"max_logit": qk[0], "clipped_heads": qk[1]} if qk else {})}
        n_log, t_opt_sum = n_log + 1, t_opt_sum + t_opt
        if step % args.log_every == 0 or step == args.steps:
            elapsed = (time.perf_counter() - t_log) / n_log
            left = (time.perf_counter() - t_loop) / (step - start_step) * (args.steps - step)
            print0(f"step {step:5d}/{args.steps} | loss {loss:.4f} | {1000 * elapsed:6.1f} ms/step | "
                   f"{tokens_per_step / elapsed / t.world_size:8.0f} tok/s a rank | "
                   f"MFU {100 * flops_per_step / elapsed / (t.peak * t.world_size):5.1f}% | optimizer "
                   f"{1000 * t_opt_sum / n_log:.1f} ms | peak mem {peak_memory(t.device) / 2**30:.2f} GiB | "
                   f"expert balance max/mean {balance:.2f} | {clock(time.time() - run.started)} elapsed, "
                   f"{clock(left)} left" + (" of pretraining" if args.stage == "both" else ""))
            t_log, n_log, t_opt_sum = time.perf_counter(), 0, 0.0
        saving = step % args.eval_every == 0 or step == args.steps
        if saving:
            record["train_loss_eval"], record["val_loss"] = evaluate(t)
            record.update(probe())
            print0(f"step {step:5d} | train loss {record['train_loss_eval']:.4f} | "
                   f"val loss {record['val_loss']:.4f}" + said(record))
        # logged before its checkpoint appears: a resumed run never lacks its checkpoint step's record
        run.log(record)
        if saving:
            run.save(t, step, stage="pretrain")
            t_log = time.perf_counter()  # evaluation and saving are not training time
        if stopping:
            run.stop_here(t, step, saving, stage="pretrain")
    return step


# -----------------------------------------------------------------------------
# RL: groups of rollouts on coding (or tool-use) tasks at the difficulty sampler's level; Dr. GRPO + lambda x
# the feedback KL.
# No trainer rank holds a whole copy of the policy: each samples its own groups with the sharded model itself,
# FSDP gathering one unit at a time and EP exchanging tokens, all ranks in step until the longest rollout ends
# (grpo.Lockstep); or, with --rollout-ranks, the rollout ranks sample with whole copies, up to --max-staleness
# policy versions behind (grpo.serve_rollouts), and the trainers receive the batches. The KL reference and a
# frozen or EMA teacher are other values of this rank's shards (grpo.Weights), loaded into the model for their
# no-grad passes. The one forward and backward a step run on the sharded model; each rank normalises by its
# own trajectories x max_gen_tokens, the same constant everywhere, and FSDP's mean over ranks makes it the
# global one. Under CP the ranks of a CP group train on the union of their groups, each running its chunk of
# every sequence (model.ContextParallel). Every random draw of a step is seeded from (seed, RL step, rank),
# like the data order, so a resumed run draws what the uninterrupted one would have.


def rl(t, step):
    """The RL stage, from the run's RL step (0, or a resumed RL checkpoint's) to --rl-steps; step: the
    optimizer steps before it."""
    args, model, run, work, layout, cfg = t.args, t.model, t.run, t.work, t.layout, t.work.cfg
    rl_start = run.meta["rl_step"] if run.rl_resumed else 0
    t.steps_before_rl = step - rl_start  # the optimizer steps before RL: rl_step + this is the step number
    dense_mesh = t.meshes[0]
    trainer = ContextParallel(model, dense_mesh["cp"].get_group()) if layout.cp > 1 else model
    t.cp_group = trainer.group if layout.cp > 1 else None
    feedback = Feedback(model, FeedbackConfig(coef=args.feedback_coef, estimator=args.feedback_estimator,
                                              teacher=args.feedback_teacher,
                                              ema_decay=args.feedback_ema_decay,
                                              temperature=args.temperature),
                        rules=[rule for rule in RULES if rule[0] in args.feedback_rules.split(",")],
                        tokenizer=cfg.tokenizer)
    copies = t.copies
    for name in t.job.wanted_copies - set(copies):  # the policy RL starts from (a resumed run loaded them)
        copies[name] = Weights(model)
    feedback.teacher = copies.get("teacher")  # None: the current policy
    # A fresh optimizer: the pretraining momentum points nowhere useful for RL. Muon's update has the same
    # size whatever the gradient's, so the RL learning rate alone sets how far a step moves.
    if not run.rl_resumed:
        t.optimizer = make_optimizer(t, args.rl_lr, 0.0)
    for group in t.optimizer.param_groups:
        group["lr"] = args.rl_lr
    if run.rl_resumed:
        work.difficulty.load_state_dict(run.meta["difficulty"])
        if t.bridge is None:
            work.restore(run.meta, [t.rank])
    groups = args.tasks_per_step // t.world_size  # this rank's share of the step's tasks
    print0(f"RL: {args.rl_steps} steps x {args.tasks_per_step} tasks x {args.group_size} rollouts "
           f"({groups} a rank), lr {args.rl_lr}, feedback lambda {args.feedback_coef}, "
           f"KL coef {args.kl_coef}" +
           (f" | CP {layout.cp}: the CP ranks train on their {groups * layout.cp} groups together, each "
            "sequence split over them" if layout.cp > 1 else ""))
    # the rollout ranks start from here: where RL starts and ends, the policy RL starts from
    if t.bridge is not None:
        publish(t, rl_start, start=rl_start, steps=args.rl_steps, difficulty=work.difficulty.state_dict(),
                code_pools=run.meta.get("code_pools", {}) if run.rl_resumed else {})
    if rl_start == 0:  # (while the rollout ranks sample the first step, or this rank's pool makes its tasks)
        if t.job.code and t.bridge is None and not args.task_dir:
            work.code_pool(t.rank).ask(work.difficulty.level, range(groups))
        rl_eval(t, 0)
    for rl_step in range(rl_start + 1, args.rl_steps + 1):
        t0 = time.perf_counter()
        if t.bridge is None:
            level, envs, gen = work.episodes(rl_step, t.rank)
            trajs, lag = sample(t, envs, gen), {"staleness": 0}
            batch = work.sampled(t.rank) if t.job.code else None  # its deletions made into tasks
            lag["sample_ms"] = 1000 * (time.perf_counter() - t0)  # tasks, rollouts and their rewards
        else:  # sampled by a rollout rank, with the policy of step max(rl_start, rl_step - 1 - S)
            batch = receive(t, rl_step)
            level, trajs = batch["level"], batch["trajs"]
            envs = [tr.env for tr in trajs]
            lag = {"staleness": rl_step - 1 - batch["version"],
                   "trainer_wait_ms": 1000 * (time.perf_counter() - t0),
                   "sample_ms": 1000 * batch["sample_s"], "rollout_wait_ms": 1000 * batch["wait_s"]}
        # under CP each trained trajectory is on layout.cp ranks: sums below divide by it
        train = cp_union(t, trajs)
        parts, updates, grad_norms = update(t, trainer, feedback, train)  # GRPO + lambda x feedback KL
        first = [(st, fs) for epoch, st, fs in updates if epoch == 0]  # each policy token once
        stats = {"gen_tokens": sum(st["gen_tokens"] * len(p)
                                   for (st, _), p in zip(first, parts)) / len(train),
                 # the first epoch's, each minibatch's by its share of the trajectories: the batch's loss,
                 # whatever the number of minibatches
                 "loss": sum(st["loss"] * len(p) for (st, _), p in zip(first, parts)) / len(train),
                 "kl": sum(st["kl"] for st, _ in first) / len(first),  # to the reference, a policy token
                 "clip_frac": sum(st["clip_frac"] for _, st, _ in updates) / len(updates),
                 "tis_min": min(st["tis_min"] for st, _ in first),
                 "tis_max": max(st["tis_max"] for st, _ in first)}
        # feedback means weighted by their counts: the KL by all targets, each teacher/student probe by its
        # rule's targets
        weighted = [("feedback_kl", "feedback_targets")] + [
            (f"p_{who}_{name}", name) for name, _ in feedback.rules for who in ("student", "teacher")]
        fb_sums = [sum(f.get(key, 0.0) * f.get(count, 0) for _, f in first) / layout.cp
                   for key, count in weighted]
        fb_counts = [sum(f.get(count, 0) for _, f in first) / layout.cp for _, count in weighted]
        # the router bias stays as pretraining left it: an RL batch is small and padded, so its load counts
        # would mostly count padding
        for moe in model.moe_layers():
            moe.tokens_per_expert.zero_()
        feedback.update(model)
        # the last S are never used
        if t.bridge is not None and rl_step <= args.rl_steps - 1 - args.max_staleness:
            t1 = time.perf_counter()
            publish(t, rl_step)
            lag["publish_ms"] = 1000 * (time.perf_counter() - t1)
        rewards = torch.tensor([tr.reward for tr in trajs], dtype=torch.float64, device=t.device)
        if t.world_size > 1:  # every rank's rewards move the one difficulty sampler
            gathered = [torch.empty_like(rewards) for _ in range(t.world_size)]
            dist.all_gather(gathered, rewards)
            rewards = torch.cat(gathered)
        for r in rewards.tolist():
            work.difficulty.update(level, r)
        # the learning signal: a group whose rewards are all equal has zero advantage everywhere
        by_group = rewards.view(-1, args.group_size)
        signal_stats = {"groups_all_equal": (by_group == by_group[:, :1]).all(-1).double().mean().item(),
                        "reward_std_in_group": by_group.std(-1, unbiased=False).mean().item(),
                        "grad_norm": sum(grad_norms) / len(grad_norms)}
        calls, errors, capital, malformed, summaries, n_episodes, retok, rewritten = episode_stats(t, envs,
                                                                                                  trajs)
        tokens, stopping, *fb_all = sum_over_ranks(t, [stats["gen_tokens"] * len(train) / layout.cp,
                                                       run.stop_signal is not None, *fb_sums, *fb_counts])
        fb_sums, fb_counts = fb_all[:len(weighted)], fb_all[len(weighted):]
        fb_means = {key: total / count if count else None  # None: no target of that rule in this step
                    for (key, _), total, count in zip(weighted, fb_sums, fb_counts)}
        record = {"stage": "rl", "step": t.steps_before_rl + rl_step, "rl_step": rl_step, "level": level,
                  "reward": rewards.mean().item(), "tool_error_rate": errors / max(1, calls),
                  "capital_rate": capital / max(1, calls), "malformed_rate": malformed / n_episodes,
                  "summaries": summaries / n_episodes, "gen_tokens": tokens / n_episodes,
                  "retokenized": retok / n_episodes, "rewritten": rewritten / n_episodes,
                  "feedback_targets": fb_counts[0], "feedback_kl": fb_means["feedback_kl"] or 0.0,
                  **({k: v for k, v in fb_means.items() if k.startswith("p_")} if args.feedback_coef else {}),
                  "loss": mean_over_ranks(t, stats["loss"]),
                  "clip_frac": mean_over_ranks(t, stats["clip_frac"]),
                  **({"kl": mean_over_ranks(t, stats["kl"])} if args.kl_coef else {}),
                  **signal_stats, **lag,
                  "ms": 1000 * (time.perf_counter() - t0)}
        low, high = sum_over_ranks(t, [-stats["tis_min"], stats["tis_max"]], op="max")
        record.update(tis_min=-low, tis_max=high)  # the spread of trainer / sampler over all ranks
        if t.job.code:
            record.update(code_record(t, envs, n_episodes, calls, rl_step, batch))
        run.log(record)
        code = t.job.code
        print0(f"rl step {rl_step:4d}/{args.rl_steps} | level {level} | reward {record['reward']:.3f} | "
               + (f"delete {record['reward_delete']:.3f} on {record['episodes_delete']:g} episodes, "
                  f"{record['deletions_made']} tasks made of them | " if code and args.delete_share else "") +
               f"of calls: tool not found {record['tool_error_rate']:.3f}, "
               + (f"edits unread {record['blind_edit_rate']:.3f} | hack flags {record['hack_flags']} | "
                  f"verify {record['verify_ms']:.0f} ms ({record['verify_wait_ms']:.0f} ms waited) | "
                  if code else f"'Call' {record['capital_rate']:.3f} | ") +
               f"feedback KL {record['feedback_kl']:.4f} | {record['gen_tokens']:.0f} tokens | "
               f"{record['ms']:.0f} ms")
        saving = rl_step % args.rl_eval_every == 0 or rl_step == args.rl_steps
        if saving:
            rl_eval(t, rl_step)
        rl_state = {"stage": "rl", "rl_step": rl_step, "difficulty": work.difficulty.state_dict()}
        if code and (saving or stopping):  # every data rank's task pool, from whoever sampled its step
            pools = [batch["code_pool"]]
            if t.world_size > 1:
                pools = [None] * t.world_size
                dist.all_gather_object(pools, batch["code_pool"])
            rl_state["code_pools"] = {str(r): pool for r, pool in enumerate(pools)}
        if saving:
            run.save(t, t.steps_before_rl + rl_step, **rl_state)
        if stopping:
            run.stop_here(t, t.steps_before_rl + rl_step, saving, **rl_state)


def update(t, trainer, feedback, train):
    """One RL step's policy update on its trajectories: --ppo-epochs passes over --ppo-minibatches minibatches
    of whole groups, each an optimizer step on the Dr. GRPO loss + lambda x the feedback KL.
    -> (the minibatches, [(epoch, loss stats, feedback stats)] an optimizer step, the gradient norms)"""
    args, model, optimizer, cfg, copies = t.args, t.model, t.optimizer, t.work.cfg, t.copies
    # PPO: every minibatch's log-probs under the policy that sampled it. The first minibatch's come from
    # its own first forward (no update has run before it); the others' are taken before the first update.
    parts = minibatches(train, args.ppo_minibatches, args.group_size)
    with t.amp:
        olds = [None] + [logprobs(trainer, part, cfg) for part in parts[1:]]
        if "reference" in copies:  # the reference's log-probs, its weights loaded in turn
            with copies["reference"].loaded(model):
                refs = [logprobs(trainer, part, cfg) for part in parts]
    updates, grad_norms = [], []
    targets = [None] * len(parts)  # the feedback teacher's, a minibatch
    for epoch in range(args.ppo_epochs):
        for k, part in enumerate(parts):
            with t.amp:
                # the teacher's pass before the student's forward (a teacher's weights are swapped in for
                # it); a frozen or EMA teacher does not move within a step, so its pass runs once
                if args.feedback_coef and (epoch == 0 or feedback.teacher is None):
                    targets[k] = feedback.targets(trainer, part)
                ref = refs[k] if "reference" in copies else None
                loss, stats, olds[k], logits = grpo_loss(trainer, part, cfg, old_logp=olds[k],
                                                         ref_logp=ref)
                fb_stats = {}
                if args.feedback_coef:  # lambda = 0 leaves the RL loss exactly as it is
                    fb_loss, fb_stats = feedback.loss(trainer, part, len(part) * cfg.max_gen_tokens,
                                                      logits=logits, targets=targets[k])
                    loss = loss + args.feedback_coef * fb_loss
            stats = {**stats, "loss": loss.item()}
            loss.backward()
            grad_norms.append(clip_grad_norm(t, args.grad_clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.qk_clip:
                model.qk_clip(args.qk_clip, t.world_group)
            updates.append((epoch, stats, fb_stats))
    return parts, updates, grad_norms


def finish(t):
    """--save-hf, the last lines (the verdict on the RL stage), the process group closed."""
    args, run = t.args, t.run
    if args.save_hf:  # every rank: each sharded tensor is gathered whole, rank 0 writes
        try:
            save_hf(t.model, args.save_hf, torch.bfloat16 if args.save_hf_dtype == "bf16" else torch.float32,
                    t.job.hf_base, extra_files=[Path(args.init_from, f) for f in TOKENIZER_FILES
                                                if args.init_from and Path(args.init_from, f).is_file()])
        except CheckpointError as e:
            die(f"--save-hf: {e} (the run's own checkpoint {run.checkpoints()[-1]} is complete)")
        print0(f"wrote {args.save_hf}: a Hugging Face DeepSeek-V3 checkpoint ({args.save_hf_dtype})")
    print0(f"done: checkpoint {run.checkpoints()[-1]}, metrics {run.metrics_path}, "
           f"peak memory {peak_memory(t.device) / 2**30:.2f} GiB (rank 0), {clock(time.time() - run.started)} "
           "in all")
    if len(t.evals) > 1:  # the last line says whether the run did what it should
        print0(verdict(t.evals, t.job.code))
    if t.bridge is not None:
        try:
            t.bridge.flush()
        except PeerLost as e:
            peer_lost(e, t.rank)
    if t.world_size > 1 or t.bridge is not None:
        dist.barrier()
        dist.destroy_process_group()


def sample(t, envs, gen):
    """Rollouts with the sharded model itself, every rank in step (grpo.Lockstep). FSDP gathers each unit at
    its first forward and keeps it until the rollouts end, so decoding gathers nothing per token: a rank
    holds the dense weights whole and its EP share of the experts while sampling, and EP exchanges tokens at
    every step. Each rank decodes its own episodes whole, so attention gathers nothing over CP."""
    model = t.model
    cp_groups = [block.attn.cp_group for block in model.layers]
    for block in model.layers:
        block.attn.cp_group = None
    if t.world_size > 1 and t.args.sample_gather == "rollout":
        model.set_reshard_after_forward(False)
    try:
        return rollout(model, envs, t.work.cfg, gen, sharded=t.world_size > 1)
    finally:
        for block, group in zip(model.layers, cp_groups):
            block.attn.cp_group = group
        if t.world_size > 1:
            model.set_reshard_after_forward(True)
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()


def publish(t, version, **hello):
    """The policy to the rollout ranks: every trainer rank gathers its shards into whole tensors
    (pack_policy; only rank 0 keeps them), rank 0 sends them, after hello (where RL starts and ends, the
    difficulty state) the first time. The previous version's sends complete first, so at most two copies are
    in flight."""
    flat = pack_policy(t.model, version, keep=t.rank == 0)
    try:
        if t.rank == 0:
            t.bridge.flush()
            for dst in range(t.job.trainers, t.job.trainers + t.args.rollout_ranks):
                if hello:
                    t.bridge.send_object(hello, dst)
                t.bridge.send(flat, dst, Bridge.WEIGHTS)
    except PeerLost as e:
        peer_lost(e, t.rank)


def receive(t, rl_step):
    """This rank's batch of rl_step, from the rollout rank that serves it. A rollout rank that stopped, or a
    batch past the staleness bound, ends the run with one line."""
    try:
        batch = t.bridge.recv_object(t.job.trainers + t.rank % t.args.rollout_ranks)
    except PeerLost as e:
        peer_lost(e, t.rank)
    if batch is not None and (batch["step"] != rl_step
                              or rl_step - 1 - batch["version"] > t.args.max_staleness):
        peer_lost(f"refused the batch of RL step {batch['step']} sampled with the policy of step "
                  f"{batch['version']}: step {rl_step} may use steps "
                  f"{rl_step - 1 - t.args.max_staleness} and after", t.rank)
    return batch


def cp_union(t, trajs):
    """This rank's trajectories -> those of its CP group, in CP-rank order (whole groups):
    what it trains on."""
    if t.layout.cp == 1:
        return trajs
    everyone = [None] * t.layout.cp
    dist.all_gather_object(everyone, [replace(tr, env=None) for tr in trajs], group=t.cp_group)
    return [tr for part in everyone for tr in part]


def episode_stats(t, envs, trajs):
    """What a batch of episodes did, summed over the ranks: calls, absent-tool calls, "Call" calls,
    malformed messages, summaries (segments past the first but those a template's rewrite started),
    episodes, the tokens where the turns built one by one differ from the whole conversation rendered and
    encoded at once, and the segments started because the chat template rewrote what the policy had seen
    (grpo.rollout)."""
    return sum_over_ranks(t, [sum(e.tool_calls for e in envs), sum(e.tool_errors for e in envs),
                              sum(e.capital for e in envs), sum(e.malformed for e in envs),
                              sum(len(tr.segments) - 1 - tr.rewritten for tr in trajs), len(envs),
                              sum(tr.retokenized for tr in trajs), sum(tr.rewritten for tr in trajs)])


# The planted habits of the coding transcripts (tasks.Habits) as the records name them: edits of unread files
# (a share of calls), submits untested, before every function is written, or after a failing test run (shares
# of episodes)
HABITS = {"blind": "blind_edit_rate", "untested": "untested_rate", "give_up": "give_up_rate",
          "no_fix": "no_fix_rate"}


def code_stats(t, envs, n_episodes, calls):
    """Coding episodes' figures, over the ranks: the habits' rates (HABITS), trajectories the monitor flagged,
    test runs and submits an episode."""
    counts = [tasks.episode_habits(e.turns, len(e.task.get("deleted") or e.task["feature"])) for e in envs]
    sums = sum_over_ranks(t, [sum(c[h] for c in counts) for h in HABITS] + [
        sum(bool(e.flags) for e in envs), sum(e.tests for e in envs), sum(c["submitted"] for c in counts)])
    return {**{rate: total / max(1, calls if habit == "blind" else n_episodes)
               for (habit, rate), total in zip(HABITS.items(), sums)},
            "hack_flags": sums[-3], "tests": sums[-2] / n_episodes, "submit_rate": sums[-1] / n_episodes}


def role_stats(t, envs):
    """The two roles of a step, over the ranks: each one's reward (deleting a feature, re-implementing one),
    and the share of re-implementations of tasks the policy made that fail (how hard its tasks are)."""
    roles = [[e for e in envs if isinstance(e, tasks.DeleteEnv) == delete] for delete in (True, False)]
    made = [e for e in roles[1] if e.dir.parent.name == "made"]
    delete, n_delete, redo, n_redo, fails, n_made = sum_over_ranks(t, [
        sum(e.reward() for e in roles[0]), len(roles[0]), sum(e.reward() for e in roles[1]), len(roles[1]),
        sum(1 - e.reward() for e in made), len(made)])
    return {"reward_delete": delete / max(1, n_delete), "episodes_delete": n_delete,
            "reward_reimplement": redo / max(1, n_redo), "made_task_fail_rate": fails / max(1, n_made),
            "made_task_episodes": n_made}


def code_record(t, envs, n_episodes, calls, rl_step, batch):
    """An RL step's coding figures: code_stats (each flagged trajectory written with its steps to
    flagged.jsonl); from the rank that sampled (RLTasks.sampled; with --rollout-ranks, the batch brings the
    rollout rank's) the verification time (all of it, and what the sampler waited) and the tasks its pool
    has made."""
    for e in envs:
        if e.flags:
            print(f"rank {t.rank}: RL step {rl_step}, task {e.dir.name}: flagged {e.flags}", flush=True)
            with open(Path(t.args.out) / f"flagged-rank{t.rank}.jsonl", "a") as f:
                f.write(json.dumps({"rl_step": rl_step, "task": str(e.dir), "flags": e.flags,
                                    "steps": e.steps}) + "\n")
    return {**code_stats(t, envs, n_episodes, calls), **role_stats(t, envs),
            **verify_figures(t, "", batch["verified"]), "tasks_made": batch["tasks_made"],
            "deletions_made": batch["deletions_made"]}


def verify_figures(t, prefix, now):
    """A verifier's figures since the last call with the same prefix ("": training's, "eval_": the
    evaluation's), from its stats() so far: the time verifying and the time the sampler waited on it (ms),
    the verifies run and those shared."""
    spent = {k: now[k] - t.verified.get(prefix + k, 0) for k in now}
    t.verified.update((prefix + k, v) for k, v in now.items())
    return {f"{prefix}verify_ms": 1000 * spent["verify_s"],
            f"{prefix}verify_wait_ms": 1000 * spent["verify_wait_s"],
            f"{prefix}verifies": spent["verifies"], f"{prefix}verifies_shared": spent["verifies_shared"]}


@torch.no_grad()
def rl_eval(t, rl_step):
    """Pass rate, the targeted rates (absent-tool calls and "Call" calls, per call) and summaries on the same
    held-out tasks every time (levels 1 and 2, sampling seeded alike), so evaluations differ only by the
    policy; the tasks are split over the ranks. With --task-dir they are tasks training uses: the record and
    the lines say "train-task" (eval_split). Coding tasks are verified by a verifier of their own, whose
    figures (this rank's) the record holds as eval_verify_ms etc., training's counting training alone."""
    per_level, code, work, split = t.args.rl_eval_tasks, t.job.code, t.work, t.work.eval_split
    if not per_level:  # --rl-eval-tasks 0: no held-out evaluation
        return
    k = t.args.rl_eval_samples  # episodes a task
    print0(f"rl eval after {rl_step:3d} steps | sampling {2 * per_level * k} {split} episodes ...", end="\r")
    rng, gen_eval = random.Random(10**6), torch.Generator().manual_seed(10**6 + t.rank)
    if code:
        mine = [x for x in work.held_out_code() for _ in range(k)]
        envs = [work.code_env(d, work.eval_verifier) for _, d in mine]
    else:
        held_out = [(lvl, work.make_task(rng, lvl)) for lvl in (1, 2) for _ in range(per_level)]
        mine = [x for x in held_out for _ in range(k)][t.rank::t.world_size]
        envs = [work.make_env(task) for _, task in mine]
    trajs = sample(t, envs, gen_eval)
    with open(Path(t.args.out) / f"samples-rank{t.rank}.jsonl", "a") as f:  # what the policy did, to read
        for tr, (lvl, _) in zip(trajs, mine):
            f.write(json.dumps({"rl_step": rl_step, "level": lvl, "reward": tr.reward,
                                "turns": tr.turns}) + "\n")
    passed = sum_over_ranks(t, [sum(tr.reward for tr, (lvl, _) in zip(trajs, mine) if lvl == lv)
                                for lv in (1, 2)] + [sum(lvl == lv for lvl, _ in mine) for lv in (1, 2)])
    calls, errors, capital, _, summaries, episodes, *_ = episode_stats(t, envs, trajs)
    record = {"stage": "rl_eval", "step": t.steps_before_rl + rl_step, "rl_step": rl_step,
              "eval_split": split, "pass_level1": passed[0] / max(1, passed[2]),
              "pass_level2": passed[1] / max(1, passed[3]), "episodes_level1": passed[2],
              "episodes_level2": passed[3], "tool_error_rate": errors / max(1, calls),
              "capital_rate": capital / max(1, calls), "calls": calls, "summaries": summaries / episodes}
    if code:
        record.update(**code_stats(t, envs, episodes, calls))
        if t.args.delete_share:  # the other role on the same tasks: delete each one's feature (half as many)
            denvs = work.held_out_deletions(max(1, k // 2))
            dtrajs = sample(t, denvs, torch.Generator().manual_seed(2 * 10**6 + t.rank))
            with open(Path(t.args.out) / f"samples-rank{t.rank}.jsonl", "a") as f:
                for tr, e in zip(dtrajs, denvs):  # with the judge's reason
                    f.write(json.dumps({"rl_step": rl_step, "role": "delete", "reward": tr.reward,
                                        "why": e.result and e.result[1], "turns": tr.turns}) + "\n")
            edits, misplaced = (sum(c) for c in zip((0, 0), *(tasks.misplaced_edits(e.turns) for e in denvs)))
            done, n, edits, misplaced = sum_over_ranks(t, [sum(e.reward() for e in denvs), len(denvs), edits,
                                                           misplaced])
            # the skill the role needs: its edits land on the bodies it was asked to delete, not on a position
            record.update(pass_delete=done / max(1, n), episodes_delete=n,
                          misplaced_rate=misplaced / max(1, edits))
        record.update(verify_figures(t, "eval_", work.eval_verifier.stats()))
    t.run.log(record)
    t.evals.append(record)
    print0(f"rl eval after {rl_step:3d} steps | {split} pass rate level 1 {record['pass_level1']:.3f}, "
           f"level 2 {record['pass_level2']:.3f} | of calls: tool not found {record['tool_error_rate']:.3f}, "
           f"'Call' {record['capital_rate']:.3f} | {record['summaries']:.1f} summaries an episode"
           + (f" | edits unread {record['blind_edit_rate']:.3f}; of episodes: submitted "
              f"{record['submit_rate']:.2f}, untested {record['untested_rate']:.2f}, before every function "
              f"{record['give_up_rate']:.2f}, after a failing test {record['no_fix_rate']:.2f} | hack flags "
              f"{record['hack_flags']}" if code else "")
           + (f" | deletions pass {record['pass_delete']:.3f}, edits misplaced {record['misplaced_rate']:.3f}"
              if "pass_delete" in record else ""))


# What the README promises of a run, from the first held-out evaluation to the last. Of the default run (the
# coding family): the pass rate (mean of the levels) rises by CODE_GAIN or more and by NOISE_RISE times its
# sampling noise or more, one planted habit (HABITS) falls HABIT_CUT times or more, absent tools do not rise,
# the monitor flags nothing, and the deletion role's success does not fall beyond NOISE_FALL times its noise.
# Of --rl-tasks tools and long: the pass rate falls by no more than NOISE_FALL times its sampling noise (RL
# raises it by 0 to 0.15 on the seeds measured: copying a level-2 operand caps it), feedback cuts the "Call"
# rate by more than NOISE_FALL times its noise (2.8x to 10.7x on the seeds measured), and the tool-not-found
# rate does not rise.
NOISE_FALL, NOISE_RISE, CODE_GAIN, HABIT_CUT = 2.0, 3.0, 0.15, 2.0


def coin_noise(p, n):
    """The standard deviation of a rate p measured on n coin flips."""
    return math.sqrt(p * (1 - p) / max(1, n))


def pass_rate(record):
    """An evaluation's pass rate: the mean of its levels' (those it has episodes of: a --task-dir may serve
    one level alone) -> (rate, its standard deviation from sampling alone: each level's episodes as coin
    flips at its pass rate; on fixed tasks a bound, tasks' own rates spread less)"""
    levels = [lv for lv in (1, 2) if record[f"episodes_level{lv}"]]
    return (sum(record[f"pass_level{lv}"] for lv in levels) / len(levels),
            math.hypot(*(coin_noise(record[f"pass_level{lv}"], record[f"episodes_level{lv}"])
                         for lv in levels)) / len(levels))


def verdict(evals, code):
    """One line, in words: did RL and feedback do what the README says they do, from the first evaluation to
    the last (held-out, or with --task-dir "train-task", as the records say)? The rise is printed with its
    noise: the standard deviation two evaluations of one policy would differ by."""
    first, last = evals[0], evals[-1]
    split = last["eval_split"]
    (pass0, noise0), (pass1, noise1) = pass_rate(first), pass_rate(last)
    noise = math.hypot(noise0, noise1)
    tnf0, tnf1 = first["tool_error_rate"], last["tool_error_rate"]
    rise = f"{split} pass rate {pass0:.3f} -> {pass1:.3f} ({pass1 - pass0:+.3f}, sampling noise {noise:.3f}; "
    checks = [(pass1 - pass0 >= max(CODE_GAIN, NOISE_RISE * noise),
               f"the pass rate rose less than {CODE_GAIN} or {NOISE_RISE:g}x its noise",
               rise + f"README: +{CODE_GAIN} or more, and {NOISE_RISE:g}x the noise)") if code else
              (pass1 - pass0 >= -NOISE_FALL * noise, "the pass rate fell beyond its noise",
               rise + f"README: no fall beyond {NOISE_FALL:g}x the noise)")]
    if code:
        cut = lambda h: first[HABITS[h]] / max(last[HABITS[h]], 1e-9)
        flags = sum(r.get("hack_flags", 0) for r in evals)
        checks += [(max(map(cut, HABITS)) >= HABIT_CUT, f"no planted habit fell {HABIT_CUT:g}x",
                    "habits " + ", ".join(f"{h} {first[HABITS[h]]:.3f} -> {last[HABITS[h]]:.3f}"
                                          for h in HABITS) + f" (README: one {HABIT_CUT:g}x fewer or more)"),
                   (flags == 0, f"the monitor flagged {split} episodes",
                    f"{flags:g} {split} episodes flagged (README: 0)")]
        if "pass_delete" in last:  # the other role (--delete-share): deleting each task's feature
            d0, d1 = first["pass_delete"], last["pass_delete"]
            d_noise = math.hypot(*(coin_noise(r["pass_delete"], r["episodes_delete"]) for r in (first, last)))
            checks += [(d1 - d0 >= -NOISE_FALL * d_noise, "deletion success fell beyond its noise",
                        f"{split} deletion success {d0:.3f} -> {d1:.3f} ({d1 - d0:+.3f}, sampling noise "
                        f"{d_noise:.3f}; README: no fall beyond {NOISE_FALL:g}x the noise), its edits "
                        f"misplaced {first['misplaced_rate']:.3f} -> {last['misplaced_rate']:.3f}")]
    else:
        call0, call1 = first["capital_rate"], last["capital_rate"]
        call_noise = math.hypot(*(coin_noise(r["capital_rate"], r["calls"]) for r in (first, last)))
        checks += [(call0 - call1 > NOISE_FALL * call_noise, "'Call' did not fall beyond its noise",
                    f"'Call' rate {call0:.3f} -> {call1:.3f} ({call0 / max(call1, 1e-9):.1f}x fewer, "
                    f"sampling noise {call_noise:.3f}; README: a fall beyond {NOISE_FALL:g}x the noise)")]
    checks += [(tnf1 <= tnf0, "tool-not-found rose",
                f"tool-not-found rate {tnf0:.3f} -> {tnf1:.3f} (README: not higher)")]
    failed = [short for good, short, _ in checks if not good]
    return (f"verdict after {last['rl_step']} RL steps: " +
            ("NOT as the README expects: " + ", ".join(failed) if failed else
             "RL and feedback did what the README expects") +
            " | " + "; ".join(what for _, _, what in checks))


# -----------------------------------------------------------------------------
# RL's tasks and sampling, shared by the trainer ranks and, with --rollout-ranks, the rollout ranks


def held_out_folder(family, out):
    """Where a run makes the held-out coding tasks of a family: the folder this machine keeps them in (they
    depend on the code of tasks.py and harness/ and the interpreter alone, never on a run's seed, so a run
    makes only those no earlier one made), or the run's own where that cannot be written or lies where the
    sandbox reads."""
    key = code_key("tasks.py", "harness", extra=f"{sys.executable} {sys.version}")
    folder = CACHE / "held-out" / f"{family}-{key}"
    with contextlib.suppress(OSError, tasks.TaskError):
        folder.mkdir(parents=True, exist_ok=True)
        # (without bubblewrap no run is isolated: no folder is out of reach, the machine's as good as any)
        if os.access(folder, os.W_OK) and (sandbox_problem() or not tasks.Sandbox().sees(folder)):
            return folder
    return Path(out) / "tasks" / "held-out"


class RLTasks:
    """The task family (--rl-tasks), the sampling config, the difficulty sampler; for --rl-tasks code, a task
    pool a data-parallel rank, the held-out tasks and the verifier. rank, world_size: this process's in its
    role (trainer or rollout)."""

    def __init__(self, job, rank, world_size):
        args, self.job, self.rank, self.world_size = job.args, job, rank, world_size
        self.cfg = GRPOConfig(group_size=args.group_size, max_gen_tokens=args.max_gen_tokens,
                              kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                              sampler_bits=args.sampler_bits, temperature=args.temperature,
                              tokenizer=job.tokenizer,
                              # a coding episode: edits of a few lines, file reads, a context that holds them
                              **(dict(max_message_tokens=CODE_MESSAGE, context_budget=CODE_BUDGET)
                                 if job.code else {}))
        self.make_task, self.make_env = ((tasks.make_chain_task, tasks.ChainEnv) if args.rl_tasks == "long"
                                         else (tasks.make_tool_task, tasks.ToolEnv))
        self.difficulty = tasks.DifficultySampler(max_level=len(tasks.MICRO_LEVELS) if job.code
                                                  else tasks.MAX_DIFFICULTY)
        self.pools = {}  # --rl-tasks code: a task pool a data rank (micro-repositories, or --task-dir)
        # how the micro-repositories' tests and the policy's edits run: bubblewrap (None: each part's default
        # sandbox), or, where it is missing, unisolated (check() said so in one line)
        self.box = tasks.Sandbox(isolate=False, timeout=120) if job.code and sandbox_problem() else None
        self.verifier = tasks.Verifier(args.verify_workers) if job.code else None
        # the evaluation's apart, so that an RL step's verify figures count its training episodes alone
        self.eval_verifier = tasks.Verifier(args.verify_workers) if job.code else None
        # --task-dir has no held-out split: the evaluation draws from the tasks training uses
        self.eval_split = "train-task" if job.code and args.task_dir else "held-out"
        # the deletion role: a data rank's deletion groups of the step being sampled, (RL step, groups)
        self.deleting = {}

    def make_held_out(self):
        """Make this rank's held-out coding tasks now, two at a time, unless an earlier run on this machine
        made them (held_out_folder). (Made in the background while pretraining ran, their test runs slowed
        its steps 4x on a 2-core CPU: torch's threads wait for cores the runs hold.)"""
        t0 = time.perf_counter()
        made = self.held_out_code()
        now = self.pools["held-out"].made if "held-out" in self.pools else 0
        print0(f"held-out coding tasks: {len(made)} (this rank), {now} made now and {len(made) - now} kept "
               f"from an earlier run, in {time.perf_counter() - t0:.0f} s")

    def code_pool(self, data_rank):
        """The tasks a data-parallel rank trains on. A rank (or the rollout rank that samples for it) makes
        its own, in its own sandboxes, from micro-repositories seeded by (seed, rank); each group of a step
        draws a task of its own, and a task serves CODE_USES steps."""
        if data_rank not in self.pools:
            args = self.job.args
            self.pools[data_rank] = tasks.TaskPool(Path(args.out) / "tasks" / f"rank{data_rank}",
                                                   f"{args.seed}/{data_rank}", self.box, uses=CODE_USES,
                                                   spread=args.tasks_per_step // self.job.trainers,
                                                   source=args.task_dir, family=self.job.code)
        return self.pools[data_rank]

    def code_env(self, task_dir, verifier=None):
        return tasks.CodeEnv(task_dir, self.box, reply_limit=CODE_REPLY, verifier=verifier or self.verifier)

    def delete_env(self, task_dir, specs, verifier=None):
        """The deletion role's episode on the deletion a task made (tasks.spec_from_task, kept in specs and
        made once: aside, then moved in whole)."""
        spec = Path(specs) / Path(task_dir).name
        if not (spec / "spec.json").is_file():
            Path(specs).mkdir(parents=True, exist_ok=True)
            aside = Path(specs) / f".making-{spec.name}-{os.getpid()}"
            tasks.spec_from_task(task_dir, aside, self.box)
            with contextlib.suppress(OSError):  # already there: another rank made it first
                os.rename(aside, spec)
            shutil.rmtree(aside, ignore_errors=True)
        return tasks.DeleteEnv(spec, self.box, reply_limit=CODE_REPLY, verifier=verifier or self.verifier)

    def held_out_deletions(self, k):
        """The deletion role's evaluation: k episodes on the deletion each held-out task made."""
        specs = (self.pools["held-out"].out if "held-out" in self.pools
                 else Path(self.job.args.out) / "tasks") / "specs"
        return [self.delete_env(d, specs, self.eval_verifier)
                for _, d in self.held_out_code() for _ in range(k)]

    def sampled(self, data_rank):
        """After a data rank's step is sampled: the deletions its policy made in the step's deletion groups ->
        tasks its pool serves from the next step on (a group's first episode that scored 1:
        TaskPool.add_deletion; the task id names the step and the group, as two groups can draw one task).
        Nothing is left pending, so the pool's state is all a checkpoint needs. -> what the trainer records
        and saves of the pool"""
        rl_step, groups = self.deleting.pop(data_rank, (0, []))
        pool = self.code_pool(data_rank)
        for g, group in enumerate(groups):
            won = next((e for e in group if e.reward() == 1), None)
            if won is not None:
                pool.add_deletion(won, f"{won.dir.name}-by-{rl_step}-{g}")
        return {"verified": self.verifier.stats(), "tasks_made": pool.made, "deletions_made": pool.deletions,
                "code_pool": pool.state_dict()}

    def restore(self, state, data_ranks):
        """A resumed run's task pools of the data ranks given (a trainer's own, or those a rollout rank
        samples for), from a checkpoint's state or the hello a rollout rank gets."""
        for data_rank in data_ranks:
            if str(data_rank) in state.get("code_pools", {}):
                self.code_pool(data_rank).load_state_dict(state["code_pools"][str(data_rank)])

    def held_out_code(self):
        """This rank's held-out coding tasks, [(level, folder)], made from micro-repositories no transcript or
        training task draws from, the same whatever the world size (slots make found nothing in are left
        out); with --task-dir, that folder's first tasks of levels 1 and 2 (it has no held-out split)."""
        args = self.job.args
        mine = [(lvl, k) for lvl in (1, 2) for k in range(args.rl_eval_tasks)][self.rank::self.world_size]
        if args.task_dir:
            listed = self.code_pool(-1).listed
            return [(lvl, listed[lvl][k]) for lvl, k in mine if k < len(listed[lvl])]
        if "held-out" not in self.pools:
            self.pools["held-out"] = tasks.TaskPool(held_out_folder(self.job.code, args.out),
                                                    "held-out", self.box, held_out=True, family=self.job.code,
                                                    workers=2)
        pool = self.pools["held-out"]
        for lvl in (1, 2):
            pool.ask(lvl, [k for lv, k in mine if lv == lvl])
        return [(lvl, d) for lvl, k in mine for d in [pool.get(lvl, k)] if d is not None]

    def episodes(self, rl_step, data_rank):
        """RL step rl_step's episodes for one data-parallel rank: its groups at the difficulty sampler's
        level, and the generator that samples them. Every draw is seeded from (seed, RL step, rank), like the
        data order, so a resumed run draws what the uninterrupted one would have, and a rollout rank draws
        what the trainer rank would. -> (level, envs, gen)"""
        args = self.job.args
        level = self.difficulty.sample(random.Random(f"{args.seed}/{rl_step}"))  # the same level everywhere
        task_rng = random.Random(f"{args.seed}/{rl_step}/{data_rank}")
        gen = torch.Generator().manual_seed(task_rng.getrandbits(63))
        groups = args.tasks_per_step // self.job.trainers  # a rank's share of the step's tasks
        if self.job.code:  # a group re-implements a task or (--delete-share) makes one: deletes its feature
            pool, specs = self.code_pool(data_rank), Path(args.out) / "tasks" / f"rank{data_rank}" / "specs"
            share = args.delete_share
            deleting = [bool(share) and task_rng.random() < share for _ in range(groups)]
            envs = [[self.delete_env(d, specs) if delete else self.code_env(d)
                     for _ in range(args.group_size)]
                    for delete, d in ((delete, pool.take(level, made=not delete)) for delete in deleting)]
            self.deleting[data_rank] = (rl_step, [g for g, delete in zip(envs, deleting) if delete])
            return level, [e for g in envs for e in g], gen
        return level, [self.make_env(task)
                       for task in (self.make_task(task_rng, level) for _ in range(groups))
                       for _ in range(args.group_size)], gen


def rollout_rank(job, work, rank, world_size, device, bridge):
    """A rollout rank's whole run: it samples with a whole copy of the policy, whose values come from the
    trainers, and never trains."""
    args = job.args
    torch.manual_seed(args.seed)
    policy = Transformer(job.cfg).to(device)
    try:
        serve_rollouts(policy, bridge, work.cfg, work.episodes, work.difficulty, args.max_staleness, rank,
                       world_size, work.sampled if job.code else None, work.restore)
    except PeerLost as e:  # a trainer stopped
        peer_lost(e, rank, role="rollout")
    dist.destroy_process_group()
    sys.exit(0)


def peer_lost(why, rank, role="trainer"):
    """--rollout-ranks: a rank of the other role stopped, or broke the protocol. This rank says so in one line
    and exits by itself (a launcher may not stop it)."""
    print(f"error: {role} rank {rank}: {why}", file=sys.stderr, flush=True)
    sys.exit(1)


# -----------------------------------------------------------------------------
# The trainer's process: its place in the layout, the model and optimizer, and what the loops compute with


class Trainer:
    """What the two loops share: the flags (args) and what the checks made of them (job), this process in the
    layout (rank, device, meshes, its share of a batch), RL's tasks (work), and, as main() builds them, the
    run folder (run), the data, the model and its optimizer."""

    def __init__(self, job, work, rank, world_size, device, bridge):
        args, layout = job.args, job.layout
        self.job, self.args, self.cfg, self.layout, self.work = job, args, job.cfg, layout, work
        self.rank, self.world_size, self.device, self.bridge = rank, world_size, device, bridge
        self.bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
        self.meshes = build_meshes(layout, device.type)  # dense, expert, and the FSDP sub-meshes of each
        self.dp_rank, self.cp_rank = layout.coords(rank)
        self.micro = args.batch_size // args.grad_accum  # sequences in a micro-batch, over all ranks
        # this rank's share of a micro-batch
        self.B_local, self.T_local = self.micro // layout.dp, args.seq_len // layout.cp
        self.world_group = dist.group.WORLD if world_size > 1 else None
        self.copies = {}  # the RL stage's other weights (RL_COPIES), this rank's shards of them
        self.evals = []  # this process's RL evaluations
        self.verified = {}  # --rl-tasks code: the verifiers' figures so far (verify_figures)
        self.run = self.data = self.model = self.optimizer = self.amp = None  # main() builds them


def build_model(t):
    """The model, sharded: a preset that cannot fit gets one line, not an out-of-memory crash; each rank
    materializes just its shards (CP, EP, FSDP2), initialized from the seed or read from --init-from, and the
    optimizer; a resumed run loads both from its checkpoint."""
    args, job, device = t.args, t.job, t.device
    plan, t.checkpoint_bytes = plan_memory(job, args.grad_accum, args.reduce_every_micro_batch, t.bf16)
    need = sum(plan.values())
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        known = "SC_AVPHYS_PAGES" in getattr(os, "sysconf_names", {})  # not on macOS, Windows: try it
        pages = os.sysconf("SC_AVPHYS_PAGES") if known else None
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        available = pages * os.sysconf("SC_PAGE_SIZE") / ranks_here if pages else need
    if need > available:
        die(f"preset {args.preset} ({job.total / 1e9:.1f}B parameters) needs ~{need / 2**30:,.0f} GiB a rank "
            f"({in_gib(plan)}), more than the {available / 2**30:,.0f} GiB free on {device}; see --dry-run")
    with torch.device("meta"):  # shapes only: each rank materializes just its shards, below
        model = Transformer(t.cfg)
    for block in model.layers:
        block.checkpoint = args.activation_checkpointing
        block.attn.track_max_logit = args.qk_clip > 0
        # the block's computation, inside activation checkpointing and FSDP's hooks (as torchtitan)
        if args.compile:
            block._forward = torch.compile(block._forward)
    # one process: autocast
    t.amp = torch.autocast(device.type, torch.bfloat16, enabled=t.bf16 and t.world_size == 1)
    parallelize(model, t.layout, t.meshes, t.bf16)  # CP, EP, FSDP2
    model.to_empty(device=device)
    if args.init_from and not t.run.resume_path:  # each rank reads the blocks of its own shards
        try:
            load_hf(model, args.init_from)
            err = None
        except Exception as e:  # a file that fails on one rank stops every rank
            err = str(e) if isinstance(e, CheckpointError) else f"{args.init_from}: {last_line(e)}"
        err = agree(t.world_size, err)
        if err:
            die(f"--init-from {err}")
    else:
        model.init_weights(args.seed)  # values depend on the seed alone, not on the layout
    t.model = model
    # the RL stage steps with a Muon of its own (rl()): an RL checkpoint holds that one's state, and the
    # other weights RL keeps
    rl_resumed = t.run.rl_resumed
    t.optimizer = (make_optimizer(t, args.rl_lr, 0.0) if rl_resumed
                   else make_optimizer(t, args.lr, args.weight_decay))
    t.copies = {name: Weights(model) for name in job.wanted_copies if rl_resumed}
    t.run.load(t)


def make_optimizer(t, lr, weight_decay):
    """Muon on the matrices, AdamW on the rest (muon.param_groups); Newton-Schulz in the compute dtype
    (muon.default_ns_dtype explains why not by the CPU's flags)."""
    return Muon(param_groups(t.model.named_parameters(), lr=lr, weight_decay=weight_decay),
                adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16 if t.bf16 else torch.float32,
                ns_method=t.args.ns)


def clip_grad_norm(t, max_norm):
    """Clip by the global gradient norm over parameters that live on two meshes: a sum of squares per mesh
    (one all-reduce each, as a DTensor resolves its partial sum), then combined.
    -> the norm before clipping"""
    by_mesh = {}
    for p in t.model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    total_sq = torch.zeros((), device=t.device)
    for grads in by_mesh.values():
        sq = sum(g.float().pow(2).sum() for g in grads)
        total_sq += sq.full_tensor() if isinstance(sq, DTensor) else sq
    norm = total_sq.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for grads in by_mesh.values():
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
    return norm


def lr_factor(args, step):
    """Linear warmup, then cosine from 1 down to 0.1 at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def sum_over_ranks(t, xs, op="sum"):
    """Floats summed (or op="max": maximised) over all ranks; as they are at world size 1."""
    if t.world_size == 1:
        return [float(x) for x in xs]
    x = torch.tensor([float(x) for x in xs], dtype=torch.float64, device=t.device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return x.tolist()


def mean_over_ranks(t, x):
    """A float averaged over all ranks (each holds an equal share of tokens)."""
    return sum_over_ranks(t, [x])[0] / t.world_size


@torch.no_grad()
def evaluate(t):
    """Mean loss over a fixed set of batches of each split (nanoGPT's estimate_loss), so evaluations at
    different steps and layouts compare. -> (train_loss, val_loss)"""
    t.model.eval()
    losses = []
    for shards, windows in ((t.data.train_shards, t.data.eval_windows["train"]),
                            (t.data.val_shards, t.data.eval_windows["val"])):
        total = 0.0
        for i in range(0, len(windows), t.micro):
            x, y, pos = t.data.batch(shards, windows[i:i + t.micro])
            with t.amp:
                total += t.model(x, y, pos=pos)[1].item()
        losses.append(mean_over_ranks(t, total / (len(windows) // t.micro)))
    t.model.train()
    return losses


# The copy probe. A small model finds a token by what it is (an operation) more easily than by where it is
# (the digit a name carries: `mod3` -> `x % 3`; the operands a question carries: `compute min(7,8)` -> `call
# min(7,8)`). On gold transcripts no run trains on (held-out micro-repositories; tool tasks of another seed),
# the model's greedy next token is checked where the gold copies a digit, and, for contrast, on the rest of
# what it writes there: (share of copied digits right, share of the rest right).
PROBE_SEED = 10**7


@functools.lru_cache(maxsize=4)
def probe_positions(code, n=None):
    """Gold transcripts (code: a micro-repository family, or None: tools) as byte tokens, each with the
    positions of the digits the gold copies and of the rest of what it writes there.
    -> [(tokens, copies, rest)]"""
    rng, out = random.Random(PROBE_SEED), []
    for _ in range(n or (96 if code else 32)):  # ~100 copied digits either way (one an edit, ~4 a chain)
        if code:  # an edit: its line (from the read's reply) and its body (`    return x % 3`: digits from
            # the name in the digits family; in the words family what the name says, no copy)
            files = tasks.micro_files(rng, held_out=True, family=code)
            funcs = [f.name for f in ast.parse(files[tasks.micro_module(files)]).body]
            turns = tasks.micro_episode(files, [rng.choice(funcs)], "stub", rng)[0]
            body = re.compile(r"call replace\([^,]*,(\d+),(\d+)\)\n    return (.*)")
            copied = (1, 2, 3) if code == "digits" else (1, 2)
        else:  # the operands of every call of a level-2 tool task
            task = tasks.make_tool_task(rng, 2)
            turns, body, copied = tasks.gold_transcript(task, rng), re.compile(r"call (\w+\(.*\))"), (1,)
        text, copies, rest = "", [], []
        for role, message in turns:
            head = len(encode(text + f"<|{role}|>", specials=True))
            if role == "assistant" and (m := body.fullmatch(message)):
                for g in range(1, len(m.groups()) + 1):
                    for i in range(m.start(g), m.end(g)):
                        at = head + len(message[:i].encode())
                        (copies if g in copied and message[i].isdigit() else rest).append(at)
            text += f"<|{role}|>{message}<|end|>"
        out.append((encode(text, specials=True)[:max(copies + rest) + 1], copies, rest))  # no more is read
    return tuple(out)


@torch.no_grad()
def copy_probe(model, code, device):
    """-> {copy_digits, copy_rest}: the model's greedy next token right on copied digits, and on the rest."""
    was_training, hits, probes = model.training, [[0, 0], [0, 0]], probe_positions(code)
    model.eval()
    for i in range(0, len(probes), 32):  # right-padded batches: padding comes after every checked position
        rows = probes[i:i + 32]
        width = max(len(tokens) for tokens, _, _ in rows)
        batch = [tokens + [BYTES.pad] * (width - len(tokens)) for tokens, _, _ in rows]
        logits, _ = model(torch.tensor(batch, device=device))
        for guess, (tokens, *where) in zip(logits.argmax(-1).tolist(), rows):
            for k, positions in enumerate(where):
                hits[k][0] += sum(guess[p - 1] == tokens[p] for p in positions)
                hits[k][1] += len(positions)
    model.train(was_training)
    return {"copy_digits": hits[0][0] / max(1, hits[0][1]), "copy_rest": hits[1][0] / max(1, hits[1][1])}


PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, NVIDIA datasheets


def device_peak(device, bf16):
    """-> (FLOP/s, where it comes from), the MFU denominator: a known GPU's datasheet bf16 peak when computing
    in bf16, else the best square matmul in the compute dtype on this machine. A quick measurement swings from
    run to run (and the MFU with it), so it is made once, for a few seconds, and kept in
    ~/.cache/composer-stack under the hash of what it depends on (the CPU or GPU model, torch's version, the
    dtype, the threads); an unreadable or bad file is measured again."""
    if device.type == "cuda" and bf16:
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_BF16.items():
            if all(word in name for word in key.split()):
                return flops, f"{key} bf16 datasheet"
    dtype = torch.bfloat16 if bf16 else torch.float32
    what = [torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(), torch.__version__,
            str(dtype), torch.get_num_threads()]
    path = CACHE / f"peak-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]}.json"
    matmul = f"{str(dtype).removeprefix('torch.')} matmul"

    def cached():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            kept = json.loads(path.read_text())
            if kept["what"] == what and math.isfinite(kept["flops"]) and kept["flops"] > 0:
                return kept["flops"], f"{matmul} measured {kept['measured']}, cached in {path}"
    if found := cached():
        return found
    with first_on_machine(path):  # one process measures (the machine otherwise idle), the others wait for it
        if found := cached():
            return found
        n = 4096 if device.type == "cuda" else 512
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        reps, best, trials, start = 8 if device.type == "cuda" else 2, 0.0, 0, time.perf_counter()
        # the best of at least 2 s of trials, 3 at least (a CPU without bf16 units takes 0.3 s a bf16 matmul)
        while trials < 3 or time.perf_counter() - start < 2.0:
            trials += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
        record = {"flops": best, "what": what, "measured": time.strftime("%Y-%m-%d %H:%M")}
        keep_in_cache(path, lambda f: f.write(json.dumps(record).encode()))
        return best, f"{matmul} measured now, cached in {path}"


def cpu_model():
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def clock(seconds):
    """Seconds as mm:ss, or h:mm:ss from an hour on."""
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"


def peak_memory(device):
    """Bytes this rank has held at most: the CUDA allocator's high-water mark, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# -----------------------------------------------------------------------------
# Plots (--plot): runs' metrics.jsonl drawn into one PNG of three panels, then exit (no model, no data): the
# pretraining loss (train and validation) against the step; RL reward and the held-out pass rates against the
# RL step; the rates the feedback rules target (absent-tool calls, "Call" calls). Several runs are drawn over
# each other, a group of runs (seeds) as its mean with a band of one standard deviation.

# (panel title, x, [(stage, field, legend name, line style)]); stage None: pretraining (no "stage" field)
PANELS = [("pretraining", "step", [(None, "loss", "train loss", "-"), (None, "val_loss", "val loss", "--")]),
          ("RL: reward and held-out pass rates", "rl_step",
           [("rl", "reward", "reward", "-"), ("rl_eval", "pass_level1", "pass level 1", "--"),
            ("rl_eval", "pass_level2", "pass level 2", ":")]),
          ("RL: targeted rates (held-out, per call)", "rl_step",
           [("rl_eval", "tool_error_rate", "tool not found", "-"),
            ("rl_eval", "capital_rate", "'Call'", "--"),
            ("rl_eval", "blind_edit_rate", "edits unread", ":")]),
          ("RL: planted habits (held-out, per episode)", "rl_step",
           [("rl_eval", "give_up_rate", "submits before every function", "-"),
            ("rl_eval", "no_fix_rate", "submits after a failing test", "--"),
            ("rl_eval", "untested_rate", "submits untested", ":")])]


class PlotError(Exception):
    pass


def read_metrics(path):
    """A run's history in its metrics.jsonl, by train.py's rule: a {"event": "start", "keep": K} record keeps
    only the first K lines above it (a resumed run redoes what came after its checkpoint). A torn last line (a
    run killed mid-write, or one still writing) is left out. -> the records, events dropped"""
    lines = Path(path).read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise PlotError(f"{path}: line {i + 1} is not JSON")
        if record.get("event") == "start":
            records = records[:record["keep"]]
        records.append(record)
    return [r for r in records if "event" not in r]


def parse_runs(specs):
    """["DIR", "NAME=DIR1,DIR2", ...] -> [(label, [records of each run])]: a bare DIR is its own label,
    NAME=DIR names one run, NAME=DIR1,DIR2,... a group (seeds)."""
    runs = []
    for spec in specs:
        label, _, dirs = (spec, "", spec) if Path(spec).exists() else spec.partition("=")
        dirs = dirs or label  # no "=": a bare DIR
        group = []
        for d in dirs.split(","):
            path = Path(d) / "metrics.jsonl" if Path(d).is_dir() else Path(d)
            if not path.is_file():
                raise PlotError(f"{d}: no metrics.jsonl (a run's --out folder, or its metrics.jsonl)")
            group.append(read_metrics(path))
        runs.append((label, group))
    return runs


def curve(records, stage, field, x):
    """{x: value} of one field of one stage's records."""
    return {r[x]: r[field] for r in records
            if r.get("stage") == stage and isinstance(r.get(field), (int, float)) and x in r}


def plot_runs(specs, out=None):
    """Draw the runs (parse_runs' specs) into a PNG. -> its path: out, or plot.png in the run's folder when
    one folder is given, else in the current one"""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import numpy as np
    runs = parse_runs(specs)
    if out is None:
        single = len(specs) == 1 and "=" not in specs[0] and "," not in specs[0] and Path(specs[0]).is_dir()
        out = Path(specs[0]) / "plot.png" if single else Path("plot.png")
    # the panels some run has records for (the planted habits are the coding runs'), pretraining's always
    panels = [p for p in PANELS if p[1] == "step" or any(curve(records, stage, field, p[1])
                                                         for _, group in runs for records in group
                                                         for stage, field, _, _ in p[2])]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, x, lines) in zip(axes[0], panels):
        for i, (label, group) in enumerate(runs):
            for stage, field, name, style in lines:
                curves = [c for c in (curve(records, stage, field, x) for records in group) if c]
                if not curves:
                    continue
                xs = sorted(set.intersection(*(set(c) for c in curves)))  # steps every run of the group has
                ys = np.array([[c[s] for s in xs] for c in curves])  # [runs, steps]
                mean = ys.mean(0)
                color = colors[i % len(colors)]
                n = f" (mean of {len(curves)})" if len(curves) > 1 else ""
                ax.plot(xs, mean, style, color=color, label=f"{label}: {name}{n}",
                        marker="o" if len(xs) < 12 else None, markersize=3)
                if len(curves) > 1:
                    std = ys.std(0, ddof=1)
                    ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("RL step" if x == "rl_step" else "step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        # rates and rewards in [0, 1]: the whole range, comparable across plots
        if x == "rl_step" and ax.lines:
            low, high = ax.get_ylim()
            ax.set_ylim(min(low, -0.03), max(high, 1.03))
        if ax.lines:
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, "no records of this stage", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_command(args):
    """--plot: draw the runs and exit."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        die("--plot draws in one process: run it with python, not torchrun")
    if importlib.util.find_spec("matplotlib") is None:
        die("--plot needs matplotlib: pip install matplotlib")
    try:
        print(f"wrote {plot_runs(args.plot, args.plot_out)}")
    except PlotError as e:
        die(f"--plot {e}")


# -----------------------------------------------------------------------------
# The run folder: --out holds metrics.jsonl and the checkpoints step-NNNNNNNN/. A checkpoint is written as
# step-N.tmp by torch.distributed.checkpoint (DCP: every rank writes its shards into the one folder, which
# loads at any world size and layout; files fsynced), checksummed into its meta.json, then renamed: a step-N
# folder is always complete. Old ones are renamed to step-N.del before they are deleted, so a kill never
# leaves a half-deleted checkpoint, and leftovers of either kind are removed at start. A lock file keeps a
# second run out. The file-system work is rank 0's (or split over the ranks); every verdict is shared, so all
# ranks act alike.


class Run:
    """The run folder of one process: its lock, the checkpoint --resume continues from (meta, resume_path),
    saving and loading checkpoints, metrics.jsonl (and --tensorboard, --wandb), and the signals that stop the
    run at a step's end."""

    def __init__(self, t, started):
        self.args, self.rank, self.world_size, self.started = t.args, t.rank, t.world_size, started
        self.out = Path(t.args.out)
        self.lock = self.out / "train.lock"
        self.stop_signal, self.metrics_lines = None, 0
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process
        err = agree(self.world_size, self.take_out_folder() if is_rank0() else None)
        if err:
            die(err)
        self.meta, self.resume_path = self.find_resume(t.job.wanted_copies)
        self.rl_resumed = self.meta is not None and self.meta.get("stage") == "rl"
        self.start_step = self.meta["step"] if self.meta else 0

    def take_out_folder(self):
        """Rank 0: create --out, take its lock (or refuse), clear what killed runs left. -> error line or
        None"""
        out, lock = self.out, self.lock
        try:
            out.mkdir(parents=True, exist_ok=True)
            me = out / f".train.lock.{socket.gethostname()}.{os.getpid()}"
            me.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "started": time.ctime()}))
        except OSError as e:
            return f"--out {out} is not writable ({e.strerror or e})"
        try:
            while True:
                try:
                    os.link(me, lock)  # atomic, and the lock is complete when it appears
                    break
                except FileExistsError:
                    pass
                except OSError as e:  # a file system without hard links
                    return f"--out {out} cannot hold a lock file ({e.strerror or e})"
                try:
                    other = json.loads(lock.read_text())
                except FileNotFoundError:
                    continue  # released meanwhile
                except (OSError, ValueError):
                    other = {}
                if other.get("host") != socket.gethostname() or pid_alive(other.get("pid")):
                    return (f"--out {out} is in use by another run (pid {other.get('pid')} on host "
                            f"{other.get('host')}, started {other.get('started')}); wait for it or choose "
                            f"another --out (remove {lock} if that run is gone)")
                lock.unlink(missing_ok=True)  # its process is dead: a stale lock
                print0(f"note: took over the lock of a run that no longer runs (pid {other.get('pid')})")
        finally:
            me.unlink(missing_ok=True)
        atexit.register(self.release_lock)
        left = [p for p in out.glob("step-*") if p.suffix in (".tmp", ".del") and p.is_dir()]
        for p in left:
            shutil.rmtree(p)
        if left:
            print0(f"note: removed {len(left)} unfinished checkpoint folder(s) left by a killed run: "
                   + ", ".join(p.name for p in left))
        return None

    def release_lock(self):
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.lock.read_text())["pid"] == os.getpid():
                self.lock.unlink()

    def checkpoints(self):
        return sorted(p for p in self.out.glob("step-*")
                      if p.is_dir() and re.fullmatch(r"step-\d{8}", p.name))

    def damage(self, path):
        """-> None when the checkpoint's files match the checksums in its meta.json, else what is wrong with
        it. Each rank reads its share of the files."""
        try:
            files = read_meta(path)["files"]
            for name in sorted(files)[self.rank::self.world_size]:
                if sha256(path / name) != files[name]:
                    return f"{name} does not match its checksum"
        except FileNotFoundError as e:
            return f"{Path(e.filename).name} is missing"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"unreadable meta.json ({type(e).__name__}: {e})"
        return None

    def find_resume(self, wanted_copies):
        """--resume: the newest intact checkpoint (or the one named), checked against what the run does from
        there. -> (its meta.json, its path), or (None, None)"""
        args, out = self.args, self.out
        meta, resume_path = None, None
        if args.resume:
            named = args.resume != "latest"
            found = [Path(args.resume)] if named else self.checkpoints()[::-1]
            if named and not (found[0] / "meta.json").is_file():
                die(f"--resume {args.resume}: not a checkpoint folder (no meta.json in it)")
            if not found:
                die(f"--resume: no checkpoint in {out} (expected a step-NNNNNNNN folder); start without "
                    "--resume")
            for path in found:
                err = agree(self.world_size, self.damage(path))
                if not err:
                    meta, resume_path = read_meta(path), path
                    break
                if named or path == found[-1]:
                    die(f"--resume: checkpoint {path} is corrupt ({err})" +
                        ("" if named else "; no intact checkpoint in " + str(out)))
                print0(f"warning: checkpoint {path} is corrupt ({err}); resuming from an older one",
                       file=sys.stderr)
            if meta.get("stage") == "rl" and args.stage == "pretrain":
                die(f"--resume: {resume_path} was written by the RL stage; pretraining does not continue "
                    "from an RL checkpoint (pass --stage rl, or --resume with a pretraining checkpoint)")
            if meta.get("stage") == "rl" and meta["rl_step"] >= args.rl_steps:
                die(f"--resume: {resume_path} is already at RL step {meta['rl_step']} of --rl-steps "
                    f"{args.rl_steps}; raise --rl-steps to continue RL")
            if meta.get("stage") != "rl" and meta["step"] >= args.steps and args.stage == "pretrain":
                die(f"--resume: {resume_path} is already at step {meta['step']} of --steps {args.steps}; "
                    "raise --steps to continue pretraining, or pass --stage rl to start RL from it")
            for name, flag in RL_COPIES.items():
                if meta.get("stage") == "rl" and name in wanted_copies and name not in meta.get("copies", []):
                    die(f"--resume: {resume_path} holds no {name} (it was written without {flag}); resume "
                        "without it")
        if self.checkpoints() and (resume_path is None or resume_path.resolve().parent != out.resolve()):
            die(f"--out {out} already holds {self.checkpoints()[-1].name}, which this run would delete as it "
                "saves its own; pass --resume to continue from it, or choose another --out")
        return meta, resume_path

    @staticmethod
    def state_dicts(t):
        model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
        return {"model": model_sd, "optim": optim_sd,
                **{name: w.state_dict(t.model) for name, w in t.copies.items()}}

    def load(self, t):
        """The checkpoint --resume found, into the model, the optimizer, the RL copies and the data
        position."""
        if not self.meta:
            return
        if self.meta["config"] != asdict(t.cfg):
            die(f"--resume: {self.resume_path} holds a different model (preset "
                f"{self.meta['args']['preset']!r}, "
                f"vocab {self.meta['config']['vocab_size']}) than this run ({self.args.preset!r}, vocab "
                f"{t.cfg.vocab_size})")
        state = self.state_dicts(t)
        logging.disable(logging.ERROR)  # DCP logs tracebacks of what it cannot read; we report it in one line
        try:
            # reshards: any writer layout loads
            dcp.load(state, checkpoint_id=self.resume_path, no_dist=self.world_size == 1)
            set_state_dict(t.model, t.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        except (Exception, CheckpointException) as e:
            # its checksums passed, so this is not damage: say what it is
            die(f"--resume: checkpoint {self.resume_path} is intact but does not load into this run "
                f"({last_line(e)})")
        logging.disable(logging.NOTSET)
        t.data.train_windows.pos = self.meta["data_pos"]  # the next unseen window

    def begin(self, t):
        """metrics.jsonl and the sinks opened, the run's start recorded, the signal handlers, the disk checked
        for room, and the banner line."""
        args, out = self.args, self.out
        # metrics.jsonl is append-only: every record is flushed as it is written, and each run (fresh or
        # resumed) first writes {"event": "start", "keep": K}: of the lines above it only the first K belong
        # to the run's history (records past the resumed checkpoint are about to be redone). A reader applies
        # that rule, as read_metrics (--plot) does.
        self.metrics_path = out / "metrics.jsonl"
        if is_rank0():
            text = self.metrics_path.read_bytes() if self.metrics_path.exists() else b""
            cut = text.rfind(b"\n") + 1  # a run killed mid-write leaves its last record torn
            if cut < len(text):
                os.truncate(self.metrics_path, cut)
                print(f"warning: {self.metrics_path}: dropped a torn last line ({len(text) - cut} bytes) "
                      "written as a run was killed", file=sys.stderr, flush=True)
            self.metrics_lines = text[:cut].count(b"\n")
            self.metrics = open(self.metrics_path, "a")
        # --tensorboard, --wandb: rank 0 sends them what it writes to metrics.jsonl, and closes them at exit
        sinks = t.job.sinks
        self.tensorboard = (sinks["tensorboard"].SummaryWriter(args.tensorboard)
                            if is_rank0() and "tensorboard" in sinks else None)
        self.wandb_run = (sinks["wandb"].init(project=args.wandb, config=vars(args))
                          if is_rank0() and "wandb" in sinks else None)
        if self.tensorboard:
            atexit.register(self.tensorboard.close)
        if self.wandb_run:
            atexit.register(self.wandb_run.finish)
        same_folder = self.resume_path is not None and self.resume_path.resolve().parent == out.resolve()
        self.log({"event": "start",
                  "keep": (min(self.meta.get("metrics_lines", self.metrics_lines), self.metrics_lines)
                           if same_folder else 0),
                  "step": self.start_step,
                  "resumed_from": str(self.resume_path) if self.resume_path else None,
                  "argv": sys.argv[1:], "world_size": self.world_size})
        # SIGINT (Ctrl-C) and SIGTERM (a preempted job; torchrun passes it on) finish the current step on
        # every rank, which agree at the step's end (the flag rides on the loss's all-reduce), save it and
        # print how to resume.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        free = shutil.disk_usage(out).free if is_rank0() else 0
        err = agree(self.world_size,
                    f"--out {out} has {free / 2**20:,.0f} MiB free, less than two checkpoints need "
                    f"({2 * t.checkpoint_bytes / 2**20:,.0f} MiB: one being written while the last one is "
                    "kept)"
                    if is_rank0() and free < 2 * t.checkpoint_bytes else None)
        if err:
            die(err)
        t.peak, peak_source = device_peak(t.device, t.bf16)  # per rank
        layout, data, cfg = t.layout, t.data, t.cfg
        print0(f"preset {args.preset}: {t.job.total / 1e6:.2f}M parameters, {t.job.active / 1e6:.2f}M active "
               f"| {sum(map(len, data.train_shards)):,} train / {sum(map(len, data.val_shards)):,} val "
               f"tokens in {len(data.train_shards)} + {len(data.val_shards)} shards | {t.world_size} x "
               f"{t.device} ({torch.get_num_threads()} threads each) | dense mesh "
               f"(dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard}, cp={layout.cp}) expert "
               f"mesh (ep_replicate={layout.ep_replicate}, ep_shard={layout.ep_shard}, ep={layout.ep})" +
               (f", {cfg.num_experts // layout.ep} experts a rank, FSDP "
                f"Shard({expert_shard_dim(layout, cfg.num_experts)})" if t.world_size > 1 else "") +
               f" | {'bf16' if t.bf16 else 'fp32'} compute | peak {t.peak / 1e9:,.1f} GFLOP/s a rank "
               f"({peak_source}) | {peak_memory(t.device) / 2**30:.2f} GiB peak so far (rank 0)")
        if self.resume_path:
            print0(f"resumed from {self.resume_path} at step {self.start_step}" +
                   (f" (RL step {self.meta['rl_step']})" if self.rl_resumed else ""))

    def log(self, record):
        """A record to metrics.jsonl (the source of truth), with its wall-clock time and the seconds since the
        run started; its numbers to the sinks too, keyed by stage (pretrain/loss, rl/reward,
        rl_eval/pass_level1)."""
        if not is_rank0():
            return
        now = time.time()
        record = {**record, "time": now, "elapsed": now - self.started}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        self.metrics_lines += 1
        if (self.tensorboard or self.wandb_run) and "event" not in record:
            scalars = {f"{record.get('stage', 'pretrain')}/{k}": v for k, v in record.items()
                       if type(v) in (int, float) and k not in ("step", "time", "elapsed")}
            if self.tensorboard:
                for key, value in scalars.items():
                    self.tensorboard.add_scalar(key, value, record["step"])
            if self.wandb_run:
                self.wandb_run.log(scalars, step=record["step"])

    def save(self, t, step, **run_state):
        """Every rank writes its shards into step-N.tmp and checksums its share of the files; rank 0 writes
        meta.json (the step, run_state, the data position, the checksums, how many metrics lines the run has
        so far), fsyncs it and renames the folder, then retires old checkpoints. A failure (a full disk, above
        all) removes the partial folder and stops every rank with one line."""
        out, world_size = self.out, self.world_size
        path, tmp = out / f"step-{step:08d}", out / f"step-{step:08d}.tmp"
        sums, err = {}, None
        try:
            dcp.save(self.state_dicts(t), storage_writer=FileSystemWriter(tmp, sync_files=True),
                     no_dist=world_size == 1)
            sums = {f: sha256(tmp / f) for f in sorted(f.name for f in tmp.iterdir())[self.rank::world_size]}
        except (Exception, CheckpointException) as e:
            err = self.save_failure(e, path, t.checkpoint_bytes)
        parts = [(err, sums)]
        if world_size > 1:
            parts = [None] * world_size
            dist.all_gather_object(parts, (err, sums))
        err = next((e for e, _ in parts if e), None)
        if is_rank0() and not err:
            try:
                meta = {"step": step, **run_state, "data_pos": t.data.train_windows.pos,
                        "metrics_lines": self.metrics_lines, "copies": sorted(t.copies),
                        "config": asdict(t.cfg), "args": vars(self.args),
                        "files": {f: h for _, s in parts for f, h in s.items()}}
                with open(tmp / "meta.json", "w") as f:
                    json.dump(meta, f)
                    f.flush()
                    os.fsync(f.fileno())
                if path.exists():  # a damaged one that --resume passed over
                    retire(path)
                os.replace(tmp, path)
                fsync_dir(out)
                self.retire_old()
            except OSError as e:
                err = self.save_failure(e, path, t.checkpoint_bytes)
        err = agree(world_size, err)
        if err:
            if is_rank0():
                shutil.rmtree(tmp, ignore_errors=True)
            die(err)

    def save_failure(self, e, path, checkpoint_bytes):
        """-> one line for an exception raised while saving. torch's writer hides a full disk as 'unexpected
        pos', so a failure with less than a checkpoint's size free is called what it is."""
        free = shutil.disk_usage(self.out).free
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) or free < checkpoint_bytes:
            return (f"no space left on device: checkpoint {path} could not be written ({free / 2**20:,.0f} "
                    f"MiB free, a checkpoint takes ~{checkpoint_bytes / 2**20:,.0f} MiB); the partial "
                    "checkpoint was removed and the run stopped; free space, then resume")
        return f"checkpoint {path} could not be written ({last_line(e)})"

    def retire_old(self):
        """Keep the newest --keep checkpoints and the last one of each stage: RL never deletes the pretrained
        model."""
        found = self.checkpoints()
        stages = {}
        for p in found:
            with contextlib.suppress(OSError, ValueError):
                stages[p] = read_meta(p).get("stage")
        keep = set(found[-self.args.keep:])
        for stage in ("pretrain", "rl"):
            keep.update([p for p in found if stages.get(p) == stage][-1:])
        for p in found:
            if p not in keep:
                retire(p)

    def on_signal(self, signum, frame):
        self.stop_signal = self.stop_signal or signum

    def stop_here(self, t, step, saved, **run_state):
        """A signal stopped the run at this step: save it (unless just saved), print how to resume, exit."""
        if not saved:
            self.save(t, step, **run_state)
        world_size = self.world_size
        sig = signal.Signals(self.stop_signal or signal.SIGTERM)  # the rank that got it may not be this one
        # the same flags, resuming from --out
        argv = [a for a in sys.argv[1:] if not a.startswith("--resume=")]
        if "--resume" in argv:
            i = argv.index("--resume")
            del argv[i:i + (1 if self.args.resume == "latest" else 2)]
        launcher = ["python"] if world_size == 1 else \
            ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}"] + \
            ([f"--nnodes={world_size // int(os.environ['LOCAL_WORLD_SIZE'])}", "<your rendezvous flags>"]
             if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size else [])
        print0(f"stopped by {sig.name} after step {step} (checkpoint {self.out / f'step-{step:08d}'}); "
               f"resume with: {shlex.join(launcher + [sys.argv[0]] + argv + ['--resume'])}", file=sys.stderr)
        sys.exit(128 + sig)


def read_meta(path):
    return json.loads((path / "meta.json").read_text())


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        pass  # someone else's process, or a lock we cannot read: assume it runs
    return True


def fsync_dir(path):
    if os.name == "posix":  # the rename itself reaches the disk
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def retire(path):
    """Delete a checkpoint folder; renamed first, so a kill midway leaves a .del folder, never a broken
    step-N."""
    os.replace(path, path.with_name(path.name + ".del"))
    shutil.rmtree(path.with_name(path.name + ".del"))


# -----------------------------------------------------------------------------
# Data: token shards (numpy arrays, memory-mapped from disk for real runs) cut into windows of seq_len + 1
# tokens. Training visits the windows in a seeded order: each epoch shuffles the shards and the windows inside
# each shard, so every window is read once an epoch and the order is a pure function of (seed, position). The
# position (windows consumed by all ranks together) goes into the checkpoint, so a resumed run continues on
# the next unseen window. Shards are read one after another, so mixing sources is the tokenizer's job, as for
# llm.c's shards: shuffle documents before cutting them into shards. Every rank computes the whole global
# batch's window list (cheap) and reads only its rows and its context-parallel chunk of each: every layout
# sees the same data.

# of the transcripts, chains (about half their tokens: a chain is 8-32 calls, a short task 1-4)
LONG_SHARE = 0.15
SHARD_MAGIC, SHARD_HEADER = 20240520, 256  # llm.c's token shards: 256 int32 [magic, version, n_tokens, ...]


def load_tokens(path, code, delete=0.0):
    """-> (train shards, val shards, vocab size or None): lists of 1-D token arrays; dies with one line on
    missing, empty or corrupt data. code, delete: the generated transcripts' (transcripts)."""
    if path is None:  # generated: transcripts of the --rl-tasks family, a function of the code and a seed
        # The RL stage needs a model that knows the format and copies a call's arguments, which the tiny model
        # learns only after a few hundred steps of them. Nothing here reads a file, so an edit to a comment or
        # to the README never changes what a run trains on (a run reads fewer windows than there are).
        return [transcripts(20000, 1, code, delete)], [transcripts(1000, 2, code, delete)], None
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
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*")
                                           if f.is_file() and not f.name.startswith("."))
    tokens = tokenize_files(files)
    if not tokens.size:
        die(f"--data {path}: no text found (the folder is empty or its files are blank)")
    train, val = split(tokens)
    return [train], [val], None


def transcripts(n, seed, code, delete=0.0):
    """Tokens of n gold transcripts (tasks.corpus, seeded; code: the micro-repository family of the coding
    episodes, None: tool use only; delete: the share of those that are the deletion role's), as uint16.
    Making them takes seconds and every run (every rank) needs the same ones, so they are cached in
    ~/.cache/composer-stack under the hash of the code that makes them (tasks.py and harness/, model.py,
    grpo.py's summary request and budget), made by the first process of the machine that needs them while the
    others (the other ranks) wait on a lock beside them; a missing, unwritable or unreadable cache only costs
    the seconds. A share of them are long chains, cut into the segments a rollout makes at the RL stage's
    context budget."""
    path = CACHE / (f"{code or 'tools'}-{n}-{seed}{f'-delete{delete:g}' if delete else ''}-"
                    f"{code_key('tasks.py', 'harness', 'model.py', 'grpo.py')}.npy")
    with contextlib.suppress(OSError, ValueError, EOFError):
        return np.load(path)
    with first_on_machine(path):
        with contextlib.suppress(OSError, ValueError, EOFError):
            return np.load(path)  # made while this process waited
        text = tasks.corpus(n, seed=seed, long_share=LONG_SHARE, budget=GRPOConfig.context_budget,
                            request=SUMMARY_REQUEST, code_share=CODE_SHARE if code else 0.0,
                            delete_share=delete if code else 0.0,
                            code_budget=CODE_BUDGET, family=code or "words")
        tokens = np.array(encode(text, specials=True), dtype=np.uint16)
        keep_in_cache(path, lambda f: np.save(f, tokens))
        return tokens


def code_key(*files, extra=""):
    """What a cache of these files' output (files or folders of this folder: a folder's .py files) is kept
    under: 16 hex digits of their SHA-256, and extra's."""
    here = Path(__file__).resolve().parent
    paths = [p for f in files for p in ([here / f] if (here / f).is_file()
                                        else sorted((here / f).glob("*.py")))]
    return hashlib.sha256(b"".join(p.read_bytes() for p in paths) + extra.encode()).hexdigest()[:16]


@contextlib.contextmanager
def first_on_machine(path):
    """Held while this process makes what the cache file `path` keeps: the machine's first process that needs
    it makes it while the others (a run's other ranks) wait on a lock beside it, then read it. No lock (the
    cache cannot be written) is no wait: each makes its own."""
    with contextlib.ExitStack() as held:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            fcntl.flock(held.enter_context(open(path.with_name(path.name + ".lock"), "a")), fcntl.LOCK_EX)
        yield


def keep_in_cache(path, write):
    """write(file) into path, whole or not at all (a temporary file, then renamed: ranks writing it at once do
    not clash); a cache that cannot be written only costs the next run the time to remake it."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp := path.with_name(f"{path.name}.{os.getpid()}.tmp"), "wb") as f:
            write(f)
        os.replace(tmp, path)


def read_shard(path):
    """A .bin file -> (memmap of its tokens, vocab size or None). With llm.c's header (int32 magic 20240520):
    version 1 = uint16 tokens, 2 = uint32, then the token count; our 4th slot gives the vocab size (0: the
    default of the version, GPT-2's 50257 or Llama 3's 128256). Without it: raw uint16,
    nanoGPT's train.bin."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype=np.int32, count=SHARD_HEADER) if size >= 4 * SHARD_HEADER else None
    if header is not None and header[0] == SHARD_MAGIC:
        if header[1] not in (1, 2):
            die(f"--data {path}: shard header version {header[1]}; expected 1 (uint16) or 2 (uint32)")
        dtype = np.dtype(np.uint16 if header[1] == 1 else np.uint32)
        n, body = int(header[2]), size - 4 * SHARD_HEADER
        if n <= 0 or n * dtype.itemsize != body:
            die(f"--data {path}: the header promises {n} tokens ({n * dtype.itemsize} bytes) but {body} "
                "bytes follow it (truncated or corrupt shard)")
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
    """The shards as windows of `length` tokens in a seeded order; pos = windows consumed so far
    (all ranks)."""

    def __init__(self, shards, length, seed):
        self.shards, self.length, self.seed, self.pos = shards, length, seed, 0
        # whole windows a shard; the ragged tail is never read
        self.sizes = [len(s) // length for s in shards]
        self.total = sum(self.sizes)
        self.perm = functools.lru_cache(maxsize=8)(
            lambda n, *key: np.random.default_rng([seed, *key]).permutation(n))

    def window(self, k):
        """The k-th window of the order -> (shard, first token)."""
        epoch, r = divmod(k, self.total)
        order = self.perm(len(self.shards), epoch)  # the shards' order this epoch
        ends = np.cumsum([self.sizes[i] for i in order])
        j = int(np.searchsorted(ends, r, side="right"))
        shard = int(order[j])
        return (shard,
                int(self.perm(self.sizes[shard], epoch, shard)[r - (ends[j] - self.sizes[shard])])
                * self.length)

    def next(self, n):
        """The next n windows (a global batch) -> [(shard, first token)]."""
        self.pos += n
        return [self.window(k) for k in range(self.pos - n, self.pos)]


class Data:
    """This run's tokens: the training and validation shards, the seeded order of training windows (its
    position is checkpointed), the fixed evaluation windows, and this rank's share of a batch. A vocabulary
    wider than the preset's (a .bin from another tokenizer) widens t.cfg."""

    def __init__(self, t):
        args, self.t = t.args, t
        delete = DELETE_SHARE if args.delete_share else 0.0  # the transcripts show the roles RL plays
        self.train_shards, self.val_shards, shard_vocab = load_tokens(args.data, t.job.code, delete)
        for name, shards in (("training", self.train_shards), ("validation", self.val_shards)):
            if not sum(len(s) // (args.seq_len + 1) for s in shards):
                die(f"--data: the {name} split has {sum(map(len, shards))} tokens, fewer than one window of "
                    f"--seq-len + 1 = {args.seq_len + 1}")
        # a tokenizer's vocab from the shard header, else the largest id (a small corpus); a .bin from another
        # tokenizer (e.g. GPT-2's 50257) widens the embedding
        cfg = t.cfg
        shards = self.train_shards + self.val_shards
        vocab_size = max(cfg.vocab_size, shard_vocab or 1 + max(int(s.max()) for s in shards if len(s)))
        if args.init_from and vocab_size != cfg.vocab_size:
            die(f"--data {args.data}: its tokens need a vocabulary of {vocab_size} "
                f"(the shard header, or the largest id + 1), the checkpoint has {cfg.vocab_size}: make the "
                "shards with the checkpoint's tokenizer")
        if vocab_size != cfg.vocab_size:
            t.cfg = ModelConfig(**{**asdict(cfg), "vocab_size": vocab_size})
        self.train_windows = Windows(self.train_shards, args.seq_len + 1, args.seed)
        self.eval_windows = {name: Windows(shards, args.seq_len + 1, seed=0).next(args.eval_batches
                                                                                  * args.batch_size)
                             for name, shards in (("train", self.train_shards), ("val", self.val_shards))}

    def batch(self, shards, windows):
        """The global batch's windows [(shard, first token)] -> this rank's B/dp rows and T/cp chunk of each:
        inputs, targets [B_local, T_local], pos [T_local]."""
        t = self.t
        t0 = t.cp_rank * t.T_local
        rows = [shards[s][i + t0:i + t0 + t.T_local + 1]
                for s, i in windows[t.dp_rank * t.B_local:(t.dp_rank + 1) * t.B_local]]
        xy = torch.from_numpy(np.stack(rows).astype(np.int64)).to(t.device)
        return xy[:, :-1], xy[:, 1:], torch.arange(t0, t0 + t.T_local, device=t.device)


# -----------------------------------------------------------------------------
# Small helpers every part uses: one line and exit on bad input, printing on rank 0, the ranks agreeing


def launch_rank():
    return int(os.environ.get("RANK", "0"))  # with --rollout-ranks the trainers' ranks come first


def is_rank0():
    return launch_rank() == 0


def die(msg):
    """Bad input ends the run on every rank with exit code 2 and one line naming the problem, printed once:
    every check sees the same flags and files on every rank (or its verdict is shared first), so rank 0 speaks
    for all."""
    if is_rank0():
        print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def print0(*a, **kw):
    if is_rank0():
        print(*a, **kw, flush=True)


def last_line(e):
    """An exception in one line: DCP's carry every rank's traceback."""
    return f"{type(e).__name__}: " + (str(e).strip().splitlines()[-1][:160] if str(e).strip()
                                      else "no details")


def agree(world_size, err):
    """-> the error of the lowest rank that has one, or None, on every rank (each passes its own or None)."""
    if world_size > 1:
        errs = [None] * world_size
        dist.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
    return err


# -----------------------------------------------------------------------------
# Checks: every flag against the others, the model config and the layout, before any process group exists.
# Every rank sees the same flags, so a bad layout stops all ranks with the same line.


@dataclass
class Job:
    """What the flags ask for, checked: the model config (a preset, or --init-from's config.json, kept as
    hf_base for --save-hf), the layout of the ranks that train, the tokenizer RL speaks, the logging sinks,
    the RL copies the flags want, and the model's shapes (on the meta device) and parameter counts."""
    args: argparse.Namespace
    cfg: ModelConfig
    hf_base: dict | None
    layout: object
    tokenizer: object
    code: bool  # --rl-tasks code: the feature-deletion coding tasks
    trainers: int  # the ranks that train (all but the rollout ranks)
    wanted_copies: set
    sinks: dict
    meta_model: Transformer
    total: int
    active: int


def check(args):
    """The flags -> a Job, or one line and exit 2 naming what is wrong."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # the optional logging sinks (log() feeds them): a missing package stops every rank now, before any work
    sinks = {}
    for flag, package, module in (("tensorboard", "tensorboard", "torch.utils.tensorboard"),
                                  ("wandb", "wandb", "wandb")):
        if getattr(args, flag):
            try:
                sinks[flag] = importlib.import_module(module)
            except ImportError:
                die(f"--{flag} needs the {package} package: pip install {package}")
    if (args.preset or "tiny") not in PRESETS:
        die(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    cfg: ModelConfig = PRESETS[args.preset or "tiny"]
    hf_base = None  # --init-from: the checkpoint's own config.json, which --save-hf keeps
    if args.init_from:
        try:
            cfg, hf_base, left_out = hf_config(args.init_from)
        except CheckpointError as e:
            die(f"--init-from {e}")
        for what in left_out:
            print0(f"note: --init-from leaves out {what}")
        preset = PRESETS.get(args.preset)
        if preset is not None and preset != cfg:
            differ = [f"{k} {v} (preset {getattr(preset, k)})" for k, v in asdict(cfg).items()
                      if getattr(preset, k) != v]
            die(f"--init-from {args.init_from}/config.json disagrees with --preset {args.preset}: "
                f"{', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}; drop --preset "
                "(the checkpoint's config.json is the model)")
        if args.num_experts not in (None, cfg.num_experts):
            die(f"--num-experts {args.num_experts}: the checkpoint has {cfg.num_experts} experts a layer; "
                "drop the flag")
        if args.data is None and cfg.vocab_size != VOCAB_SIZE and not args.dry_run and args.stage != "rl":
            die("--init-from needs --data: token shards made with the checkpoint's own tokenizer (vocab "
                f"{cfg.vocab_size}); the built-in corpus is this project's bytes "
                "(README: Start from a released model)")
    args.preset = args.preset or ("tiny" if args.init_from is None else Path(args.init_from).name)
    if args.save_hf:  # checked now, not after the run: the nearest folder that exists must be writable
        above = next(p for p in Path(args.save_hf).absolute().parents if p.exists())
        if Path(args.save_hf).is_file():
            die(f"--save-hf {args.save_hf}: a file is in the way")
        if not (above.is_dir() and os.access(above, os.W_OK)):
            die(f"--save-hf {args.save_hf}: {above} is not a writable folder")
    if args.num_experts is not None:
        if not cfg.top_k <= args.num_experts:
            die(f"--num-experts {args.num_experts} is fewer than the {args.preset} preset's "
                f"top-{cfg.top_k} routing")
        cfg = ModelConfig(**{**asdict(cfg), "num_experts": args.num_experts})
    if args.task_dir is not None and args.rl_tasks != "code":
        die("--task-dir holds feature-deletion tasks: pass --rl-tasks code with it")
    if args.task_dir is not None and not Path(args.task_dir).is_dir():
        die(f"--task-dir {args.task_dir}: no such folder")
    if args.task_dir is not None:
        try:  # the tasks it serves: coverage and strength, as for any task (tasks.serving)
            listed = tasks.TaskPool(Path(args.task_dir), 0, source=args.task_dir).listed
        except tasks.TaskError as e:
            die(f"--task-dir {args.task_dir}: {e}")
        if not (listed[1] or listed[2]) and args.rl_eval_tasks != 0:  # the levels the evaluation draws
            die(f"--task-dir {args.task_dir} serves no task of level 1 or 2, which the evaluation draws ("
                + ", ".join(f"level {lvl}: {len(ds)}" for lvl, ds in listed.items())
                + "): pass --rl-eval-tasks 0 to train without it")
    code = args.code_family if args.rl_tasks == "code" else None  # the micro-repositories' family
    if code and args.stage != "pretrain" and not args.dry_run and sandbox_problem():
        if args.task_dir:
            die(f"--task-dir: {sandbox_problem()}; a repository's tests and the policy's edits of it run "
                "only in bubblewrap")
        print0(f"note: {sandbox_problem()}, so the micro-repositories' tests and the policy's edits of them "
               "run unisolated (a subprocess each in a scratch folder, with time, memory and file-size "
               "limits); bubblewrap isolates them: apt-get install bubblewrap")
    for flag, default, code_default in (("seq_len", 256, 640), ("steps", 700, 800), ("batch_size", 8, 4),
                                        ("lr", 8e-3, 1.2e-2),
                                        ("rl_steps", 16, 12), ("rl_eval_every", 8, args.rl_steps or 12),
                                        ("rl_eval_tasks", 64, 16), ("rl_eval_samples", 1, 6)):
        if getattr(args, flag) is None:  # the code family's episodes are longer, and need fewer of them
            setattr(args, flag, code_default if code else default)
    args.max_gen_tokens = args.max_gen_tokens or {"long": 512, "code": 384}.get(args.rl_tasks, 128)
    for flag in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "eval_every", "eval_batches",
                 "keep", "max_gen_tokens"):
        if getattr(args, flag) <= 0:
            die(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.seq_len > cfg.max_seq_len:
        die(f"--seq-len {args.seq_len} exceeds the {args.preset} preset's context of {cfg.max_seq_len} "
            "tokens")
    if args.lr <= 0:
        die(f"--lr must be positive, got {args.lr}")
    if args.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda but no CUDA device is available")
    if args.rollout_ranks or args.max_staleness:
        if args.max_staleness < 0 or args.rollout_ranks < 0:
            die(f"--rollout-ranks and --max-staleness must be >= 0, "
                f"got {args.rollout_ranks} and {args.max_staleness}")
        if not args.rollout_ranks:
            die(f"--max-staleness {args.max_staleness} needs --rollout-ranks: without rollout ranks every "
                "rank samples with the current policy (synchronous RL)")
        if args.rollout_ranks >= world_size:
            die(f"--rollout-ranks {args.rollout_ranks} leaves no trainer rank: the launch has {world_size} "
                "rank(s); launch more (torchrun --nproc_per_node) or roll out on fewer")
        if args.rollout_ranks > world_size - args.rollout_ranks:
            die(f"--rollout-ranks {args.rollout_ranks}: a rollout rank samples for whole trainer ranks, so "
                f"there can be at most as many as trainer ranks ({world_size - args.rollout_ranks} of the "
                f"{world_size})")
        if args.stage != "rl":
            die("--rollout-ranks: rollout ranks sample RL rollouts only; pass --stage rl (after pretraining, "
                "--resume it)")
        if args.dry_run:
            die("--rollout-ranks: --dry-run plans the trainer ranks; drop --rollout-ranks "
                "and set --world to them")
        world_size -= args.rollout_ranks  # every check below is the trainers' world
    if args.world is not None and (not args.dry_run or args.world < 1 or world_size > 1):
        die("--world plans a layout with --dry-run in one process (torchrun sets the real world size)")
    if args.dry_run:
        world_size = args.world or world_size
    try:
        layout = make_layout(world_size, args.dp_replicate, args.cp, args.ep, args.ep_replicate,
                             num_experts=cfg.num_experts, seq_len=args.seq_len, batch_size=args.batch_size)
    except LayoutError as e:
        die(f"layout: {e}")
    if args.batch_size // layout.dp % args.grad_accum:
        die(f"--grad-accum {args.grad_accum} does not divide the {args.batch_size // layout.dp} sequences a "
            f"rank gets (--batch-size {args.batch_size} over {layout.dp} data-parallel ranks)")
    # RL: the tool tasks, not --data
    args.stage = args.stage or ("pretrain" if args.data or args.init_from else "both")
    # RL writes and reads turns through a tokenizer: this project's bytes, or a released model's own (its
    # tokenizer.json and chat template; a checkpoint of this project's byte vocabulary needs none)
    tokenizer = BYTES
    if args.init_from and args.stage != "pretrain" and not args.dry_run and (
            cfg.vocab_size != VOCAB_SIZE or Path(args.init_from, "tokenizer.json").exists()):
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError:
            kwargs = None
        if not isinstance(kwargs, dict):
            die(f"--chat-template-kwargs {args.chat_template_kwargs!r}: not a JSON object, e.g. "
                "'{\"enable_thinking\": false}'")
        try:
            tokenizer = HFTokenizer(args.init_from, cfg.vocab_size, kwargs)
            print0(f"chat template: {tokenizer.mapping()}")
        except TokenizerError as e:
            die(f"--init-from {e}")
    if args.stage == "rl" and not (args.resume or args.init_from) and args.init != "scratch":
        die("--stage rl needs a model to start from: run `python train.py --stage pretrain` first, then "
            "`python train.py --stage rl --resume` (or pass --init scratch to start RL from random weights)")
    if args.stage != "pretrain":
        args.tasks_per_step = args.tasks_per_step or -(-(4 if code else 8) // world_size) * world_size
        if (min(args.rl_steps, args.tasks_per_step, args.rl_lr, args.rl_eval_every) <= 0
                or args.group_size < 2):
            die("the RL stage needs --rl-steps, --tasks-per-step, --rl-lr and --rl-eval-every > 0, "
                "--group-size >= 2")
        if args.rl_eval_tasks < 0 or args.rl_eval_samples < 1:
            die(f"--rl-eval-tasks must be >= 0 (0: no held-out evaluation) and --rl-eval-samples >= 1, got "
                f"{args.rl_eval_tasks} and {args.rl_eval_samples}")
        if args.temperature <= 0 or not 0 <= args.feedback_ema_decay < 1 or args.ppo_epochs < 1:
            die("--temperature must be > 0, --feedback-ema-decay in [0, 1), --ppo-epochs >= 1")
        if not 0 <= args.delete_share <= 1:
            die(f"--delete-share must be in [0, 1], got {args.delete_share}")
        if not 1 <= args.ppo_minibatches <= args.tasks_per_step // world_size:
            die(f"--ppo-minibatches {args.ppo_minibatches}: each is whole groups, and a rank has "
                f"{args.tasks_per_step // world_size} (--tasks-per-step {args.tasks_per_step} "
                f"over {world_size} ranks)")
        args.feedback_rules = args.feedback_rules or ("tool_not_found,read_first,test_first,wrong_feature"
                                                      if code else "tool_not_found,capital")
        unknown = set(args.feedback_rules.split(",")) - {name for name, _ in RULES}
        if unknown:
            die(f"--feedback-rules: unknown rule(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(n for n, _ in RULES)}")
        if args.tasks_per_step % world_size:
            die(f"--tasks-per-step {args.tasks_per_step} does not split over {world_size} ranks (each "
                f"samples its own groups); pass a multiple of {world_size}, e.g. --tasks-per-step "
                f"{-(-args.tasks_per_step // world_size) * world_size}")
    wanted_copies = {name for name, on in (("reference", args.kl_coef > 0),
                                           ("teacher", args.feedback_teacher != "current"))
                     if on and args.stage != "pretrain"}
    with torch.device("meta"):  # shapes only
        meta_model = Transformer(cfg)
    total, active = param_counts(meta_model)
    return Job(args, cfg, hf_base, layout, tokenizer, code, world_size, wanted_copies, sinks, meta_model,
               total, active)


# Memory plan (model.memory_plan): what a rank holds at its peak, from shapes alone, so a layout can be
# sized before any GPU is booked (--dry-run), and a preset that cannot fit stops with one line, not an
# out-of-memory crash.


def plan_memory(job, accum, reduce_each, bf16):
    """model.memory_plan for this run's layout and flags (RL's too when the run has an RL stage)."""
    args, layout = job.args, job.layout
    rl = {}
    if args.stage != "pretrain":  # the trainer's forward over a data-parallel group's rollouts, estimated at
        # 3 x --max-gen-tokens tokens a trajectory (its own, about as many of prompt, replies, summaries,
        # padding)
        per_group = args.tasks_per_step * args.group_size // (layout.world // layout.cp)
        rl = dict(rl_tokens=per_group * 3 * args.max_gen_tokens,
                  sample_gathered=args.sample_gather == "rollout",
                  rl_copies=len(job.wanted_copies) + (args.sampler_bits > 0))
    muon_params = param_groups(job.meta_model.named_parameters(), lr=1.0, weight_decay=0.0)[0]["params"]
    return memory_plan(job.meta_model, layout, muon_params, bf16=bf16, accum=accum, reduce_each=reduce_each,
                       checkpointing=args.activation_checkpointing, batch_size=args.batch_size,
                       seq_len=args.seq_len, **rl)


def in_gib(plan):
    return ", ".join(f"{k} {v / 2**30:,.2f}" for k, v in plan.items())


def dry_run(job):
    """--dry-run: a rank's memory at the layout --world asks for, and the fewest micro-batches that fit
    --gpu-mem; everything before it ran as it would under torchrun, nothing is allocated."""
    args, layout, cfg, world_size = job.args, job.layout, job.cfg, job.trainers
    wanted_copies, total, active = job.wanted_copies, job.total, job.active
    bf16 = args.precision != "fp32"  # plans are for GPUs, where auto means bf16
    # a rank's sequences a step; --grad-accum 1: the fewest micro-batches that fit
    rows = args.batch_size // layout.dp
    tries = [(n, each) for n in ([args.grad_accum] if args.grad_accum > 1 else
                                 [n for n in range(1, rows + 1) if rows % n == 0])
             for each in sorted({args.reduce_every_micro_batch, n > 1})]  # no-sync first, where it is allowed
    plans = {t: plan_memory(job, *t, bf16) for t in tries}
    accum, each = next((t for t in tries if sum(plans[t][0].values()) <= args.gpu_mem * 2**30), tries[0])
    plan, checkpoint_bytes = plans[accum, each]
    print(f"preset {args.preset}: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active | world "
          f"{world_size}: dense (dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard}, "
          f"cp={layout.cp}), experts (ep_replicate={layout.ep_replicate}, ep_shard={layout.ep_shard}, "
          f"ep={layout.ep}), {cfg.num_experts // layout.ep} experts a rank | {rows // accum} x "
          f"{args.seq_len // layout.cp} tokens a rank a forward, {accum} micro-batch{'es' * (accum > 1)} a "
          f"step (--grad-accum {accum}{' --reduce-every-micro-batch' * each}) | "
          f"{'bf16' if bf16 else 'fp32'} compute"
          f"{', activation checkpointing' if args.activation_checkpointing else ''}")
    if args.stage != "pretrain":
        kept = sorted(wanted_copies) + ["8-bit sampler"] * (args.sampler_bits > 0)
        print(f"RL stage: {args.tasks_per_step * args.group_size // (layout.world // layout.cp)} "
              f"trajectories a data-parallel group a step, ~{3 * args.max_gen_tokens} tokens each "
              f"(estimated) | other weights kept as shards: {', '.join(kept) or 'none'}")
    fits = sum(plan.values()) <= args.gpu_mem * 2**30
    print(f"memory a rank (GiB): {in_gib(plan)} | total {sum(plan.values()) / 2**30:,.2f}, "
          f"{'within' if fits else 'MORE THAN'} --gpu-mem {args.gpu_mem:g} | a checkpoint (all ranks) "
          f"{checkpoint_bytes / 2**30:,.2f} GiB on disk")
    return 0


# -----------------------------------------------------------------------------
# Flags


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (no usage block), a misspelled flag names the nearest real
    one, and a prefix of a flag is no flag (allow_abbrev=False: `--step 10` is not `--steps 10`)."""

    def error(self, message):
        unknown = (message.removeprefix("unrecognized arguments: ").split() if "unrecognized" in message
                   else [])
        flags = [a.split("=")[0] for a in unknown if a.startswith("-")]
        if unknown:
            near = difflib.get_close_matches(flags[0], [o for a in self._actions for o in a.option_strings],
                                             n=1) if flags else []
            message = (f"unknown flag {flags[0]}" if flags else f"unexpected argument {unknown[0]}") + \
                (f"; did you mean {near[0]}?" if near else "; see --help")
        if os.environ.get("RANK", "0") == "0":  # torchrun: every rank parses, rank 0 speaks
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: none added where the help text already names it, or for None and False."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def make_parser():
    """The flags, in groups; --help shows each default once."""
    parser = Parser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsOnce, allow_abbrev=False)
    g = parser.add_argument_group("model")
    g.add_argument("--preset", default=None, help=f"model size, one of {list(PRESETS)} (default: tiny)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a released checkpoint: a Hugging Face folder (config.json, "
                        "*.safetensors) of a DeepSeek-V3-architecture model (DeepSeek-V3, Kimi K2, Kimi "
                        "K2.5, Moonlight); its config.json is the model. Needs the safetensors package; "
                        "pretraining needs --data shards made with its tokenizer, RL its tokenizer.json and "
                        "chat template (the tokenizers package)")
    g.add_argument("--chat-template-kwargs", default="{}", metavar="JSON",
                   help="variables for the released model's chat template, as vLLM's chat_template_kwargs: "
                        "e.g. '{\"enable_thinking\": false}' for a reasoning model without thinking")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (default: the preset's)")
    g = parser.add_argument_group("run")
    g.add_argument("--steps", type=int, default=None,
                   help="optimizer steps in total (a resumed run stops here too); default 800, 700 with "
                        "--rl-tasks tools or long")
    g.add_argument("--batch-size", type=int, default=None,
                   help="global batch in sequences, whatever the layout; default 4, 8 with --rl-tasks tools "
                        "or long (a coding episode is 2.5x as long)")
    g.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches a step: a rank runs batch-size/(data-parallel ranks x N) sequences a "
                        "forward, gradients add up and FSDP reduce-scatters them once, after the last (with "
                        "--dry-run: the smallest N that fits --gpu-mem when left at 1)")
    g.add_argument("--reduce-every-micro-batch", action="store_true",
                   help="with --grad-accum: reduce-scatter after every micro-batch instead, so no rank holds "
                        "unsharded gradients between them (N times the gradient traffic; what a model whose "
                        "whole gradient does not fit a rank needs)")
    g.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (at most the preset's max_seq_len); default 640 (an episode "
                        "with its file reads is long), 256 with --rl-tasks tools or long")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate for both groups (default 1.2e-2, 8e-3 with --rl-tasks tools or long: "
                        "experiments.md): Muon uses adjust_lr_fn='match_rms_adamw' so one "
                        "AdamW-style lr serves the matrices and the embeddings/head/router/norms alike")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    g.add_argument("--qk-clip", type=float, default=0.0, metavar="TAU",
                   help="MuonClip's QK-Clip (Kimi K2 uses 100): after each optimizer step, rescale the "
                        "query/key weights of every head whose largest attention logit exceeded TAU (0: off)")
    g.add_argument("--ns", default="standard", choices=["standard", "gram"],
                   help="Muon's Newton-Schulz: the standard iteration, or Gram Newton-Schulz, which "
                        "iterates on X X^T where that takes fewer FLOPs (1.43x fewer on Kimi K2's experts)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: "
                                                                "off)")
    g.add_argument("--warmup", type=int, default=30, help="linear warmup steps, then cosine decay to 10%%")
    g.add_argument("--seed", type=int, default=1337, help="seeds the weights and the data order")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if "
                                                                                     "available")
    g.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="compute dtype; weights, gradient reduction and optimizer state stay fp32 (FSDP2's "
                        "MixedPrecisionPolicy under torchrun, autocast in one process). auto: bf16 on CUDA, "
                        "fp32 on CPU")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each block's input for backward and recompute the rest")
    g.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    g.add_argument("--dry-run", action="store_true",
                   help="print the layout and the memory a rank needs (model built on the meta device), "
                        "then exit")
    g.add_argument("--world", type=int, default=None,
                   help="with --dry-run: the world size to plan for (default: WORLD_SIZE)")
    g.add_argument("--gpu-mem", type=float, default=80.0, help="with --dry-run: GiB a GPU has (H100: 80)")
    g = parser.add_argument_group("parallelism (torchrun; the shard degrees follow from the world size)")
    g.add_argument("--dp-replicate", type=int, default=1,
                   help="dense-weight replicas (HSDP); dp_shard = world/(dp_replicate*cp)")
    g.add_argument("--cp", type=int, default=1,
                   help="context parallelism: each sequence split over this many ranks")
    g.add_argument("--ep", type=int, default=1, help="expert parallelism: experts split over this many ranks")
    g.add_argument("--ep-replicate", type=int, default=1,
                   help="expert-weight replicas; ep_shard = world/(ep_replicate*ep)")
    g = parser.add_argument_group("data and output")
    g.add_argument("--data", default=None,
                   help="a folder of token shards (*.bin: llm.c's header, uint16 or uint32; names containing "
                        "'val' are validation), one .bin file (with that header, or raw uint16 as nanoGPT's; "
                        "val.bin beside it is validation), or a folder of text files; default: generated "
                        "transcripts of the --rl-tasks family's episodes")
    g.add_argument("--out", default="out", help="folder for metrics.jsonl and the checkpoints "
                                                "(step-NNNNNNNN/)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the newest intact checkpoint in OUT, or from the step-NNNNNNNN "
                        "folder given")
    g.add_argument("--save-hf", default=None, metavar="DIR",
                   help="at the end, write the model as a Hugging Face DeepSeek-V3 checkpoint folder "
                        "(needs safetensors)")
    g.add_argument("--save-hf-dtype", default="bf16", choices=["bf16", "fp32"],
                   help="the weights' dtype in --save-hf")
    g.add_argument("--keep", type=int, default=1,
                   help="checkpoints kept: the newest KEEP, plus the last one of each stage (pretraining, "
                        "RL)")
    g.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    g.add_argument("--eval-every", type=int, default=200,
                   help="steps between validation evaluations and checkpoints")
    g.add_argument("--eval-batches", type=int, default=8, help="batches per validation evaluation")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write every metrics.jsonl figure to TensorBoard event files in DIR (needs the "
                        "tensorboard package)")
    g.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log every metrics.jsonl figure to Weights & Biases (needs the wandb package; "
                        "WANDB_MODE=offline keeps it local)")
    g.add_argument("--plot", nargs="+", default=None, metavar="RUN",
                   help="draw runs' metrics.jsonl into a PNG and exit (no training): RUN is an --out "
                        "folder, or NAME=DIR1,DIR2,...: one run under a name, or a group of runs (seeds) "
                        "drawn as mean +- std (needs matplotlib)")
    g.add_argument("--plot-out", default=None, metavar="FILE",
                   help="with --plot: the PNG to write; default: plot.png in the run's folder (one run), "
                        "else here")
    g = parser.add_argument_group("RL stage: Dr. GRPO with textual feedback on coding (or tool-use) tasks")
    g.add_argument("--stage", default=None, choices=["pretrain", "rl", "both"],
                   help="pretrain then RL, pretraining only, or RL only (from --resume); default: both, but "
                        "only pretraining with --data or --init-from (the RL tasks are this project's "
                        "tasks, not your corpus)")
    g.add_argument("--init", default=None, choices=["scratch"],
                   help="scratch: let --stage rl start from random weights (a smoke test: it earns no "
                        "reward)")
    g.add_argument("--rl-steps", type=int, default=None,
                   help="RL steps (each: sample, then --ppo-epochs x --ppo-minibatches updates); default "
                        "12, 16 with --rl-tasks tools or long")
    g.add_argument("--group-size", type=int, default=8, help="rollouts per task (the GRPO group)")
    g.add_argument("--rl-tasks", default="code", choices=["code", "tools", "long"],
                   help="code: feature deletion, the policy a coding agent (tasks.CodeEnv) rewarded by "
                        "verify, on micro-repositories made while it trains, or on --task-dir; tools: nested "
                        "expressions of 1-4 tool calls; long: chains of 8 x level calls that run past the "
                        "context (summaries; a slip costs the reward little)")
    g.add_argument("--code-family", default="words", choices=list(tasks.MICRO_FAMILIES),
                   help="with --rl-tasks code: the micro-repositories' functions are named by words that "
                        "say the body (double, last, count_vowels), or by an operation and a digit to copy "
                        "(mul4: x * 4; the harder level, which the tiny model does not learn)")
    g.add_argument("--delete-share", type=float, default=0.0,
                   help="with --rl-tasks code: the share of a step's groups that play the other role, "
                        "deleting a task's feature (tasks.DeleteEnv); a deletion that scores 1 becomes a "
                        "task later steps re-implement; the transcripts then show that role too, and each "
                        "evaluation measures it (0: re-implementation only)")
    g.add_argument("--verify-workers", type=int, default=2,
                   help="with --rl-tasks code: threads that verify finished episodes while the others sample "
                        "(0: each verify holds up sampling)")
    g.add_argument("--task-dir", default=None, metavar="DIR",
                   help="with --rl-tasks code: RL on the tasks `python tasks.py make` wrote in DIR (each "
                        "runs its tests with the --python it was made with) instead of micro-repositories; "
                        "only those served: held-out inputs on every feature, strength measured and >= 0.8")
    g.add_argument("--max-gen-tokens", type=int, default=None,
                   help="tokens a rollout may write over all its turns (L_max, also the loss's constant "
                        "normaliser); default 384 for code, 512 for long tasks, 128 for tools")
    g.add_argument("--tasks-per-step", type=int, default=None,
                   help="tasks (groups) per RL step, a multiple of the world size (each rank samples its "
                        "own); default: 4 (--rl-tasks tools or long: 8) rounded up to a multiple of the "
                        "world size")
    g.add_argument("--rl-lr", type=float, default=5e-4, help="RL learning rate (both groups)")
    g.add_argument("--feedback-coef", type=float, default=0.1, help="lambda of the feedback KL (0: pure RL)")
    g.add_argument("--feedback-rules", default=None,
                   help=f"comma-separated hint rules of feedback.py: {', '.join(name for name, _ in RULES)}")
    g.add_argument("--feedback-estimator", default="full", choices=["full", "sampled"],
                   help="full: exact KL over the vocabulary; sampled: the sampled-token estimator "
                        "(reweighted to T = 1 when --temperature is not 1)")
    g.add_argument("--feedback-teacher", default="frozen", choices=["frozen", "current", "ema"],
                   help="the hinted teacher: the policy RL started from, the current policy, or an EMA of "
                        "the policy (a current teacher drifts with the student: on the default run the pass "
                        "rate collapses after about 15 RL steps; experiments.md)")
    g.add_argument("--feedback-ema-decay", type=float, default=0.99, help="the EMA teacher's decay a RL step")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL to the starting policy (0: none, no reference kept)")
    g.add_argument("--kl-estimator", default="k1", choices=["k1", "k2", "k3"],
                   help="k1: folded into the reward; k2: in the loss, per token the gradient of KL(pi||ref) "
                        "at the visited states; k3: in the loss, per token that of KL(ref||pi)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (the trainer's log-probs use it too)")
    g.add_argument("--ppo-epochs", type=int, default=2,
                   help="passes over each RL batch (PPO's clip acts from the 2nd; 2 updates a batch learn "
                        "more in the default run's 16 steps than 1: experiments.md)")
    g.add_argument("--ppo-minibatches", type=int, default=1,
                   help="optimizer steps a pass, each on whole groups of this rank's (split as evenly "
                        "as they allow)")
    g.add_argument("--rl-eval-every", type=int, default=None,
                   help="RL steps between held-out evaluations (default: --rl-steps, one at the end; tools "
                        "or long: 8)")
    g.add_argument("--rl-eval-tasks", type=int, default=None,
                   help="held-out tasks a level (1 and 2) per evaluation; 0: none (default 16, from held-out "
                        "micro-repositories; with --task-dir, its first tasks, which training uses: a "
                        "train-task evaluation; tools or long: 64)")
    g.add_argument("--rl-eval-samples", type=int, default=None,
                   help="episodes a held-out task per evaluation (default 6; tools or long: 1): more make "
                        "two evaluations of one policy differ less (the verdict prints by how much)")
    g.add_argument("--sampler-bits", type=int, default=0, choices=[0, 8],
                   help="8: sample with 8-bit block-quantised weights (MXFP8-like), corrected by truncated "
                        "importance weights")
    g.add_argument("--sample-gather", default="rollout", choices=["rollout", "forward"],
                   help="under FSDP, sampling with the sharded model gathers each unit once for the whole "
                        "rollout and keeps it (rollout: fast; a rank holds the dense weights whole and its "
                        "EP share of the experts) or at every forward (forward: one unit at a time, an "
                        "all-gather per unit per token)")
    g.add_argument("--rollout-ranks", type=int, default=0, metavar="K",
                   help="asynchronous RL: the launch's last K ranks only sample (each with a whole copy of "
                        "the policy), the others only train and send the new policy after each step (0: "
                        "every rank samples, then trains)")
    g.add_argument("--max-staleness", type=int, default=0, metavar="S",
                   help="with --rollout-ranks: step i is sampled with the policy of step max(0, i - 1 - S), "
                        "so the rollout ranks run up to S steps ahead of the trainers (0: synchronous RL; "
                        "exactly, when sampling is fp32)")
    g.add_argument("--count-comm", action="store_true",
                   help="count the calls and bytes of every collective in the second step and print them")
    return parser


def parse_flags(argv=None):
    return make_parser().parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
