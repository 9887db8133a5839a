"""Dr. GRPO on multi-turn rollouts, with self-summarization and a low-precision sampler: the RL objective
Composer 2 and 2.5 inherit.

The objective. A group of G rollouts of the same task is sampled; each trajectory's advantage is its reward
minus the group's mean reward, with no division by the group's std (Dr. GRPO, "Understanding R1-Zero-Like
Training", arXiv 2503.20783). Every token the policy wrote gets the PPO clipped-ratio loss with separate
low/high epsilons (DAPO's clip-higher, arXiv 2503.14476), for one or more epochs over minibatches of whole
groups; token losses are summed and divided by a constant (trajectories x the max generation length), not by
each sequence's length. Only the policy's own tokens are trained: prompt, tool output and inserted requests
are attended to but masked by a boolean mask built while sampling, never inferred from token ids. A truncated
importance ratio between the trainer's log-probs and those the sampler recorded corrects any mismatch between
the two (an 8-bit sampler, a bf16 trainer, a sampler some policy versions behind; Yao et al. 2025, "truncated
importance sampling"). An optional KL to the starting policy goes in the reward (k1) or the loss (k2, k3).

Sampling. The whole batch is sampled in lockstep with MLA's KV cache (model.KVCache: a row a trajectory, kept
across its turns, so each message prefills only the tokens since the last, then decodes one token a row),
through a tokenizer (this project's bytes, or a released model's: what each turn adds to the chat template's
rendering, the sampled tokens kept as sampled; the tokens where that differs from the whole conversation
encoded at once are counted, `retokenized`). Where the template renders what the policy saw otherwise once
more turns follow (a reasoning template drops an earlier reply's thinking), the next reply starts a new
segment whose context is the template's rendering, as at inference (counted, `rewritten`). When a context
passes its budget the model
is asked to summarize, and the rollout continues from prompt + summary; every segment is trained with the
trajectory's reward (Composer 2 report). Sampling may use a fake-quantised copy of the policy (8-bit blocks,
like MXFP8).

Asynchronous RL. Rollout ranks sample a bounded number of policy versions behind the trainer ranks and send
them their batches (section at the end).

    python grpo.py          # one group of rollouts on tool-use tasks with a fresh tiny model, its loss
"""
import concurrent.futures
import contextlib
import difflib
import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from model import BYTES, KVCache, local


@dataclass
class GRPOConfig:
    group_size: int = 8  # rollouts of the same task
    temperature: float = 1.0
    max_message_tokens: int = 32  # an assistant message is cut here
    max_gen_tokens: int = 128  # L_max: the policy tokens a trajectory may write, and the loss's normaliser
    context_budget: int = 160  # past this many tokens after a reply, the model is asked to summarize (the
    # request and the summary then end the segment: about 256 tokens in all, the tiny preset's context)
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0  # 0: no reference policy needed
    kl_estimator: str = "k1"  # "k1": folded into the reward; "k2", "k3": added to the loss (see kl_estimates)
    sampler_bits: int = 0  # 0: sample with the policy itself; 8: with 8-bit block-quantised weights
    tis_cap: float = 2.0  # truncated importance sampling: weights min(pi_train / pi_sampler, cap)
    # how turns become tokens: model.BYTES (this project's), or a released model's model.HFTokenizer
    tokenizer: object = BYTES


SUMMARY_REQUEST = "Context full. Summarize in one line."
ENV_THREADS = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="env")  # environments' steps


@dataclass
class Segment:
    """One training sequence: tokens [T], policy [T] (True where the policy sampled the token) and the
    sampler's log-prob of each policy token (0 elsewhere)."""
    tokens: list = field(default_factory=list)
    policy: list = field(default_factory=list)
    sampler_logp: list = field(default_factory=list)
    messages: list = field(default_factory=list)  # the conversation the tokens render: (role, text)
    rendered: int = 0  # the messages whose tokens are in tokens; the later ones wait for what follows them
    text: str = ""  # what the tokens stand for: the template's text and the replies, as the policy saw them

    def add(self, ids, policy=False, logps=None):
        self.tokens += ids
        self.policy += [policy] * len(ids)
        self.sampler_logp += logps if logps is not None else [0.0] * len(ids)


