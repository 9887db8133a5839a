"""Targeted RL with textual feedback: a hinted teacher and an on-policy KL at one turn (Composer 2.5).

A trajectory-level reward says little about which of hundreds of messages went wrong. So at a target message
(picked by a rule: it called a tool the episode does not offer, it broke a style rule, it was malformed) we
write a short hint about the wanted improvement and insert it into the local context just before that message.
The policy under the hinted context is the teacher, the same policy under the original context is the student,
and the student is pulled toward the teacher on that message's tokens only: per-token reverse KL(student ||
teacher) over the full vocabulary (or a sampled-token estimator), teacher under no_grad, added to the RL loss
as L_RL + lambda * L_fb. The same self-distillation primitive appears in arXiv 2601.19897, 2601.20802 and
2601.18734 (cited by the post).

The ablation runs train.py (pretraining once, then RL with lambda > 0 and lambda = 0 from that checkpoint,
several seeds an arm) and prints the held-out targeted rates and pass rates, mean ± std over the seeds.

    python feedback.py                   # Cursor's "tool not found" example, a tiny model pretrained
    python feedback.py --ablation long   # lambda 0.1 against 0, long episodes, 5 seeds an arm (or: tools)
"""
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo import Weights, device_of, rows as grpo_rows
from model import BYTES
from tasks import (FORMAT_REMINDER, READ_FIRST, STYLE_REMINDER, TEST_FIRST, misplaced_edit, reminder,
                   unread_edit, untested_submit)


@dataclass
class FeedbackConfig:
    coef: float = 0.1  # lambda; 0 reproduces pure RL exactly (the term is not even computed)
    estimator: str = "full"  # "full": exact KL over the vocabulary; "sampled": the sampled-token estimator
    # the teacher: a "frozen" copy of the policy RL starts from, an "ema" of the policy, or the "current"
    # policy (the seed's choice; with it every run collapsed after 12-16 RL steps: experiments.md)
    teacher: str = "frozen"
    ema_decay: float = 0.99
    temperature: float = 1.0  # the one the messages were sampled at ("sampled" reweights them to T = 1)


# -----------------------------------------------------------------------------
# Rules: (name, detector) pairs; a detector reads an assistant message, the environment's reply to it (None
# when there was none) and the turns before it, and returns a hint for that message, or None. The reward sees
# none of this: a slip the
# episode recovers from, or a style the environment accepts, costs the final answer nothing.


def tool_not_found(message, reply, before):
    m = re.match(r"error: tool not found: \w+\. available tools: (.*)", reply or "")
    return reminder(m.group(1).split(", ")) if m else None


def malformed(message, reply, before):
    return FORMAT_REMINDER if (reply or "").startswith("error: malformed") else None


def capital(message, reply, before):
    """A style rule: the environment accepts 'Call add(2,3)', the style guide wants 'call add(2,3)'."""
    return STYLE_REMINDER if message.strip().startswith("Call ") else None


def read_first(message, reply, before):
    """Coding episodes: an edit of a file the episode has not read. It may still be right (the reward cannot
    tell), but an edit by line numbers nobody has seen is a guess."""
    return READ_FIRST if unread_edit(message, reply, before) else None


def test_first(message, reply, before):
    """Coding episodes: a submit with an edit since the last test run (right or not, the reward cannot tell
    how it was found)."""
    return TEST_FIRST if untested_submit(message, before) else None


def wrong_feature(message, reply, before):
    """Deletion episodes: an edit of lines outside every definition the task names (it deletes another
    feature, which its own test run shows only after the fact); the hint says where the named one is."""
    return misplaced_edit(message, reply, before)


RULES = [("tool_not_found", tool_not_found), ("malformed", malformed), ("capital", capital),
         ("read_first", read_first), ("test_first", test_first), ("wrong_feature", wrong_feature)]


