"""Targeted RL with textual feedback: a hinted teacher and an on-policy KL at one turn (Composer 2.5).

A trajectory-level reward says little about which of hundreds of messages went wrong. So at a target message
(picked by a rule: it called a tool the episode does not offer, it was malformed) we write a short hint about
the wanted improvement and insert it into the local context just before that message. The policy under the
hinted context is the teacher, the same policy under the original context is the student, and the student is
pulled toward the teacher on that message's tokens only: per-token reverse KL(student || teacher) over the full
vocabulary (or a sampled-token estimator), teacher under no_grad, added to the RL loss as L_RL + lambda * L_fb.
The same self-distillation primitive appears in arXiv 2601.19897, 2601.20802 and 2601.18734 (cited by the post).

    python feedback.py      # the seed's "tool not found" example on a tiny model pretrained on tool transcripts
"""
import copy
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo import rows as grpo_rows, turn_tokens
from model import TOKEN
from tasks import FORMAT_REMINDER, reminder


@dataclass
class FeedbackConfig:
    coef: float = 0.1  # lambda; 0 reproduces pure RL exactly (the term is not even computed)
    estimator: str = "full"  # "full": exact KL over the vocabulary; "sampled": the sampled-token estimator
    teacher: str = "current"  # "current" policy (the seed's choice), "frozen" copy, or "ema" of the policy
    ema_decay: float = 0.99


# -----------------------------------------------------------------------------
# Rules: (name, detector) pairs; a detector reads the environment's reply to an assistant turn and returns a
# hint for that turn, or None


def tool_not_found(reply):
    m = re.match(r"error: tool not found: \w+\. available tools: (.*)", reply or "")
    return reminder(m.group(1).split(", ")) if m else None


def malformed(reply):
    return FORMAT_REMINDER if (reply or "").startswith("error: malformed") else None


RULES = [("tool_not_found", tool_not_found), ("malformed", malformed)]


def find_targets(traj, rules=RULES):
    """-> [(segment, start, end, hint, rule name)] for each assistant message a rule flags."""
    assistant = [i for i, (role, _) in enumerate(traj.turns) if role == "assistant"]
    targets = []
    for k, i in enumerate(assistant):
        reply = traj.turns[i + 1][1] if i + 1 < len(traj.turns) and traj.turns[i + 1][0] == "tool" else None
        for name, rule in rules:
            hint = rule(reply)
            if hint is not None and k < len(traj.spans) and traj.spans[k][1] < traj.spans[k][2]:  # not empty
                targets.append((*traj.spans[k], hint, name))
                break
    return targets


# -----------------------------------------------------------------------------
# The loss


def message_kl(s_logits, t_logits, tokens, estimator="full"):
    """KL(student || teacher) on one message's L tokens. s_logits (with grad), t_logits: [L, V], each row
    predicting tokens [L]. "full": sum_v p_s (log p_s - log p_t) per token, exact. "sampled": the student
    sampled `tokens`, so (log p_s(x) - log p_t(x)) estimates the KL and, as a score-function weight on
    log p_s(x), its gradient. -> (loss to backprop [L], KL value [L])"""
    s, t = F.log_softmax(s_logits.float(), -1), F.log_softmax(t_logits.float(), -1).detach()
    if estimator == "full":
        kl = (s.exp() * (s - t)).sum(-1)
        return kl, kl.detach()
    s_x, t_x = s.gather(-1, tokens[:, None]).squeeze(-1), t.gather(-1, tokens[:, None]).squeeze(-1)
    return (s_x - t_x).detach() * s_x, (s_x - t_x).detach()


class Feedback:
    """The feedback term: finds targets in a batch of trajectories, builds student and teacher contexts, and
    returns lambda-free L_fb (sum over target tokens / norm, the RL loss's constant)."""

    def __init__(self, policy, cfg: FeedbackConfig, rules=RULES):
        self.cfg, self.rules = cfg, rules
        self.teacher = None if cfg.teacher == "current" else copy.deepcopy(policy).requires_grad_(False)

    @torch.no_grad()
    def update(self, policy):
        """After each optimizer step: the EMA teacher follows the policy (frozen and current need nothing)."""
        if self.cfg.teacher == "ema":
            for t, p in zip(self.teacher.parameters(), policy.parameters()):
                t.lerp_(p, 1 - self.cfg.ema_decay)

    def loss(self, policy, trajs, norm, logits=None, current=None):
        """-> (L_fb, stats). The hint goes in as a system turn right before the message's role token, so the
        teacher's message tokens sit len(hint tokens) later than the student's: positions are shifted to match.
        logits: grpo_loss's [S, T-1, V] over grpo.batch(trajs); a target message is a prefix of its segment, so
        under causal attention the student's logits are already there and cost no forward of their own.
        current: a copy of the current policy that runs alone (under FSDP, the gathered sampler copy), for the
        teacher's no-grad forward; default the policy itself."""
        rows = {id(s): r for r, (_, s) in enumerate(grpo_rows(trajs))}
        students, teachers, spans = [], [], []
        counts = {name: 0 for name, _ in self.rules}
        for t in trajs:
            for seg, start, end, hint, name in find_targets(t, self.rules):
                tokens = t.segments[seg].tokens
                h = turn_tokens("system", hint) if hint else []
                students.append((rows[id(t.segments[seg])], tokens[:end]))
                teachers.append(tokens[:start - 1] + h + tokens[start - 1:end])  # start - 1: <|assistant|>
                spans.append((start, end, len(h)))
                counts[name] += 1
        pad = lambda seqs: torch.tensor([s + [TOKEN["<|pad|>"]] * (max(map(len, seqs)) - len(s)) for s in seqs])
        if not students:
            zero = logits.sum() * 0 if logits is not None else sum(p.sum() * 0 for p in policy.parameters())
            return zero, {"feedback_kl": 0.0, "feedback_targets": 0, **counts}
        if logits is None:
            s_logits, _ = policy(pad([s for _, s in students]))
        else:
            s_logits = logits[torch.tensor([r for r, _ in students])]
        teacher = self.teacher or current or policy
        was_training = teacher.training
        with torch.no_grad():  # in eval mode: the teacher's pass must not count toward the router's expert loads
            t_logits, _ = teacher.eval()(pad(teachers))
        teacher.train(was_training)
        losses, kls = [], []
        for i, (start, end, h) in enumerate(spans):  # logits at position p predict token p + 1
            tokens = torch.tensor(students[i][1][start:end])
            loss, kl = message_kl(s_logits[i, start - 1:end - 1], t_logits[i, start - 1 + h:end - 1 + h], tokens,
                                  self.cfg.estimator)
            losses.append(loss.sum())
            kls.append(kl)
        kls = torch.cat(kls)
        return sum(losses) / norm, {"feedback_kl": kls.mean().item(), "feedback_targets": len(spans), **counts}