@dataclass
class Trajectory:
    segments: list
    reward: float = 0.0
    turns: list = field(default_factory=list)  # (role, text) as the environment read them: feedback's rules
    env: object = None
    prompt: list = field(default_factory=list)  # the first segment's opening tokens, where a summary restarts
    written: int = 0  # policy tokens so far
    done: bool = False
    summarizing: bool = False  # the next message answers the summary request
    spans: list = field(default_factory=list)  # (segment, start, end) of each assistant turn's policy tokens
    # each turn's opening: (the token where what came since the last reply starts, before the generation
    # prompt; the messages whose tokens precede that token; the messages before the turn; the text the tokens
    # before that token stand for)
    openings: list = field(default_factory=list)
    retokenized: int = 0  # tokens where the ids built turn by turn differ from their text encoded at once
    rewritten: int = 0  # segments started because the template rewrote what the policy had seen





def device_of(module):
    """Where a module's parameters live (a sharded one's local shards): what its inputs are built on."""
    return next(module.parameters()).device

# -----------------------------------------------------------------------------
# The objective


def group_advantages(rewards, group_size):
    """Dr. GRPO: reward minus the group mean, no std division. rewards [N] in groups of consecutive G."""
    r = rewards.view(-1, group_size)
    return (r - r.mean(-1, keepdim=True)).view(-1)


def token_logprobs(logits, tokens):
    """logits [N, T-1, V] of a forward over tokens [N, T] minus its last -> log-prob of each next token [N,
    T-1]."""
    return torch.gather(F.log_softmax(logits, -1), -1, tokens[:, 1:, None]).squeeze(-1)


def kl_estimates(logp, ref_logp):
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL divergence").
    As values, k1 and k3 are unbiased, k2 is biased (little while pi is near ref). As losses, differentiated
    through log pi with the samples held fixed, they differ, per token at the states the samples visited:
    there E_pi[grad k2] = grad KL(pi || ref) and E_pi[grad k3] = grad KL(ref || pi), the other direction, and
    E_pi[grad k1] = 0 (so k1 goes in the reward). None of them is the gradient of the sequence-level KL (that
    would also move which states are visited), and the loss gives them no importance weight, so under a stale
    or 8-bit sampler the samples are not pi's and the expectations hold only approximately."""
    d = ref_logp - logp
    return {"k1": -d, "k2": 0.5 * d ** 2, "k3": d.exp() - d - 1}


def policy_loss(logp, old_logp, sampler_logp, adv, mask, cfg, norm):
    """The Dr. GRPO token loss, summed and divided by the constant `norm`. logp (with grad), old_logp (the
    trainer's log-probs when the batch was sampled), sampler_logp, mask: [N, T]; adv: [N].
    Returns the loss and the fraction of policy tokens whose ratio is outside [1 - eps_low, 1 + eps_high],
    whether or not min() took the clipped term there (it does only where the advantage's sign makes the
    clipped term the smaller)."""
    ratio = (logp - old_logp).exp()
    tis = (old_logp - sampler_logp).exp().clamp(max=cfg.tis_cap)  # ~1 where sampler and trainer agree
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a) * tis
    loss = (per_token * mask).sum() / norm
    clipped = ((ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)) & (mask > 0)
    return loss, clipped.sum().item() / max(1, mask.sum().item())


def rows(trajs):
    """The training sequences of a batch, in order: (trajectory index, segment) for each segment the policy
    wrote in."""
    return [(i, s) for i, t in enumerate(trajs) for s in t.segments if any(s.policy)]