def find_targets(traj, rules=RULES):
    """-> [(segment, start, end, hint, rule name)] for each assistant message a rule flags."""
    assistant = [i for i, (role, _) in enumerate(traj.turns) if role == "assistant"]
    targets = []
    for k, i in enumerate(assistant):
        reply = traj.turns[i + 1][1] if i + 1 < len(traj.turns) and traj.turns[i + 1][0] == "tool" else None
        for name, rule in rules:
            hint = rule(traj.turns[i][1], reply, traj.turns[:i])
            if hint is not None and k < len(traj.spans) and traj.spans[k][1] < traj.spans[k][2]:  # not empty
                targets.append((*traj.spans[k], hint, name))
                break
    return targets


# -----------------------------------------------------------------------------
# The loss


def pad(seqs, device=None, pad_id=BYTES.pad):
    """Token lists -> [len(seqs), longest] right-padded, on device."""
    longest = max(map(len, seqs))
    return torch.tensor([s + [pad_id] * (longest - len(s)) for s in seqs], device=device)


def message_kl(s_logits, t_logits, tokens, estimator="full", temperature=1.0):
    """KL(student || teacher) on one message's L tokens. s_logits (with grad), t_logits: [L, V], each row
    predicting tokens [L]. "full": sum_v p_s (log p_s - log p_t) per token, exact. "sampled": the student
    sampled `tokens`, so (log p_s(x) - log p_t(x)) estimates the KL and, as a score-function weight on
    log p_s(x), its gradient. Sampled at another temperature, x came from q = softmax(s_logits / T), not
    p_s: each is reweighted by p_s(x) / q(x), which makes both expectations p_s's again.
    -> (loss to backprop [L], KL value [L])"""
    s, t = F.log_softmax(s_logits.float(), -1), F.log_softmax(t_logits.float(), -1).detach()
    if estimator == "full":
        kl = (s.exp() * (s - t)).sum(-1)
        return kl, kl.detach()
    s_x, t_x = s.gather(-1, tokens[:, None]).squeeze(-1), t.gather(-1, tokens[:, None]).squeeze(-1)
    w = 1.0
    if temperature != 1.0:
        q = F.log_softmax(s_logits.float().detach() / temperature, -1)
        w = (s_x.detach() - q.gather(-1, tokens[:, None]).squeeze(-1)).exp()
    return w * (s_x - t_x).detach() * s_x, w * (s_x - t_x).detach()