if __name__ == "__main__":
    import argparse
    import random
    import time
    from grpo import Segment, Trajectory
    from model import PRESETS, Transformer, encode
    from muon import Muon, param_groups
    from tasks import TOOLS, gold_transcript, make_tool_task, render
    ap = argparse.ArgumentParser(description="The seed's 'tool not found' example on a tiny model.")
    ap.add_argument("--pretrain-steps", type=int, default=300, help="steps on tool transcripts first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05, help="the one demonstration step's SGD learning rate")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    # 1) a tiny model that knows the format: gold transcripts, some with a mistake (an absent tool, its error,
    #    the fix) and some with the reminder as a system turn before a call (always followed by a valid call)
    docs = [encode(render(gold_transcript(make_tool_task(rng, rng.randint(1, 2)), rng, p_mistake=0.3, p_hint=0.3)),
                   specials=True) for _ in range(3000)]
    data = torch.tensor([i for d in docs for i in d])
    model = Transformer(PRESETS["tiny"])
    opt = Muon(param_groups(model.named_parameters(), lr=4e-3, weight_decay=0.1), adjust_lr_fn="match_rms_adamw")
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
    ctx = [tok for role, text in first for tok in turn_tokens(role, text)] + [TOKEN["<|assistant|>"]]
    bad = encode(f"call {absent}(1,2)") + [TOKEN["<|end|>"]]
    seg = Segment()
    seg.add(ctx)
    seg.add(bad, policy=True, logps=[0.0] * len(bad))
    error = f"error: tool not found: {absent}. available tools: {', '.join(task.tools)}"
    traj = Trajectory([seg], turns=first + [("assistant", f"call {absent}(1,2)"), ("tool", error)],
                      spans=[(0, len(ctx), len(ctx) + len(bad))])
    hint = tool_not_found(error)
    offered = [n for n in TOOLS if n in task.tools]

    @torch.no_grad()
    def p_tools(model, context):
        """P(the next call names each tool): the product of the name's byte probabilities after 'call '."""
        names = list(TOOLS)
        seqs = [context + encode("call " + n + "(") for n in names]
        T = max(map(len, seqs))
        logits, _ = model(torch.tensor([q + [TOKEN["<|pad|>"]] * (T - len(q)) for q in seqs]))
        logp = logits.log_softmax(-1)
        start = len(context) + len(encode("call "))
        return {n: logp[i, start - 1 + torch.arange(len(n) + 1), torch.tensor(seqs[i][start:start + len(n) + 1])]
                .sum().exp().item() for i, n in enumerate(names)}

    def split(p):
        return sum(v for n, v in p.items() if n not in offered), sum(v for n, v in p.items() if n in offered)

    student = split(p_tools(model, ctx))
    teacher = split(p_tools(model, ctx[:-1] + turn_tokens("system", hint) + ctx[-1:]))
    print(f"question: {task.question!r} | the policy wrote 'call {absent} ...' -> {error!r}")
    print(f"hint: {hint!r}")
    print(f"P(next call names an absent tool):  student {student[0]:.3f}  teacher {teacher[0]:.3f}")
    print(f"P(next call names an offered tool): student {student[1]:.3f}  teacher {teacher[1]:.3f}")
    # 3) one update on the feedback loss alone moves the student toward the teacher at that turn
    fb = Feedback(model, FeedbackConfig())
    sgd = torch.optim.SGD(model.parameters(), lr=a.lr)
    loss, stats = fb.loss(model, [traj], norm=len(bad))
    loss.backward()
    sgd.step()
    after = split(p_tools(model, ctx))
    _, stats_after = fb.loss(model, [traj], norm=len(bad))
    print(f"after one SGD step (lr {a.lr}) on L_fb: KL(student || teacher) on the message {stats['feedback_kl']:.4f}"
          f" -> {stats_after['feedback_kl']:.4f}; student P(absent) {student[0]:.3f} -> {after[0]:.3f}, "
          f"P(offered) {student[1]:.3f} -> {after[1]:.3f}")