def batch(trajs, device=None, pad_id=BYTES.pad):
    """Segments as padded tensors on device: tokens [S, T], mask / sampler_logp [S, T-1] aligned with
    next-token log-probs, and the trajectory index of each segment (a trajectory's segments share its
    reward)."""
    segs = rows(trajs)
    T = max(len(s.tokens) for _, s in segs)
    pad = lambda xs, v: xs + [v] * (T - len(xs))
    tokens = torch.tensor([pad(s.tokens, pad_id) for _, s in segs], device=device)
    mask = torch.tensor([pad(s.policy, False) for _, s in segs], device=device)[:, 1:]
    sampler_logp = torch.tensor([pad(s.sampler_logp, 0.0) for _, s in segs], device=device)[:, 1:]
    return tokens, mask, sampler_logp, torch.tensor([i for i, _ in segs], device=device)


def minibatches(trajs, n, group_size):
    """A batch split into n minibatches of whole groups, in order (sizes differ by one group at most)."""
    groups = [trajs[i:i + group_size] for i in range(0, len(trajs), group_size)]
    if len(trajs) % group_size or not 1 <= n <= len(groups):
        raise ValueError(f"{len(trajs)} trajectories in groups of {group_size}: no {n} minibatches")
    return [[t for g in groups[k * len(groups) // n:(k + 1) * len(groups) // n] for t in g] for k in range(n)]


@torch.no_grad()
def logprobs(policy, trajs, cfg):
    """A policy's log-probs [S, T-1] of a minibatch's tokens, at the sampler's temperature, in eval mode (so
    the router counts nothing): grpo_loss's old_logp (the trainer's, before any PPO step on the minibatch) and
    ref_logp (with the reference's Weights loaded), both taken before the training forward."""
    tokens = batch(trajs, device_of(policy), cfg.tokenizer.pad)[0]
    was_training = policy.training
    logits, _ = policy.eval()(tokens[:, :-1])
    policy.train(was_training)
    return token_logprobs(logits / cfg.temperature, tokens)


def grpo_loss(policy, trajs, cfg, ref_logp=None, old_logp=None):
    """L_RL for a list of trajectories (groups of cfg.group_size consecutive ones), one forward of the policy.
    -> (loss, stats, old_logp, logits [S, T-1, V]); pass old_logp back in for further PPO epochs on the same
    batch (or take it from logprobs); ref_logp: the reference policy's logprobs (needed when cfg.kl_coef > 0);
    the logits serve the feedback term's student without a forward.
    Log-probs are taken at the sampler's temperature; the returned logits are raw (T = 1), and the feedback
    KL compares student and teacher on those."""
    tokens, mask, sampler_logp, owner = batch(trajs, device_of(policy), cfg.tokenizer.pad)
    logits, _ = policy(tokens[:, :-1])
    logp = token_logprobs(logits / cfg.temperature, tokens)
    if old_logp is None:
        old_logp = logp.detach()
    rewards = torch.tensor([t.reward for t in trajs], device=logp.device)
    kl = torch.zeros_like(logp)
    if cfg.kl_coef > 0:
        kl = kl_estimates(logp, ref_logp)[cfg.kl_estimator] * mask
        if cfg.kl_estimator == "k1":  # folded into the reward at the sampled policy: the same in every epoch
            k1 = kl_estimates(old_logp, ref_logp)["k1"] * mask
            rewards = rewards - cfg.kl_coef * rewards.new_zeros(len(trajs)).index_add_(0, owner, k1.sum(-1))
    adv = group_advantages(rewards, cfg.group_size)[owner]
    norm = len(trajs) * cfg.max_gen_tokens
    loss, clip_frac = policy_loss(logp, old_logp, sampler_logp, adv, mask.float(), cfg, norm)
    if cfg.kl_coef > 0 and cfg.kl_estimator != "k1":
        loss = loss + cfg.kl_coef * kl.sum() / norm
    tis = (old_logp - sampler_logp).exp()[mask]  # trainer / sampler on policy tokens, before the cap
    stats = {"reward": rewards.mean().item(), "clip_frac": clip_frac, "kl": (kl.sum() / mask.sum()).item(),
             "gen_tokens": mask.sum().item() / len(trajs), "tis_min": tis.min().item(),
             "tis_max": tis.max().item(), "tis_capped": (tis > cfg.tis_cap).float().mean().item()}
    return loss, stats, old_logp, logits

# -----------------------------------------------------------------------------
# Sampling


class Weights:
    """Another set of values for a model's parameters, held as this rank holds the model: its shards under
    FSDP and EP, whole tensors in one process, so a copy costs 1/world of the model and no rank ever holds a
    whole one. RL keeps its other policies so (the KL reference, a frozen or EMA teacher, the low-precision
    sampler): `with weights.loaded(model):` runs the model itself with these values and puts its own back
    after. Only between optimizer steps, never inside a forward and its backward (autograd saves the weights
    it used). bits: fake-quantised to `bits`-bit integers with a scale for every 32 values of a row
    (MXFP8-like blocks; integer rounding stands in for the fp8 grid); blocks run along the last dim, which no
    layout splits, so the values do not depend on the layout. Buffers are shared (RL leaves the router bias as
    it is)."""

    def __init__(self, model, bits=0, block=32):
        self.bits, self.block = bits, block
        self.tensors = [local(p).detach().clone() for p in model.parameters()]
        self.quantize()

    @torch.no_grad()
    def quantize(self):
        qmax = 2 ** (self.bits - 1) - 1
        for t in self.tensors if self.bits else []:
            if t.ndim >= 2 and t.size(-1) % self.block == 0:
                b = t.view(-1, self.block)
                scale = b.abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
                b.copy_((b / scale).round().clamp(-qmax, qmax) * scale)

    @torch.no_grad()
    def lerp_(self, model, weight):
        """EMA: t <- t + weight * (model - t)."""
        for t, p in zip(self.tensors, model.parameters()):
            t.lerp_(local(p), weight)

    def state_dict(self, model):
        """{parameter name: tensor}, as DTensors placed like the model's parameters where those are DTensors,
        sharing these tensors: what DCP saves, and loads into in place."""
        return {n: DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                      run_check=False) if isinstance(p, DTensor) else t
                for (n, p), t in zip(model.named_parameters(), self.tensors)}

    @contextlib.contextmanager
    def loaded(self, model):
        own = [local(p) for p in model.parameters()]
        saved = [t.clone() for t in own]
        with torch.no_grad():
            for p, t in zip(own, self.tensors):
                p.copy_(t)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, t in zip(own, saved):
                    p.copy_(t)


class Lockstep(nn.Module):
    """Sampling with a sharded model (FSDP all-gathers every unit, EP exchanges tokens): every rank must run
    as many forwards as every other, though its rollouts end sooner or later. Each forward first agrees, in
    one all-reduce, that some rank still works; a rank that is done calls drain(), which runs one-token
    forwards as long as any other rank does, and returns once all are done."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def agree(self, working):
        flag = torch.tensor([float(working)], device=device_of(self.model))
        dist.all_reduce(flag)
        return flag.item() > 0

    def forward(self, idx, pos=None, cache=None):
        self.agree(True)
        return self.model(idx, pos=pos, cache=cache)

    def drain(self):
        while self.agree(False):
            idx = torch.zeros(1, 1, dtype=torch.long, device=device_of(self.model))
            self.model(idx)


@torch.no_grad()
def sample_messages(model, contexts, cfg, gen, limits=None, cache=None):
    """One assistant message for each context (a list of token lists), batched, with MLA's KV cache: one
    prefill of the right-padded contexts, then one token a row per call; finished rows feed padding.
    limits: the most tokens each message may take (default cfg.max_message_tokens). cache: a KVCache that
    already holds the start of each row's context (contexts are then the rest); it ends holding every token
    but each message's last. -> [(token ids incl. the closing <|end|>, log-probs)]"""
    B, pad, device = len(contexts), cfg.tokenizer.pad, device_of(model)
    out = [([], []) for _ in contexts]
    limits = torch.tensor(limits or [cfg.max_message_tokens] * B, device=device)
    live = limits > 0  # [B]
    cache = cache if cache is not None else KVCache(model.cfg.n_layer, B, device=device)
    lens = torch.tensor([len(c) for c in contexts], device=device)
    idx = torch.tensor([c + [pad] * (int(lens.max()) - len(c)) for c in contexts], device=device)  # [B, T]
    logits, _ = model(idx, pos=cache.advance(lens, idx.size(1)), cache=cache)
    last = logits[torch.arange(B, device=device), lens - 1]  # [B, V]
    for n in range(1, cfg.max_message_tokens + 1):
        logp = F.log_softmax(last / cfg.temperature, dim=-1)
        # drawn where the generator lives (the CPU's, seeded per rank): the same draws on any device
        tok = torch.multinomial(logp.exp().to(gen.device), 1, generator=gen).squeeze(1).to(device)  # [B]
        for i in live.nonzero().flatten().tolist():
            out[i][0].append(tok[i].item())
            out[i][1].append(logp[i, tok[i]].item())
        live &= (tok != cfg.tokenizer.end) & (limits > n)
        if not live.any():
            break
        logits, _ = model(torch.where(live, tok, pad)[:, None], pos=cache.advance(live.long(), 1),
                          cache=cache)
        last = logits[:, 0]
    return out


def retokenized(built, whole):
    """Tokens where two id sequences differ: those outside their longest common blocks."""
    if built == whole:
        return 0
    blocks = difflib.SequenceMatcher(None, built, whole, autojunk=False).get_matching_blocks()
    return max(len(built), len(whole)) - sum(b.size for b in blocks)


@torch.no_grad()
@contextlib.contextmanager
def decode_threads(policy):
    """On a CPU, one thread decodes: a token's matmuls are too small to split, and the episodes' test runs and
    verifies take the other cores meanwhile; threads that spin-wait on a busy core made decoding 3x slower."""
    threads = torch.get_num_threads()
    if device_of(policy).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def open_turn(tok, t):
    """Before the policy's next reply in trajectory t: the turns that wait and the generation prompt, as the
    chat template renders them, added to its last segment. Where the template now renders what the policy saw
    otherwise (a reasoning template drops an earlier reply's thinking, or shows text the policy never wrote),
    the reply starts a new segment whose context is the template's rendering, as at inference. -> whether a
    segment started (its cache row starts again)."""
    seg = t.segments[-1]
    opened = tok.render(seg.messages, prompt=True)
    rewrites = not opened.startswith(seg.text)
    if rewrites:
        t.segments.append(Segment(messages=list(seg.messages)))
        del seg.messages[seg.rendered:]  # the waiting turns go with the reply
        seg = t.segments[-1]
        t.rewritten += 1
    t.openings.append((len(seg.tokens), seg.rendered, len(seg.messages), seg.text))
    seg.add(tok.delta(seg.messages[:seg.rendered], seg.messages[seg.rendered:], prompt=True, seen=seg.text))
    seg.text = opened
    return rewrites


def close_turn(tok, seg, ids, logps=None):
    """The policy's sampled ids (and their log-probs) as the segment's next reply, kept as sampled, then what
    the template puts after it (the end token too, where the message was cut). -> (where the reply starts in
    seg.tokens, its text)."""
    ended = bool(ids) and ids[-1] == tok.end
    start, text = len(seg.tokens), tok.decode(ids[:-1] if ended else ids)
    seg.add(ids, True, logps)
    closing, after = tok.closing(seg.text, seg.messages, text, ended)
    seg.add(closing)
    seg.text += text + after
    seg.messages.append(("assistant", text))
    seg.rendered = len(seg.messages)
    return start, text


def finish_turns(tok, t):
    """After the episode: each segment's turns still waiting (after its last reply), unless they would rewrite
    what the policy saw (they are never trained), then the tokens where the ids built turn by turn differ from
    the text they stand for encoded at once (t.retokenized)."""
    for s in t.segments:
        text = tok.render(s.messages)
        if text.startswith(s.text):
            s.add(tok.delta(s.messages[:s.rendered], s.messages[s.rendered:], seen=s.text))
            s.text = text
        else:
            del s.messages[s.rendered:]
        s.rendered = len(s.messages)
    t.retokenized = sum(retokenized(s.tokens, tok.at_once(s)) for s in t.segments)


def env_text(tok, env, text):
    """A reply as its environment reads it: a call in the model's own format (a chat template's, tok.call) as
    the environment's text call, any other reply as the template shows it (a reasoning model's, without its
    thinking)."""
    call = tok.call(text) if hasattr(env, "text_call") else None
    return env.text_call(*call) if call else tok.shown(text)


def rollout(policy, envs, cfg, gen, sharded=False):
    """Run one episode per env, all batched, until each ends or writes max_gen_tokens. -> [Trajectory]
    With cfg.sampler_bits the policy samples with its fake-quantised Weights loaded. sharded: the policy is
    sharded over a process group (FSDP, EP), so every rank calls this together (Lockstep)."""
    quantized, tok = Weights(policy, cfg.sampler_bits) if cfg.sampler_bits else None, cfg.tokenizer
    sampler = Lockstep(policy) if sharded else policy
    was_training = policy.training
    policy.eval()
    with quantized.loaded(policy) if quantized else contextlib.nullcontext(), decode_threads(policy):
        trajs = []
        for env in envs:  # a segment's turns since its last reply wait: the tokens they add are taken with
            # what follows them (the next reply's generation prompt, or the end), as the template renders both
            t = Trajectory([Segment(messages=[*tok.declare(env), *env.first_turns()])], env=env)
            t.turns, t.prompt = list(t.segments[0].messages), tok.delta([], t.segments[0].messages)
            trajs.append(t)
        # one cache row a live trajectory, kept across its messages: each message prefills only what came
        # since the last (its last token, the tool's reply, the role token), not the whole context again
        cache, rows = KVCache(policy.cfg.n_layer, len(trajs), device=device_of(policy)), trajs
        while True:
            live = [t for t in trajs if not t.done]
            if not live:
                break
            cache.keep([i for i, t in enumerate(rows) if not t.done])
            rows = live
            for row, t in enumerate(live):  # the turns that wait, and the generation prompt: the template's
                if open_turn(tok, t):
                    cache.reset(row)
            cached = cache.next_pos.tolist()  # [B] tokens of each row's segment in the cache
            msgs = sample_messages(sampler, [t.segments[-1].tokens[n:] for t, n in zip(live, cached)], cfg,
                                   gen, [min(cfg.max_message_tokens, cfg.max_gen_tokens - t.written)
                                         for t in live], cache=cache)
            stepping = []  # the trajectories whose message goes to their environment
            for row, (t, (ids, logps)) in enumerate(zip(live, msgs)):
                start, text = close_turn(tok, t.segments[-1], ids, logps)
                t.written += len(ids)
                if t.summarizing:  # the summary ends the segment; the next one starts from prompt + summary
                    t.openings.pop()  # no turn of its own
                    t.summarizing, first = False, t.segments[0].messages[:t.openings[0][2]]
                    t.segments.append(Segment(messages=[*first, ("assistant", text)]))
                    cache.reset(row)
                    t.done = t.written >= cfg.max_gen_tokens
                    continue
                t.turns.append(("assistant", env_text(tok, t.env, text)))  # as the environment reads it
                t.spans.append((len(t.segments) - 1, start, start + len(ids)))
                stepping.append(t)
            # the environments answer side by side (a coding episode's test run waits on a subprocess)
            for t, (reply, done) in zip(stepping, ENV_THREADS.map(lambda t: t.env.step(t.turns[-1][1]),
                                                                 stepping)):
                t.done = done
                seg = t.segments[-1]
                if reply is not None:
                    t.turns.append(("tool", reply))
                    seg.messages.append(("tool", reply))
                t.done = t.done or t.written >= cfg.max_gen_tokens
                waiting = seg.messages[seg.rendered:]  # the tokens they would add, counted
                if not t.done and len(seg.tokens) + len(tok.delta(seg.messages[:seg.rendered], waiting)) > \
                        cfg.context_budget:
                    seg.messages.append(("user", SUMMARY_REQUEST))  # environment text: never trained
                    t.summarizing = True
        if sharded:
            sampler.drain()
    for t in trajs:
        finish_turns(tok, t)
    for t, reward in zip(trajs, ENV_THREADS.map(lambda t: t.env.reward(), trajs)):  # verifies side by side
        t.reward = float(reward)
    policy.train(was_training)
    return trajs

# -----------------------------------------------------------------------------
# Asynchronous RL: rollout ranks apart from the trainer ranks (train.py --rollout-ranks K --max-staleness S)
#
# The launch's last K ranks only sample, the others only train; each role is a torch.distributed world of its
# own (mesh.init_distributed), and the two talk over a bridge. After each optimizer step the trainers publish
# the policy. A rollout rank samples step i's groups with policy version max(start, i - 1 - S), so it runs up
# to S steps ahead while the trainers train, and sends every batch, tagged with its version, to the trainer
# rank whose groups they are. The version is fixed by (i, S), not by timing: an asynchronous run is
# reproducible, and S = 0 is synchronous RL exactly where synchronous sampling is fp32 too (CPU, --precision
# fp32); with bf16 FSDP on a GPU the trainers sample in bf16, while the rollout ranks sample from their fp32
# copy, so the two differ by that rounding. The trainer corrects the lag with the truncated
# importance weights it applies anyway (pi_trainer / pi_sampler on each policy token, capped), as Composer 2's
# asynchronous RL corrects its samplers.
#
#   trainers      | sample 1 is awaited | train 1 -> v1 | train 2 -> v2 | train 3 -> v3 | ...
#   rollout ranks | sample 1 (v0) | sample 2 (v0) | sample 3 (v1) | sample 4 (v2) | ...       (S = 1)


class PeerLost(ConnectionError):
    """A rank of the other role stopped: its connection closed."""


class Bridge:
    """Messages between the roles: point to point on a gloo group over every rank of the launch (global ranks;
    the trainer ranks come first). A send returns at once and its buffer is kept until it completes. A peer
    that dies closes its connection, and the next send or wait that involves it raises PeerLost naming it."""
    WEIGHTS, BATCH = 1, 2  # message tags

    def __init__(self, pg, trainers):
        self.pg, self.trainers, self.sending = pg, trainers, []  # sending: (work, buffer, dst) in flight

    def name(self, rank):
        return f"trainer rank {rank}" if rank < self.trainers else f"rollout rank {rank - self.trainers}"

    @contextlib.contextmanager
    def talking_to(self, peer):
        try:
            yield
        except RuntimeError as e:  # gloo: "Connection closed by peer"
            raise PeerLost(f"lost {self.name(peer)} ({str(e).strip().splitlines()[0][:120]})") from None

    def send(self, tensor, dst, tag):
        with self.talking_to(dst):
            self.sending.append((self.pg.send([tensor], dst, tag), tensor, dst))

    def recv(self, tensor, src, tag):
        with self.talking_to(src):
            self.pg.recv([tensor], src, tag).wait()
        return tensor

    def send_object(self, obj, dst):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()]), dst, self.BATCH)
        self.send(data, dst, self.BATCH)

    def recv_object(self, src):
        n = int(self.recv(torch.zeros(1, dtype=torch.long), src, self.BATCH))
        return pickle.loads(self.recv(torch.empty(n, dtype=torch.uint8), src, self.BATCH).numpy().tobytes())

    def flush(self):
        """Wait for every send in flight (the receivers take them in order, whatever they are doing now)."""
        for work, _, dst in self.sending:
            with self.talking_to(dst):
                work.wait()
        self.sending = []