class Feedback:
    """The feedback term: finds targets in a batch of trajectories, builds student and teacher contexts, and
    returns lambda-free L_fb (sum over target tokens / norm, the RL loss's constant). The teacher is the
    policy itself with the hint in its context ("current"), or other Weights of it (grpo.Weights, held as the
    policy is held: shards under FSDP) loaded into the policy for the teacher's pass: the policy RL started
    from ("frozen") or an EMA of it ("ema")."""

    def __init__(self, policy, cfg: FeedbackConfig, rules=RULES, tokenizer=BYTES):
        if cfg.teacher not in ("current", "frozen", "ema"):
            raise ValueError(f"teacher must be current, frozen or ema, got {cfg.teacher!r}")
        self.cfg, self.rules, self.tok = cfg, rules, tokenizer
        self.teacher = None if cfg.teacher == "current" else Weights(policy)

    def update(self, policy):
        """Once an RL step, after its optimizer steps (all PPO epochs and minibatches): the EMA teacher
        follows the policy (frozen and current need nothing)."""
        if self.cfg.teacher == "ema":
            self.teacher.lerp_(policy, 1 - self.cfg.ema_decay)

    @torch.no_grad()
    def targets(self, policy, trajs):
        """The flagged messages of a batch and the teacher's logits on them: the teacher's pass, run before
        the student's forward (the teacher's weights are swapped in and out around it). The hint goes in as a
        system turn (in the tokenizer's chat format) right before the tokens that open the message, so the
        teacher's message tokens sit len(hint tokens) later than the student's: positions are shifted to
        match. Every call runs exactly one forward
        (one padding token when nothing is flagged), so ranks of a sharded policy stay in step.
        -> (students [(row in grpo.batch, tokens)], spans [(start, end, hint length)], rule names, teacher
        logits, counts a rule)"""
        rows = {id(s): r for r, (_, s) in enumerate(grpo_rows(trajs))}
        students, teachers, spans, names = [], [], [], []
        counts = {name: 0 for name, _ in self.rules}
        for t in trajs:
            for seg, start, end, hint, name in find_targets(t, self.rules):
                # the teacher's context: the turns before the message, the hint's system turn with the
                # generation prompt after it (what the template adds there), then the message
                tokens, messages = t.segments[seg].tokens, t.segments[seg].messages
                opening, done, before, seen = t.openings[t.spans.index((seg, start, end))]
                h = self.tok.delta(messages[:done], [*messages[done:before], ("system", hint)], prompt=True,
                                   seen=seen) \
                    if hint else tokens[opening:start]
                students.append((rows[id(t.segments[seg])], tokens[:end]))
                teachers.append(tokens[:opening] + h + tokens[start:end])
                spans.append((start, end, len(h) - (start - opening)))
                names.append(name)
                counts[name] += 1
        was_training = policy.training
        with self.teacher.loaded(policy) if self.teacher else contextlib.nullcontext():
            # in eval mode: the teacher's pass must not count toward the router's expert loads
            t_logits, _ = policy.eval()(pad(teachers or [[self.tok.pad]], device_of(policy), self.tok.pad))
        policy.train(was_training)
        return students, spans, names, t_logits, counts

    def loss(self, policy, trajs, norm, logits=None, targets=None):
        """-> (L_fb, stats). logits: grpo_loss's [S, T-1, V] over grpo.batch(trajs); a target message is a
        prefix of its segment, so under causal attention the student's logits are already there and cost no
        forward of their own (else the student runs here). targets: self.targets(policy, trajs), taken before
        that forward; computed here when None, which must then come before the student's forward: with
        logits given, only the current policy can be the teacher."""
        if targets is None:
            if logits is not None and self.teacher is not None:
                raise ValueError("a frozen or EMA teacher's pass must run before the student's forward: pass "
                                 "targets=feedback.targets(policy, trajs) taken before it")
            targets = self.targets(policy, trajs)
        students, spans, names, t_logits, counts = targets
        if not students:
            zero = logits.sum() * 0 if logits is not None else sum(p.sum() * 0 for p in policy.parameters())
            return zero, {"feedback_kl": 0.0, "feedback_targets": 0, **counts, **self.probes({})}
        if logits is None:
            s_logits, _ = policy(pad([s for _, s in students], device_of(policy), self.tok.pad))
        else:
            s_logits = logits[torch.tensor([r for r, _ in students], device=logits.device)]
        losses, kls, probes = [], [], {}
        for i, (start, end, h) in enumerate(spans):  # logits at position p predict token p + 1
            tokens = torch.tensor(students[i][1][start:end], device=s_logits.device)
            s_i, t_i = s_logits[i, start - 1:end - 1], t_logits[i, start - 1 + h:end - 1 + h]
            loss, kl = message_kl(s_i, t_i, tokens, self.cfg.estimator, self.cfg.temperature)
            losses.append(loss.sum())
            kls.append(kl)
            with torch.no_grad():  # the token the hint argues against most: a slip's tool name, "Call"'s "C"
                p_s = F.softmax(s_i.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
                p_t = F.softmax(t_i.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
                j = (p_s.log() - p_t.log()).argmax()
                probes.setdefault(names[i], []).append((p_s[j].item(), p_t[j].item()))
        kls = torch.cat(kls)
        stats = {"feedback_kl": kls.mean().item(), "feedback_targets": len(spans), **counts,
                 **self.probes(probes)}
        return sum(losses) / norm, stats

    def probes(self, found):
        """Teacher against student on the flagged messages, a rule at a time: the mean probability each gives
        the sampled token the hint argues against most (its largest log p_student - log p_teacher). Feedback
        can only teach what the hinted teacher knows: a teacher as prone to slip as the student gives none."""
        out = {}
        for name, _ in self.rules:
            pairs = found.get(name, [])
            out[f"p_student_{name}"] = sum(s for s, _ in pairs) / max(1, len(pairs))
            out[f"p_teacher_{name}"] = sum(t for _, t in pairs) / max(1, len(pairs))
        return out


# -----------------------------------------------------------------------------
# Appendix: running and measuring it
#
# The ablation: pretrain once, then RL with lambda > 0 and lambda = 0 from that checkpoint, several seeds an
# arm, evaluated on the same held-out episodes. It drives train.py as a program (one process a run), never
# imports it.

TRACKED = ("tool_error_rate", "capital_rate", "pass_level1", "pass_level2")
PROBES = ("p_student_tool_not_found", "p_teacher_tool_not_found", "p_student_capital", "p_teacher_capital")


def ablation(regime, seeds, rl_steps, out, coef, jobs, start=None, extra=()):
    """Run (or reuse) every arm and seed. -> {(lambda, when): {metric: [value a seed]}}, `when` an RL step of
    a held-out evaluation or "train a-b", the mean over RL steps a..b of the training rollouts
    (metrics.jsonl)."""
    out, train = Path(out), Path(__file__).resolve().parent / "train.py"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))}
    if start is None:  # one pretraining for every arm and seed (skipped when it is already there)
        start = out / "pretrain"
        if not sorted(start.glob("step-*")):
            subprocess.run([sys.executable, str(train), "--stage", "pretrain", "--rl-tasks", regime, "--out",
                            str(start), *extra],
                           check=True)
        start = sorted(start.glob("step-*"))[-1]
    runs = {(lam, seed): out / f"{regime}-lambda{lam:g}-seed{seed}"
            for lam in (coef, 0.0) for seed in range(seeds)}
    records = lambda folder: [json.loads(line) for line in (folder / "metrics.jsonl").open()]
    done = lambda folder: (folder / "metrics.jsonl").exists() and \
        any(r.get("stage") == "rl_eval" and r["rl_step"] == rl_steps for r in records(folder))
    todo, live = [(k, f) for k, f in runs.items() if not done(f)], []
    while todo or live:
        while todo and len(live) < jobs:
            (lam, seed), folder = todo.pop(0)
            shutil.rmtree(folder, ignore_errors=True)  # an unfinished run starts over
            folder.mkdir(parents=True)
            cmd = [sys.executable, str(train), "--stage", "rl", "--resume", str(start), "--out", str(folder),
                   "--rl-tasks", regime, "--rl-steps", str(rl_steps), "--feedback-coef", str(lam),
                   "--seed", str(seed), "--tasks-per-step", "2", "--rl-eval-tasks", "16",
                   "--rl-eval-every", str(max(1, rl_steps // 2)), *extra]
            print(" ".join(cmd), flush=True)
            live.append((folder, subprocess.Popen(cmd, env=env, stdout=open(folder / "log.txt", "w"),
                                                  stderr=subprocess.STDOUT)))
        folder, proc = live.pop(0)
        if proc.wait():
            raise SystemExit(f"error: {folder} failed (exit {proc.returncode}); see {folder / 'log.txt'}")
    table, half = {}, max(1, rl_steps // 2)
    for (lam, _), folder in runs.items():
        rs = records(folder)
        for r in rs:
            if r.get("stage") == "rl_eval":
                for m in TRACKED:
                    table.setdefault((lam, r["rl_step"]), {}).setdefault(m, []).append(r[m])
        for a, b in [(1, half), (half + 1, rl_steps)][:1 + (rl_steps > half)]:
            steps = [r for r in rs if r.get("stage") == "rl" and a <= r["rl_step"] <= b]
            for m in ("reward", "tool_error_rate", "capital_rate", "feedback_kl", *PROBES):
                values = [r[m] for r in steps if r.get(m) is not None]  # probes: lambda > 0 and a target
                if values:
                    metrics = table.setdefault((lam, f"train {a}-{b}"), {})
                    metrics.setdefault(m, []).append(statistics.mean(values))
    return table


def print_ablation(table, regime):
    cell = lambda xs: (f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}" if xs
                       else "-")
    lams = sorted({lam for lam, _ in table}, reverse=True)
    for title, rows in (("held-out episodes after RL step", [k for k in table if isinstance(k[1], int)]),
                        ("training rollouts, mean over RL steps",
                         [k for k in table if isinstance(k[1], str)])):
        metrics = list(dict.fromkeys(m for k in rows for m in table[k]))
        print(f"\n{regime} episodes: {title}; mean ± std over {len(table[rows[0]][metrics[0]])} seeds\n")
        print("| | lambda | " + " | ".join(metrics) + " |\n|---|---|" + "---|" * len(metrics))
        for key in sorted(rows, key=lambda k: (str(k[1]).zfill(9), -k[0])):
            print(f"| {key[1]} | {key[0]:g} | " + " | ".join(cell(table[key].get(m)) for m in metrics) + " |")
    first, last = (min(k[1] for k in table if isinstance(k[1], int)),
                   max(k[1] for k in table if isinstance(k[1], int)))
    for m in TRACKED[:2]:
        fall = {lam: statistics.mean(table[lam, first][m]) - statistics.mean(table[lam, last][m])
                for lam in lams}
        ratio = f"{fall[lams[0]] / fall[0.0]:.1f}x" if fall[0.0] > 0 else "lambda 0 did not fall"
        print(f"held-out {m}: fell {fall[lams[0]]:+.3f} with lambda {lams[0]:g}, "
              f"{fall[0.0]:+.3f} with lambda 0 ({ratio}) from RL step {first} to {last}")


if __name__ == "__main__":
    import argparse
    import random
    import time
    from grpo import Segment, Trajectory
    from model import PRESETS, Transformer, encode
    from muon import Muon, param_groups
    from tasks import TOOLS, gold_transcript, make_tool_task, render
    ap = argparse.ArgumentParser(description="Cursor's 'tool not found' example on a tiny model, "
                                             "or the ablation.",
                                 allow_abbrev=False)  # the ablation hands unknown flags to train.py whole
    ap.add_argument("--pretrain-steps", type=int, default=300, help="steps on tool transcripts first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05, help="the one demonstration step's SGD learning rate")
    g = ap.add_argument_group("the ablation: lambda > 0 against lambda = 0 with train.py, "
                              "from one pretraining")
    g.add_argument("--ablation", choices=["long", "tools"],
                   help="run it on long episodes or the tool-use tasks, not the example")
    g.add_argument("--seeds", type=int, default=5, help="RL seeds an arm")
    g.add_argument("--rl-steps", type=int, default=12,
                   help="RL steps a run (held-out evaluations at 0, half, all)")
    g.add_argument("--coef", type=float, default=0.1, help="lambda of the feedback arm")
    g.add_argument("--jobs", type=int, default=2, help="runs at once (threads split between them)")
    g.add_argument("--start", default=None, help="a pretraining checkpoint to start from (default: pretrain "
                   "into OUT/pretrain once)")
    g.add_argument("--out", default="out-ablation", help="folder for the runs")
    a, extra = ap.parse_known_args()
    if a.ablation:  # any other flag goes to every train.py run (the pretraining's too)
        if a.seeds < 1 or a.rl_steps < 1 or a.jobs < 1:
            raise SystemExit("error: --seeds, --rl-steps and --jobs must be >= 1")
        print_ablation(ablation(a.ablation, a.seeds, a.rl_steps, a.out, a.coef, a.jobs, a.start, extra),
                       a.ablation)
        raise SystemExit
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    # 1) a tiny model that knows the format: gold transcripts, some with a mistake (an absent tool, its error,
    #    the fix) and some with the reminder as a system turn before a call (always followed by a valid call)
    docs = [encode(render(gold_transcript(make_tool_task(rng, rng.randint(1, 2)), rng,
                                          p_mistake=0.3, p_hint=0.3)),
                   specials=True) for _ in range(3000)]
    data = torch.tensor([i for d in docs for i in d])
    model = Transformer(PRESETS["tiny"])
    opt = Muon(param_groups(model.named_parameters(), lr=4e-3, weight_decay=0.1),
               adjust_lr_fn="match_rms_adamw")
    t0 = time.perf_counter()
    for step in range(a.pretrain_steps):
        ix = torch.randint(len(data) - 129, (16,))
        xy = torch.stack([data[i:i + 129] for i in ix])
        _, loss = model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"pretrained {a.pretrain_steps} steps on tool transcripts in {time.perf_counter() - t0:.0f} s, "
          f"loss {loss.item():.3f}")
    # 2) a rollout where the policy called an absent tool: the student's context vs the hinted teacher's
    task = make_tool_task(random.Random(a.seed + 1), 1)
    absent = next(n for n in TOOLS if n not in task.tools)
    first = [("user", task.question)]
    ctx = [tok for role, text in first for tok in BYTES.turn(role, text)] + BYTES.opens["assistant"]
    bad = encode(f"call {absent}(1,2)") + [BYTES.end]
    seg = Segment(messages=first + [("assistant", f"call {absent}(1,2)")])
    seg.add(ctx)
    seg.add(bad, policy=True, logps=[0.0] * len(bad))
    error = f"error: tool not found: {absent}. available tools: {', '.join(task.tools)}"
    traj = Trajectory([seg], turns=first + [("assistant", f"call {absent}(1,2)"), ("tool", error)],
                      spans=[(0, len(ctx), len(ctx) + len(bad))],
                      openings=[(len(ctx) - len(BYTES.opens["assistant"]), len(first), len(first), None)])
    hint = tool_not_found(f"call {absent}(1,2)", error, first)
    offered = [n for n in TOOLS if n in task.tools]

    @torch.no_grad()
    def p_tools(model, context):
        """P(the next call names each tool): the product of the name's byte probabilities after 'call '."""
        names = list(TOOLS)
        seqs = [context + encode("call " + n + "(") for n in names]
        T = max(map(len, seqs))
        logits, _ = model(torch.tensor([q + [BYTES.pad] * (T - len(q)) for q in seqs]))
        logp = logits.log_softmax(-1)
        start = len(context) + len(encode("call "))
        return {n: logp[i, start - 1 + torch.arange(len(n) + 1),
                        torch.tensor(seqs[i][start:start + len(n) + 1])]
                .sum().exp().item() for i, n in enumerate(names)}

    def split(p):
        return sum(v for n, v in p.items() if n not in offered), sum(v for n, v in p.items() if n in offered)

    student = split(p_tools(model, ctx))
    teacher = split(p_tools(model, ctx[:-1] + BYTES.turn("system", hint) + ctx[-1:]))
    print(f"question: {task.question!r} | the policy wrote 'call {absent} ...' -> {error!r}")
    print(f"hint: {hint!r}")
    print(f"P(next call names an absent tool):  student {student[0]:.3f}  teacher {teacher[0]:.3f}")
    print(f"P(next call names an offered tool): student {student[1]:.3f}  teacher {teacher[1]:.3f}")
    # 3) one update on the feedback loss alone moves the student toward the teacher at that turn
    fb = Feedback(model, FeedbackConfig())  # a frozen teacher: the policy as it is now
    sgd = torch.optim.SGD(model.parameters(), lr=a.lr)
    loss, stats = fb.loss(model, [traj], norm=len(bad), targets=fb.targets(model, [traj]))
    loss.backward()
    sgd.step()
    after = split(p_tools(model, ctx))
    _, stats_after = fb.loss(model, [traj], norm=len(bad), targets=fb.targets(model, [traj]))
    print(f"after one SGD step (lr {a.lr}) on L_fb: KL(student || teacher) on the message "
          f"{stats['feedback_kl']:.4f} -> {stats_after['feedback_kl']:.4f}; "
          f"student P(absent) {student[0]:.3f} -> {after[0]:.3f}, "
          f"P(offered) {student[1]:.3f} -> {after[1]:.3f}")