def policy_tensors(model):
    """What a sampler needs of the policy, in a fixed order: every parameter, then the router biases."""
    return list(model.parameters()) + [m.expert_bias for m in model.moe_layers()]


@torch.no_grad()
def pack_policy(model, version, keep=True):
    """-> [1 + n] fp32 on the CPU: the version, then every tensor of policy_tensors whole. Every trainer rank
    calls it together: a sharded tensor is gathered whole (DTensor.full_tensor), one at a time. keep=False
    (the ranks that do not send): take part in the gathers, hold one whole tensor at a time, return None."""
    parts = [torch.tensor([float(version)])]
    for t in policy_tensors(model):
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            parts.append(whole.float().cpu().flatten())
    return torch.cat(parts) if keep else None


@torch.no_grad()
def unpack_policy(model, flat):
    """pack_policy's values into a whole (unsharded) model. -> their version"""
    i = 1
    for t in policy_tensors(model):
        t.copy_(flat[i:i + t.numel()].view_as(t))
        i += t.numel()
    return int(flat[0])


def serve_rollouts(model, bridge, cfg, episodes, difficulty, staleness, me, rollout_ranks, report=None,
                   restore=None):
    """A rollout rank's whole run. Trainer rank 0 first sends where RL starts and ends and the difficulty
    sampler's state. Then, for each RL step: load the policy version the staleness bound allows (versions
    arrive in order from trainer rank 0), sample the groups of each trainer rank this rank serves (trainer t
    is served by rollout rank t % rollout_ranks; me is this one's index), send each trainer its batch, and
    move the difficulty sampler by every trainer rank's rewards in trainer order, as the trainers move theirs
    (gathered over the rollout ranks). episodes(step, t) -> (level, envs, gen): trainer rank t's episodes of
    that step, drawn and seeded as the synchronous loop draws them. report(t) -> what else trainer t is sent
    with its batch (figures only this rank has, such as the time its rewards took, and the state it keeps
    for t, which t's checkpoints save); restore(hello, trainers) loads such state for the trainers served."""
    hello = bridge.recv_object(0)
    start, steps = hello["start"], hello["steps"]
    difficulty.load_state_dict(hello["difficulty"])
    flat, version = torch.empty(1 + sum(t.numel() for t in policy_tensors(model))), None
    served = [t for t in range(bridge.trainers) if t % rollout_ranks == me]
    if restore:
        restore(hello, served)
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        while version is None or version < max(start, step - 1 - staleness):
            version = unpack_policy(model, bridge.recv(flat, 0, Bridge.WEIGHTS))
        waited, rewards = time.perf_counter() - t0, {}
        for t in served:
            t1 = time.perf_counter()
            level, envs, gen = episodes(step, t)
            trajs = rollout(model, envs, cfg, gen)
            rewards[t] = [tr.reward for tr in trajs]
            bridge.send_object({"step": step, "version": version, "level": level, "trajs": trajs,
                                "wait_s": waited, "sample_s": time.perf_counter() - t1,
                                **(report(t) if report else {})}, t)
        if rollout_ranks > 1:
            everyone = [None] * rollout_ranks
            dist.all_gather_object(everyone, rewards)
            rewards = {t: r for part in everyone for t, r in part.items()}
        for t in range(bridge.trainers):
            for r in rewards[t]:
                difficulty.update(level, r)
    bridge.flush()


# -----------------------------------------------------------------------------
# Appendix: running and measuring it

if __name__ == "__main__":
    import random
    from model import PRESETS, Transformer
    from tasks import ToolEnv, make_tool_task
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    cfg = GRPOConfig(group_size=4, sampler_bits=8)
    task = make_tool_task(random.Random(0), 1)
    trajs = rollout(model, [ToolEnv(task) for _ in range(cfg.group_size)], cfg,
                    torch.Generator().manual_seed(0))
    for t in trajs:
        print(f"reward {t.reward:.0f} | {len(t.segments)} segment(s) | " +
              " | ".join(f"{r}: {x[:24]!r}" for r, x in t.turns[:4]))
    loss, stats, _, _ = grpo_loss(model, trajs, cfg)
    print(f"loss {loss.item():.4f} | " + " | ".join(f"{k} {v:.3f}" for k, v in stats.items()))
