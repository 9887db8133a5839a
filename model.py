"""A Kimi-K2-shaped mixture-of-experts transformer, in miniature and at full size.

Composer 2.5 is RL on top of Moonshot's Kimi K2.5 (1.04T total / 32B active parameters), which has the
DeepSeek-V3 architecture: multi-head latent attention (MLA), a first dense layer, then MoE layers with
many small routed experts, top-k sigmoid routing with an auxiliary-loss-free balancing bias, and one
shared expert. Sources: DeepSeek-V3 technical report (arXiv 2412.19437) and its inference/model.py;
Kimi K2 technical report (arXiv 2507.20534) and config.json. Simplification: no multi-token prediction head.
Released checkpoints in the Hugging Face layout (DeepSeek-V3, Kimi K2, Kimi K2.5's text model, Moonlight) load
into it and are written back; transformers' DeepseekV3 gives the same logits. RL writes and reads turns
through a tokenizer: this project's bytes, or a released model's own (HFTokenizer: its tokenizer.json and chat
template, a conversation's tokens taken turn by turn from the template's rendering as multi-turn RL
frameworks take them). Both follow the model, in the section "Released checkpoints": the model comes first.

Two layout choices serve the optimizer (muon.py) and the sharding (mesh.py):
- expert weights are stacked, one tensor per projection, [num_experts, out, in];
- per-head attention projections are 3D [n_head, head_dim, in] (or [n_head, out, head_dim] for wo),
  used through einsum, so a head's block is a plain slice and Muon orthogonalizes it per head.
Two parallel paths switch on when train.py shards the model: expert parallelism (the expert weights are
DTensors sharded over the EP group; tokens travel to their experts and back by all-to-all) and context
parallelism (MLA.cp_group set; each rank holds a chunk of the sequence and gathers the compressed K/V latent).

    python model.py                  # parameter counts of every preset (kimi-k2 on meta), a forward
    python model.py --bench-experts --device cuda  # experts: grouped GEMM against a matmul per expert
    python model.py --bench-decode   # decode tokens/s with the KV cache, absorbed MLA against expanded
"""
import contextlib
import itertools
import json
import math
import operator
import os
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------
# Byte-level tokenizer: 256 byte values plus a few special tokens for chat / tool-use transcripts.

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
TOKEN = {name: 256 + i for i, name in enumerate(SPECIALS)}
VOCAB_SIZE = 256 + len(SPECIALS)  # 264


def encode(text: str, specials=False) -> list[int]:
    """UTF-8 bytes; with specials=True the names in SPECIALS (e.g. "<|user|>") become their single tokens."""
    if not specials:
        return list(text.encode("utf-8"))
    ids = []
    for part in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        ids.extend([TOKEN[part]] if part in TOKEN else part.encode("utf-8"))
    return ids


def decode(ids) -> str:
    out, buf = [], bytearray()
    for i in ids:
        i = int(i)
        if i < 256:
            buf.append(i)
            continue
        out.append(buf.decode("utf-8", errors="replace"))
        buf = bytearray()
        out.append(SPECIALS[i - 256] if i - 256 < len(SPECIALS) else f"<|{i}|>")
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


# A tokenizer as RL uses it: text <-> ids, and a conversation's tokens turn by turn, as the chat format
# renders it (multi-turn RL frameworks build them so): the tokens a turn adds are the rendering of the
# conversation up to that turn minus the rendering before it; a generation prompt opens each reply; the
# policy's sampled tokens are kept as sampled, never re-encoded, and what the format puts after them is
# added. An assistant turn ends with `end`, the token sampling stops on. Messages are (role, text) pairs of
# tasks.render's roles.
ROLES = ("system", "user", "assistant", "tool")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


class ByteTokenizer:
    """This project's: UTF-8 bytes, and SPECIALS for the roles (<|user|> ... <|end|>): a turn is its role's
    token, its text, <|end|>, so what a turn adds never depends on the turns before it."""
    vocab_size, pad, end = VOCAB_SIZE, TOKEN["<|pad|>"], TOKEN["<|end|>"]
    opens = {r: [TOKEN[f"<|{r}|>"]] for r in ROLES}

    def encode(self, text):
        return encode(text)

    def decode(self, ids):  # the text of a message: its role and end tokens are not text
        return decode([i for i in ids if i < 256])

    def turn(self, role, text):
        return self.opens[role] + self.encode(text) + [self.end]

    def delta(self, messages, new, prompt=False, seen=None):
        """The ids that the messages `new` add after `messages` (seen: the text the ids so far stand for,
        where it is not the rendering of messages), and a generation prompt after them if prompt."""
        return [i for role, text in new for i in self.turn(role, text)] + (self.opens["assistant"] if prompt
                                                                           else [])

    def render(self, messages, prompt=False):
        """The conversation's text, its role and end tokens written as their names: what rollout compares
        with what the policy saw (the ids are delta's: a message's text never becomes a special token)."""
        return "".join(f"<|{role}|>{text}<|end|>" for role, text in messages) + ("<|assistant|>" if prompt
                                                                                 else "")

    def closing(self, seen, messages, text, ended):
        """What follows a sampled reply to `messages` (its text; seen: the text the policy saw before it;
        ended: its last sampled token is `end`): (the ids to add, the text they close the reply with)."""
        return ([] if ended else [self.end]), "<|end|>"

    def declare(self, env):  # tools are named in the opening's text
        return []

    def call(self, text):  # calls are text: `call name(args)`
        return None

    def shown(self, text):  # a reply is all the environment's to read
        return text

    def rendered(self, messages, prompt=False):
        """The whole conversation's ids at once: what the ids built turn by turn must equal."""
        return self.delta([], messages, prompt)

    def at_once(self, seg):
        """A segment's text (what its tokens stand for) encoded at once: here, its messages' rendering."""
        return self.rendered(seg.messages)


BYTES = ByteTokenizer()


# -----------------------------------------------------------------------------
# Config and presets


@dataclass
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    dim: int = 128
    n_layer: int = 4
    n_dense_layers: int = 1  # the first layers use a dense SwiGLU FFN instead of MoE
    n_head: int = 4
    # multi-head latent attention (MLA)
    q_lora_rank: int = 64  # 0 = plain query projection
    kv_lora_rank: int = 32  # the compressed K/V latent that is cached (and, under CP, gathered)
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16  # rope part; its key is shared by all heads
    v_head_dim: int = 32
    # feed-forward
    dense_hidden: int = 384
    num_experts: int = 16
    top_k: int = 2
    moe_hidden: int = 128
    n_shared_experts: int = 1
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0  # switch-transformer balance loss; 0 = auxiliary-loss-free only
    bias_update_rate: float = 1e-2  # gamma for the selection-only bias (DeepSeek-V3: 1e-3 over a long run)
    # expert groups: a token picks topk_group groups first, then its experts in them (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    max_seq_len: int = 1024  # a bound only (rope is computed for the positions used); runs use --seq-len
    rope_theta: float = 10000.0
    # YaRN rope scaling (arXiv 2309.00071) as DeepSeek-V3 and Kimi K2 configure it; rope_factor 1 = plain rope
    rope_factor: float = 1.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    norm_eps: float = 1e-6
    init_std: float = 0.02


PRESETS = {
    # the CPU default: 2.9M parameters, 0.8M active
    "tiny": ModelConfig(),
    # one GPU / a patient CPU: 0.1B parameters, 23M active
    "small": ModelConfig(dim=512, n_layer=8, n_head=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                         qk_rope_head_dim=32, v_head_dim=64, dense_hidden=1536, num_experts=32, top_k=4,
                         moe_hidden=256, max_seq_len=1024),
    # mid-size: Moonlight-16B-A3B (config.json), Moonshot's DeepSeek-V3-shaped model trained with Muon
    # (arXiv 2502.16982): 16B parameters, 3B active; no query compression
    "moonlight": ModelConfig(vocab_size=163840, dim=2048, n_layer=27, n_dense_layers=1, n_head=16,
                             q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, dense_hidden=11264, num_experts=64, top_k=6, moe_hidden=1408,
                             n_shared_experts=2, route_scale=2.446, bias_update_rate=1e-3, max_seq_len=8192,
                             rope_theta=50000.0, norm_eps=1e-5),
    # the real shape (Kimi K2 config.json): build it on the meta device
    "kimi-k2": ModelConfig(vocab_size=163840, dim=7168, n_layer=61, n_dense_layers=1, n_head=64,
                           q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                           v_head_dim=128, dense_hidden=18432, num_experts=384, top_k=8, moe_hidden=2048,
                           n_shared_experts=1, route_scale=2.827, bias_update_rate=1e-3, max_seq_len=131072,
                           rope_theta=50000.0, rope_factor=32.0, rope_beta_fast=1.0, rope_beta_slow=1.0,
                           rope_mscale_all_dim=1.0),
}


# -----------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # fp32 under bf16
        return F.rms_norm(x.float(), (x.size(-1),), self.weight.float(), self.eps).type_as(x)


def yarn_mscale(factor, mscale):
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_tables(pos, cfg: ModelConfig):
    """cos/sin [..., T, rope/2] for integer positions pos [..., T] (global positions, so a context-parallel
    slice stays right). YaRN (rope_factor > 1): the low frequencies, which turn fewer than beta_slow times
    over the original context, are divided by the factor (interpolated); the high ones, over beta_fast turns,
    are kept (extrapolated); a linear ramp joins them. cos/sin are scaled by mscale / mscale_all_dim (1 for
    DeepSeek-V3 and Kimi K2), as transformers' _compute_yarn_parameters does."""
    dim, base, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor
    inv_freq = base ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)  # [dim/2]
    attn_factor = 1.0
    if factor > 1:
        turns = lambda n: (dim * math.log(cfg.rope_original_max_seq_len / (n * 2 * math.pi))
                           / (2 * math.log(base)))
        low, high = (max(math.floor(turns(cfg.rope_beta_fast)), 0),
                     min(math.ceil(turns(cfg.rope_beta_slow)), dim - 1))
        ramp = ((torch.arange(dim // 2, device=pos.device) - low)
                / (high - low or 1e-3)).clamp(0, 1)  # 1: interpolate
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        attn_factor = (yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
                       if cfg.rope_mscale and cfg.rope_mscale_all_dim else yarn_mscale(factor, 1.0))
    freqs = pos.float()[..., None] * inv_freq  # [..., T, dim/2]
    return freqs.cos() * attn_factor, freqs.sin() * attn_factor


def apply_rope(x, cos, sin):
    """x [B, H, T, D]; rotate-half form of RoPE."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class MLA(nn.Module):
    """Multi-head latent attention: K and V come from one small latent c_kv [B, T, kv_lora_rank] plus a
    single shared rope key, which is what gets cached and, under context parallelism, gathered.

    Context parallelism (cp_group set): each rank holds T/cp consecutive tokens of every sequence. Gathering
    the latent and rope key costs kv_lora_rank + qk_rope_head_dim numbers a token (576 for Kimi K2), against
    n_head * (qk_head + v_head) = 40960 for the expanded K and V, so we gather the latent and let every rank
    expand it with wkv_b (recomputing the up-projection is cheaper than moving 71x more bytes)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        H, qk_head = cfg.n_head, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.cfg, self.layer_id = cfg, layer_id
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Parameter(torch.empty(H, qk_head, cfg.q_lora_rank))  # per head [qk_head, q_lora]
        else:
            self.wq = nn.Parameter(torch.empty(H, qk_head, cfg.dim))  # per head [qk_head, dim]
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Parameter(torch.empty(H, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank))
        self.wo = nn.Parameter(torch.empty(H, cfg.dim, cfg.v_head_dim))  # per head [dim, v_head]
        # YaRN sharpens the softmax by mscale^2 (about 1.81 for Kimi K2's factor 32)
        self.scale = qk_head ** -0.5
        if cfg.rope_mscale_all_dim:
            self.scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
        self.cp_group = None  # set by train.py for context parallelism
        # QK-Clip: each head's largest logit [H] since a clip
        self.track_max_logit, self.max_logit = False, None

    def forward(self, x, pos, cache=None):
        """x [B, T, C]; pos [T] global positions of these tokens, or [B, T] with a KVCache (rows differ)."""
        cfg = self.cfg
        B, T, C = x.shape
        H, nope, rope, r = cfg.n_head, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = torch.einsum("btr,hdr->bhtd", self.q_norm(self.wq_a(x)), self.wq_b)  # [B, H, T, nope+rope]
        else:
            q = torch.einsum("btc,hdc->bhtd", x, self.wq)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        q_pe = apply_rope(q_pe, *rope_tables(pos[:, None] if pos.ndim == 2 else pos, cfg))  # rows over heads
        # each token's latent, normalised, and its rope key, rotated: what is cached and what CP gathers
        c_kv, k_pe = self.wkv_a(x).split([r, rope], dim=-1)  # [B, T, r], [B, T, rope]
        kv_a, k_pos = torch.cat([self.kv_norm(c_kv), apply_rope(k_pe, *rope_tables(pos, cfg))], -1), pos
        if cache is not None:  # this chunk's latents join the cached ones: [B, S, r + rope], S = cached + T
            kv_a, k_pos = cache.update(self.layer_id, kv_a), cache.k_pos
        if self.cp_group is not None:  # -> [B, S, r + rope], S = T * cp, in sequence order
            kv_a = funcol.all_gather_single(kv_a.contiguous(), 1, self.cp_group)
            k_pos = funcol.all_gather_single(pos, 0, self.cp_group)
        S = kv_a.size(1)
        c_kv, k_pe = kv_a.split([r, rope], dim=-1)
        if cache is not None and cache.absorbs(T, cfg):
            return self._absorbed(q_nope, q_pe, c_kv, kv_a, cache.mask)
        kv = torch.einsum("bsr,hdr->bhsd", c_kv, self.wkv_b)  # [B, H, S, nope+v]: every key, expanded
        k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)
        q, k = (torch.cat([q_nope, q_pe], dim=-1),
                torch.cat([k_nope, k_pe[:, None].expand(B, H, S, rope)], dim=-1))
        if self.track_max_logit and self.training and cache is None:
            self._track_max_logit(q, k, k_pos[None, :] <= pos[:, None])  # causal by position, CP included
        # the fused (flash) kernels take one head size for q, k and v; with v narrower, SDPA falls back to its
        # unfused path (on CPU 2.6x slower at T=640, T^2 memory). So v is padded with zeros, as transformers'
        # DeepSeek-V3 does for flash attention, and the output cut back: the same attention, computed fused.
        # A v wider than q and k pads them instead: zeros add nothing to q.k, and the scale is explicit.
        dv = cfg.v_head_dim
        if dv < q.size(-1):
            v = F.pad(v, (0, q.size(-1) - dv))  # [B, H, S, nope+rope]
        elif dv > q.size(-1):
            q, k = F.pad(q, (0, dv - q.size(-1))), F.pad(k, (0, dv - k.size(-1)))  # [B, H, T|S, v]
        if cache is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, scale=self.scale)
        elif self.cp_group is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # causal by global position: a query sees the keys at or before it, wherever they were computed
            mask = k_pos[None, :] <= pos[:, None]  # [T, S]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return torch.einsum("bhtv,hcv->btc", y[..., :dv], self.wo)  # y [B, H, T, v]

    def _absorbed(self, q_nope, q_pe, c_kv, kv_a, mask):
        """Weight-absorbed attention (DeepSeek-V2 sec. 2.1.2, as DeepSeek-V3's inference code decodes):
        wkv_b's key half folds into the query and its value half into the output, so the queries attend to the
        cached latents themselves, one shared key and value for all heads, and nothing grows with S but the
        two products with the cache. q_nope [B, H, T, nope], q_pe [B, H, T, rope] (rotated), c_kv [B, S, r],
        kv_a [B, S, r + rope] (latent and rotated rope key), mask [B, 1, T, S]. -> [B, T, C]"""
        # [H, nope|v, r]
        w_uk, w_uv = self.wkv_b.split([self.cfg.qk_nope_head_dim, self.cfg.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk), q_pe], dim=-1)  # [B, H, T, r + rope]
        scores = torch.einsum("bhte,bse->bhts", q, kv_a) * self.scale  # q_nope.k_nope + q_pe.k_pe, per head
        p = scores.float().masked_fill(~mask, -math.inf).softmax(-1).type_as(q)  # [B, H, T, S]
        y = torch.einsum("bhts,bsr->bhtr", p, c_kv)  # [B, H, T, r]: the attended latent of each head
        return torch.einsum("bhtv,hcv->btc", torch.einsum("bhtr,hvr->bhtv", y, w_uv), self.wo)

    @torch.no_grad()
    def _track_max_logit(self, q, k, allowed, chunk=256):
        """Each head's largest pre-softmax logit q.k * scale over the positions attention may see (allowed
        [T, S]), queries in chunks so that at most [B, H, chunk, S] scores exist at once."""
        m = q.new_full((q.size(1),), -math.inf, dtype=torch.float32)
        for t0 in range(0, q.size(2), chunk):
            s = torch.einsum("bhtd,bhsd->bhts", q[:, :, t0:t0 + chunk], k).float() * self.scale
            m = torch.maximum(m, s.masked_fill(~allowed[t0:t0 + chunk], -math.inf).amax(dim=(0, 2, 3)))
        self.max_logit = m if self.max_logit is None else torch.maximum(self.max_logit, m)

    @torch.no_grad()
    def clip_heads(self, gamma):
        """QK-Clip for MLA (Kimi K2 report, sec. 2.1): scale head h's logits by gamma[h] [H] through its own
        weights: the head-specific query and key components (q_nope, k_nope) by sqrt(gamma), the query's rope
        part by gamma, the rope key shared by all heads untouched. On a sharded weight each rank scales its
        own block (heads and rows by their global index)."""
        nope, root = self.cfg.qk_nope_head_dim, gamma.sqrt()[:, None]  # [H, 1]
        q_scale = torch.cat([root.expand(-1, nope), gamma[:, None].expand(-1, self.cfg.qk_rope_head_dim)], 1)
        kv_scale = torch.cat([root.expand(-1, nope),
                              torch.ones_like(root).expand(-1, self.cfg.v_head_dim)], 1)
        for w, scale in ((self.wq_b if self.cfg.q_lora_rank else self.wq, q_scale), (self.wkv_b, kv_scale)):
            (shape, offset), mine = box(w), local(w)  # scale [H, rows of a head] -> this rank's block
            mine.mul_(scale[offset[0]:offset[0] + shape[0],
                            offset[1]:offset[1] + shape[1], None].to(mine.dtype))


class KVCache:
    """MLA's decode cache: per layer the normalised latent and rotated rope key of every token so far, [B, S,
    kv_lora + rope] (576 numbers a token for Kimi K2, against 40,960 for expanded K and V). Short chunks (a
    decode step) attend to it with the weights absorbed (MLA._absorbed); long ones (a prefill) expand K and V
    from it, whichever takes fewer FLOPs (absorbs). Rows advance independently: in a chunk [B, T] row b holds
    lens[b] real tokens and then padding, which is stored but never attended to, so ragged prompts, one-token
    decode steps and finished rows share a batch. The buffers are preallocated and double when full, so a
    token costs O(S) to attend, not O(S) to copy the cache as well. expand=True: always expand (the reference
    the absorbed path is tested and timed against)."""

    def __init__(self, n_layer, B, device=None, capacity=256, expand=False):
        self.latents = [None] * n_layer  # [B, capacity, kv_lora + rope] each, allocated at first use
        self.S, self.expand = 0, expand  # tokens cached per row, padding included
        self.next_pos = torch.zeros(B, dtype=torch.long, device=device)  # [B] each row's next position
        self.pos_buf = torch.zeros(B, capacity, dtype=torch.long, device=device)  # [B, capacity] each key's
        # [B, capacity] False: padding
        self.real_buf = torch.zeros(B, capacity, dtype=torch.bool, device=device)
        self.mask = None

    @property
    def k_pos(self):
        return self.pos_buf[:, :self.S]  # [B, S]

    def advance(self, lens, T):
        """Register the next chunk of T tokens, row b's first lens[b] real. -> their positions [B, T]"""
        pos = self.next_pos[:, None] + torch.arange(T, device=lens.device)
        S0, self.S = self.S, self.S + T
        self.pos_buf, self.real_buf = grow(self.pos_buf, self.S), grow(self.real_buf, self.S)
        self.pos_buf[:, S0:self.S] = pos
        self.real_buf[:, S0:self.S] = torch.arange(T, device=lens.device) < lens[:, None]
        self.next_pos = self.next_pos + lens
        # a query sees the real keys at or before its position (a padding query sees earlier ones: never
        # empty)
        real = self.real_buf[:, :self.S]
        self.mask = (real[:, None, :] & (self.k_pos[:, None, :] <= pos[:, :, None]))[:, None]  # [B, 1, T, S]
        return pos

    def update(self, layer, kv_a):
        """Write this chunk's kv_a [B, T, kv_lora + rope] at the end of the layer's cache. -> [B, S, ...]"""
        buf = self.latents[layer]
        if buf is None:
            buf = kv_a.new_zeros(kv_a.size(0), self.pos_buf.size(1), kv_a.size(2))
        self.latents[layer] = buf = grow(buf, self.S)
        buf[:, self.S - kv_a.size(1):self.S] = kv_a
        return buf[:, :self.S]

    def keep(self, rows):
        """Keep only these rows (a list of row indices, in their new order), each with its real tokens packed
        to the front in their order, so the cache is as long as its longest row, not as all chunks so far. A
        multi-turn rollout keeps its cache across messages this way: finished rows leave the batch, and the
        padding of earlier chunks goes."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.next_pos.device)
        real = self.real_buf[rows, :self.S]  # [R, S]
        counts = real.sum(1)  # [R]
        self.S = int(counts.max()) if len(rows) else 0
        cols = torch.argsort((~real).int(), dim=1, stable=True)[:, :self.S]  # [R, S'] real columns first
        self.pos_buf = self.pos_buf[rows].gather(1, cols)
        self.real_buf = torch.arange(self.S, device=rows.device) < counts[:, None]
        self.latents = [None if buf is None else
                        buf[rows].gather(1, cols[..., None].expand(-1, -1, buf.size(2)))  # [R, S', r + rope]
                        for buf in self.latents]
        self.next_pos, self.mask = self.next_pos[rows], None

    def reset(self, row):
        """Forget a row's tokens: its next chunk starts a new context at position 0 (a rollout that continues
        from its summary)."""
        self.real_buf[row] = False
        self.next_pos[row] = 0

    def absorbs(self, T, cfg):
        """Absorbed attention for a chunk of T queries where it takes fewer FLOPs than expanding the keys: per
        (query, key) and head it multiplies over r + rope and r, against nope + rope and v, and it saves
        expanding each key, (nope + v) r a head (Kimi K2: absorbed below 171 queries; the tiny preset:
        always)."""
        r, nope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
        return not self.expand and T * (2 * r - nope - v) < (nope + v) * r


def grow(buf, n):
    """buf [B, capacity, ...] with room for n along dim 1, doubling its capacity when it has not."""
    if buf.size(1) >= n:
        return buf
    bigger = buf.new_zeros(buf.size(0), max(n, 2 * buf.size(1)), *buf.shape[2:])
    bigger[:, :buf.size(1)] = buf
    return bigger


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Rows an expert's group is padded to a multiple of, by device type: CUDA's grouped GEMM wants each group to
# start on a 16-byte boundary (8 rows of bf16; torchtitan pads the same way); CPU has no such rule.
ALIGN_M = {"cuda": 8}


def grouped_mm_ok(x, w):
    """torch._grouped_mm runs on CPU (any float dtype; bf16 only under torch.compile) and on CUDA for bf16 on
    sm90+ with 16-byte aligned strides (inner dims a multiple of 8); elsewhere (odd shapes, older GPUs) we
    take the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":  # torch.compile's shape rules for _grouped_mm accept bf16 only
        return x.dtype == w.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return (x.device.type == "cuda" and x.dtype == w.dtype == torch.bfloat16 and
            torch.cuda.get_device_capability(x.device)[0] >= 9 and
            x.size(-1) % 8 == 0 and w.size(-2) % 8 == 0)


def expert_swiglu(xs, counts, w1, w3, w2):
    """SwiGLU of every expert on its rows: xs [N, in] sorted by expert, counts [E] rows each, w [E, out, in].
    Grouped path: one torch._grouped_mm a projection; where the device wants aligned groups (ALIGN_M) each
    expert's rows are first copied into a zero-padded slot starting at a multiple of align, and the padding
    rows are dropped at the end; the padded buffer has a static bound of N + E * (align - 1) rows, so no
    device-to-host sync is needed. Loop path (no grouped GEMM for these shapes): a matmul per expert. -> [N,
    out]"""
    if torch.is_autocast_enabled(xs.device.type):  # autocast does not cover _grouped_mm: cast by hand
        dtype = torch.get_autocast_dtype(xs.device.type)
        xs, w1, w3, w2 = xs.to(dtype), w1.to(dtype), w3.to(dtype), w2.to(dtype)
    if not grouped_mm_ok(xs, w1):
        rows = xs.split(counts.tolist())
        return torch.cat([F.silu(x @ a.T) * (x @ b.T) @ c.T for x, a, b, c in zip(rows, w1, w3, w2)])
    align = ALIGN_M.get(xs.device.type, 1)
    if align > 1:
        padded = (counts + align - 1) // align * align  # [E]
        expert = torch.repeat_interleave(torch.arange(len(counts), device=xs.device), counts,
                                         output_size=len(xs))
        shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # padded start - packed start [E]
        # each row's place in the padded buffer
        dest = torch.arange(len(xs), device=xs.device) + shift[expert]
        xs = xs.new_zeros(len(xs) + len(counts) * (align - 1), xs.size(1)).index_copy(0, dest, xs)
        counts = padded
    offs = counts.cumsum(0).to(torch.int32)
    mm = lambda x, w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    y = mm(F.silu(mm(xs, w1)) * mm(xs, w3), w2)
    return y[dest] if align > 1 else y


class GroupedExperts(nn.Module):
    """num_experts SwiGLU experts as three stacked weights [E, out, in], run as grouped matmuls.

    Expert parallelism: when train.py has sharded the weights over the EP group (DTensors, Shard(0): rank i
    holds experts [i*E/ep, (i+1)*E/ep)), the token copies travel to the rank that holds their expert by
    all_to_all_single (uneven splits: dropless, no capacity factor) and come back the same way. Torch's
    functional collectives carry autograd, so each gradient returns to the rank its token came from."""

    def __init__(self, num_experts, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate  [E, out, in]
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up    [E, out, in]
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # down  [E, out, in]

    def forward(self, xs, counts):
        """xs [M, C]: token copies sorted by expert; counts [E]: rows per expert. -> [M, C] in the same
        order."""
        if not isinstance(self.w1, DTensor):
            return expert_swiglu(xs, counts, self.w1, self.w3, self.w2)
        group, ep = self.w1.device_mesh.get_group(), self.w1.device_mesh.size()
        w1, w3, w2 = self.w1.to_local(), self.w3.to_local(), self.w2.to_local()  # [E/ep, out, in]
        E_local = w1.size(0)
        # tell every peer how many rows it gets for each of its local experts: [ep * E_local], (source,
        # expert)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        recv = recv.view(ep, E_local)
        send_splits, recv_splits = counts.view(ep, E_local).sum(1).tolist(), recv.sum(1).tolist()
        # [R, C] by (source, expert)
        x_recv = funcol.all_to_all_single_autograd(xs, recv_splits, send_splits, group)
        # regroup the received rows by local expert for the grouped matmul, then restore (source, expert)
        # order
        expert_of_row = torch.arange(E_local, device=xs.device).repeat(ep).repeat_interleave(recv.flatten())
        order = expert_of_row.argsort(stable=True)
        y = expert_swiglu(x_recv[order], recv.sum(0), w1, w3, w2)[order.argsort()]
        return funcol.all_to_all_single_autograd(y, send_splits, recv_splits, group)  # [M, C] back home


class MoE(nn.Module):
    """Token-choice top-k routing over stacked experts, DeepSeek-V3 style: sigmoid scores, a selection-only
    bias for auxiliary-loss-free balancing (updated outside autograd from per-expert token counts),
    normalised top-k gates times route_scale, an optional switch auxiliary loss and shared expert(s).
    The auxiliary loss, when enabled, is computed over each rank's own tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E, D, Hd = cfg.num_experts, cfg.dim, cfg.moe_hidden
        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts(E, D, Hd)
        self.shared = SwiGLU(D, Hd * cfg.n_shared_experts) if cfg.n_shared_experts else None
        # used for selection only, never in the gate values
        self.register_buffer("expert_bias", torch.zeros(E))
        # since the last bias update
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)
        # off while activation checkpointing re-runs the forward: those tokens were counted
        self.counting = True

    def forward(self, x):
        cfg = self.cfg
        B, T, C = x.shape
        x = x.reshape(-1, C)  # [N, C]
        scores = torch.sigmoid(self.router(x).float())  # [N, E]
        choice = scores + self.expert_bias  # [N, E]
        if cfg.n_group > 1:  # keep the topk_group groups whose two best experts score highest
            by_group = choice.view(len(x), cfg.n_group, -1)  # [N, G, E/G]
            # [N, topk_group]
            best = by_group.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
            keep = torch.zeros_like(by_group[..., 0], dtype=torch.bool).scatter_(1, best, True)  # [N, G]
            choice = by_group.masked_fill(~keep[..., None], -math.inf).view_as(choice)
        _, idx = torch.topk(choice, cfg.top_k, dim=-1)  # [N, k]: the bias picks experts...
        gates = scores.gather(1, idx)  # ...but the gate values are the unbiased scores
        gates = gates / gates.sum(-1, keepdim=True) * cfg.route_scale
        counts = torch.bincount(idx.flatten(), minlength=cfg.num_experts)  # [E]
        # training tokens only: evaluation and sampling must not move the bias
        if self.training and self.counting:
            self.tokens_per_expert += counts
        aux = x.new_zeros(())
        if cfg.aux_loss_coef > 0 and self.training:  # switch loss: E * sum_e f_e * P_e
            f = counts.float() / idx.numel()
            P = (scores / scores.sum(-1, keepdim=True)).mean(0)
            aux = cfg.aux_loss_coef * cfg.num_experts * (f * P).sum()
        # group the N*k (token, expert) pairs by expert, run the experts, scatter back weighted by the gates
        order = idx.flatten().argsort(stable=True)  # [N*k]
        token = order // cfg.top_k
        ys = self.experts(x[token], counts) * gates.flatten()[order, None].type_as(x)  # [N*k, C]
        out = torch.zeros_like(x).index_add_(0, token, ys)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(B, T, C), aux


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = MLA(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.dense_hidden) if layer_id < cfg.n_dense_layers else MoE(cfg)
        # activation checkpointing: keep only the block's input, recompute the rest in backward
        self.checkpoint = False

    def forward(self, x, pos, cache=None):
        if self.checkpoint and torch.is_grad_enabled() and cache is None:
            return checkpoint(self._forward, x, pos, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), self._recomputing()))
        return self._forward(x, pos, cache)

    @contextlib.contextmanager
    def _recomputing(self):
        self.ffn.counting = False
        try:
            yield
        finally:
            self.ffn.counting = True

    def _forward(self, x, pos, cache=None):
        x = x + self.attn(self.attn_norm(x), pos, cache)
        h = self.ffn(self.ffn_norm(x))
        h, aux = h if isinstance(h, tuple) else (h, x.new_zeros(()))
        return x + h, aux


# -----------------------------------------------------------------------------
# Initial values that do not depend on how the model is sharded


def local(p):
    """A parameter as this rank holds it: its shard under FSDP/EP (a DTensor's local tensor), else itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def box(p):
    """(shape, offset) of the block of a parameter this rank holds: a DTensor's shard, else the whole
    tensor."""
    if isinstance(p, DTensor):
        return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(p.shape), (0,) * p.ndim


def _mix32(x):
    """x: int64 values in [0, 2^32), changed in place into well-mixed 32-bit hashes (murmur3's finalizer; its
    multipliers are below 2^31, so no product leaves int64)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= 0xFFFFFFFF
    x ^= x >> 15
    x *= 0x1B873593
    x &= 0xFFFFFFFF
    x ^= x >> 16
    return x


def normal_at(key: str, full_shape, offset, shape, device=None):
    """Standard normal values of the box [offset, offset + shape) of a tensor of full_shape, each a function
    of (key, its flat index in the full tensor) alone: a counter-based generator (hash the index, then
    Box-Muller), so any shard is made without making the rest. -> float32 tensor of `shape`."""
    k = int(_mix32(torch.tensor(zlib.crc32(key.encode()))))
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(len(full_shape)):  # the flat index in the full tensor, [*shape]
        coord = torch.arange(offset[d], offset[d] + shape[d], device=device)
        idx = idx.unsqueeze(-1) * full_shape[d] + coord
    out = torch.empty(shape, device=device)
    chunk = 1 << 16 if out.device.type == "cpu" else 1 << 24  # CPU: in cache
    for i, o in zip(idx.view(-1).split(chunk), out.view(-1).split(chunk)):
        h = _mix32(_mix32(_mix32(i & 0xFFFFFFFF) ^ k) ^ (i >> 32))  # index mixed, then the key: no two keys
        # give permutations of one set of values
        u1, u2 = (h.float() + 0.5) / 2**32, _mix32(h ^ 0x9E3779B9).float() / 2**32
        torch.mul(torch.sqrt(-2 * torch.log(u1)), torch.cos(2 * math.pi * u2), out=o)
    return out


# -----------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.seed = cfg, int(torch.randint(2**31, (), device="cpu"))  # torch.manual_seed decides it
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if self.embed.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed=None):
        """N(0, init_std) everywhere, output projections scaled down by sqrt(2 n_layer) (GPT-2), norms at 1.

        Each value is a function of (seed, the parameter's name, its index in the whole tensor) alone, so a
        rank that holds a shard (a DTensor: FSDP, EP) computes just its own values, and they are the same for
        every layout and world size. seed None: the one drawn when the model was built (on any device)."""
        std, seed = self.cfg.init_std, self.seed if seed is None else seed
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            scale = std / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("wo", "w2", "w2.weight")) else std
            mine, (shape, offset) = local(p), box(p)
            assert tuple(mine.shape) == tuple(shape), (name, mine.shape, shape)
            mine.copy_(scale * normal_at(f"{seed}:{name}", p.shape, offset, shape, mine.device))
        for m in self.moe_layers():
            m.expert_bias.zero_()
            m.tokens_per_expert.zero_()

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, idx, targets=None, pos=None, reduction="mean", cache=None):
        """idx [B, T] token ids; pos [T] global positions (default 0..T-1; a context-parallel rank passes its
        chunk's), or [B, T] from cache.advance() when decoding with a KVCache; targets [B, T] with -100 =
        ignore. Returns (logits [B, T, V], loss or None); loss includes the switch auxiliary loss when
        enabled."""
        B, T = idx.shape
        if pos is None:
            pos = torch.arange(T, device=idx.device)
        x = self.embed(idx)  # [B, T, C]
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = layer(x, pos, cache)
            aux = aux + a
        logits = self.lm_head(self.norm(x)).float()  # [B, T, V]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                               reduction=reduction)
        return logits, loss + aux if reduction == "mean" else loss

    @torch.no_grad()
    def qk_clip(self, tau, group=None):
        """MuonClip's QK-Clip (Kimi K2 report, sec. 2.1), after each optimizer step: every head whose largest
        logit since the last clip exceeds tau has its query/key weights rescaled by gamma = tau / max, so the
        same inputs would now give tau. The maxima are first taken over `group` (every rank that trains), so
        every shard of a head is scaled alike. -> (the largest logit seen, heads clipped)"""
        attns = [block.attn for block in self.layers]
        H = self.cfg.n_head
        maxes = torch.stack([a.max_logit if a.max_logit is not None else torch.full((H,), -math.inf,
                             device=self.norm.weight.device) for a in attns])  # [L, H]
        if group is not None:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        gamma = torch.where(maxes > tau, tau / maxes, torch.ones_like(maxes))
        for a, g in zip(attns, gamma):
            a.max_logit = None
            if (g < 1).any():
                a.clip_heads(g)
        return maxes.max().item(), int((gamma < 1).sum())

    @torch.no_grad()
    def update_router_bias(self, group=None):
        """Auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2): after each optimizer step, nudge each
        expert's selection bias by -rate*sign(load - mean load). The loads are summed over `group` (all ranks
        that route tokens) first, so every rank moves its bias the same way. Returns the load balance, mean
        over MoE layers of max_load / mean_load (1.0 = perfect), and resets the counts."""
        moes = self.moe_layers()
        if not moes:
            return 1.0
        loads = torch.stack([m.tokens_per_expert for m in moes])  # [L, E]
        if group is not None:
            dist.all_reduce(loads, group=group)
        mean = loads.mean(-1, keepdim=True).clamp(min=1)
        for m, load, mu in zip(moes, loads, mean):
            m.expert_bias += m.cfg.bias_update_rate * torch.sign(mu - load)
            m.tokens_per_expert.zero_()
        return (loads.max(-1, keepdim=True).values / mean).mean().item()


class ContextParallel(nn.Module):
    """Whole sequences through a context-parallel model (its MLA layers' cp_group set), for a trainer whose
    batches arrive as whole rows (RL rollouts) on every rank of the CP group. This rank runs its chunk of the
    T positions (T padded at the end to a multiple of cp: causal, so the padding changes nothing before it),
    attention gathers the K/V latents, and the logits come back whole [B, T, V] through an all-gather with
    autograd. Its backward sums the cp ranks' gradients (of the same loss) into each chunk: cp times the
    gradient, which the FSDP mean over cp times as many ranks as there are data-parallel groups brings back to
    the mean over those groups. The hidden states are split over CP; the vocabulary-sized logits are not."""

    def __init__(self, model, group):
        super().__init__()
        self.model, self.group = model, group

    def forward(self, idx):
        """idx [B, T] -> (logits [B, T, V], None), as the model's forward without targets."""
        cp, k = dist.get_world_size(self.group), dist.get_rank(self.group)
        B, T = idx.shape
        chunk = -(-T // cp)
        idx = F.pad(idx, (0, chunk * cp - T), value=TOKEN["<|pad|>"])[:, k * chunk:(k + 1) * chunk]
        logits, _ = self.model(idx, pos=torch.arange(k * chunk, (k + 1) * chunk, device=idx.device))
        # with autograd; waited here (wait_tensor keeps the graph): at B = 1 the gather comes back lazy (an
        # AsyncCollectiveTensor), and one never read is an unwaited collective that torch reports at exit
        logits = funcol.wait_tensor(funcol.all_gather_single(logits.contiguous(), 1, self.group))
        return logits[:, :T], None


# -----------------------------------------------------------------------------
# Released checkpoints: the Hugging Face layout of DeepSeek-V3-architecture models (DeepSeek-V3, Kimi K2, Kimi
# K2.5's text model, Moonlight), read into this model and written back. config.json maps onto ModelConfig; the
# weights differ from ours in three ways: each expert is its own tensor (ours are stacked [E, out, in]),
# attention projections are 2-D (ours are 3-D, per head), and the rope dimensions are interleaved pairs
# (DeepSeek's reference rotates (x0, x1), (x2, x3), ...; apply_rope rotates (x_i, x_i+d/2)), which one fixed
# permutation of the rope rows turns into each other. Each rank reads only the rows its shards hold:
# safetensors maps the files, and a slice reads just its bytes. Quantized releases are dequantized as they are
# read: fp8 with 128x128 block scales (DeepSeek-V3, Kimi K2) and compressed-tensors' INT4 with a scale a group
# of 32 inputs (Kimi K2.5).

DEEPSEEK_V3 = dict(  # transformers' DeepseekV3Config defaults: what a config.json that omits a field means
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    max_position_embeddings=4096, initializer_range=0.02, rms_norm_eps=1e-6, rope_theta=10000.0)


class CheckpointError(ValueError):
    """A checkpoint folder that does not fit this model; the message is one line naming the file and the
    fix."""


def hf_config(path):
    """DIR/config.json -> (ModelConfig, the text model's config as a dict, what is left out, in words). An
    architecture or a feature this model does not have is refused in one line."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json; --init-from takes a Hugging Face checkpoint folder "
                              "(config.json, *.safetensors)")
    try:
        c = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: not readable JSON ({e})") from None
    left_out, quant = [], c.get("quantization_config")
    # Kimi K2.5: a vision-language model around a DeepSeek-V3 text model
    if isinstance(c.get("text_config"), dict):
        left_out.append(f"the {c.get('model_type')} vision tower and projector (the text model is loaded)")
        c = {**c["text_config"], "weight_prefix": "language_model."}
    arch = c.get("architectures") or []
    if c.get("model_type") not in ("deepseek_v3", "kimi_k2") and "DeepseekV3ForCausalLM" not in arch:
        raise CheckpointError(f"{f}: model_type {c.get('model_type')!r} "
                              f"({', '.join(arch) or 'no architectures'}) is not modelled here; this loads "
                              "DeepSeek-V3-architecture checkpoints (deepseek_v3, kimi_k2, kimi_k25)")
    get = lambda k: c[k] if c.get(k) is not None else DEEPSEEK_V3[k]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    quant = c.get("quantization_config") or quant
    heads, experts = get("num_attention_heads"), get("n_routed_experts")
    refused = [what for bad, what in [
        ((c.get("num_key_value_heads") or heads) != heads, "num_key_value_heads != num_attention_heads"),
        (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r}"),
        (c.get("attention_bias"), "attention_bias"),
        (c.get("tie_word_embeddings"), "tie_word_embeddings"),
        (c.get("norm_topk_prob") is False, "norm_topk_prob false"),
        (c.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {c.get('scoring_func')!r}"),
        (c.get("topk_method", "noaux_tc") != "noaux_tc", f"topk_method {c.get('topk_method')!r}"),
        (c.get("moe_layer_freq", 1) != 1, "moe_layer_freq != 1"),
        (kind not in ("default", "yarn"), f"rope type {kind!r}"),
        (rope.get("truncate") is False or rope.get("attention_factor") is not None,
         "YaRN truncate/attention_factor"),
        (experts % get("n_group"), f"{experts} experts in {get('n_group')} groups"),
        (quant and not quant_supported(quant), f"{(quant or {}).get('quant_method')} quantization "
         f"{json.dumps(quant)[:120]} (dequantize to bf16 first; fp8 block scales and INT4 "
         "pack-quantized load)")]
        if bad]
    if refused:
        raise CheckpointError(f"{f}: not supported here: {', '.join(refused)}")
    mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or 0
    if mtp:
        left_out.append(f"{mtp} multi-token prediction layer(s) "
                        "(inference-time speculation; weights skipped)")
    original = rope.get("original_max_position_embeddings", get("max_position_embeddings"))
    yarn = {} if kind != "yarn" else dict(  # no factor: the ratio of the contexts, as transformers reads it
        rope_factor=rope.get("factor") or get("max_position_embeddings") / original,
        rope_original_max_seq_len=original,
        rope_beta_fast=rope.get("beta_fast") or 32.0, rope_beta_slow=rope.get("beta_slow") or 1.0,
        rope_mscale=rope.get("mscale") or 0.0, rope_mscale_all_dim=rope.get("mscale_all_dim") or 0.0)
    cfg = ModelConfig(
        vocab_size=get("vocab_size"), dim=get("hidden_size"), n_layer=get("num_hidden_layers"),
        n_dense_layers=get("first_k_dense_replace"), n_head=heads,
        q_lora_rank=c.get("q_lora_rank", 1536) or 0, kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"), dense_hidden=get("intermediate_size"),
        num_experts=experts, top_k=get("num_experts_per_tok"), moe_hidden=get("moe_intermediate_size"),
        n_shared_experts=get("n_shared_experts"), route_scale=get("routed_scaling_factor"),
        n_group=get("n_group"), topk_group=get("topk_group"), max_seq_len=get("max_position_embeddings"),
        rope_theta=rope.get("rope_theta", get("rope_theta")), norm_eps=get("rms_norm_eps"),
        init_std=get("initializer_range"), bias_update_rate=1e-3, **yarn)
    c["quantization_config"] = quant
    return cfg, c, left_out


def quant_supported(q):
    """The two quantized release formats this reads: fp8 e4m3 with block scales (DeepSeek-V3, Kimi K2) and
    compressed-tensors' pack-quantized symmetric INT4 weights with group or channel scales (Kimi K2.5)."""
    if q.get("quant_method") == "fp8":
        return True
    groups = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
    return (q.get("quant_method") == "compressed-tensors" and q.get("format") == "pack-quantized" and
            groups and all(w.get("num_bits") == 4 and w.get("type") == "int" and w.get("symmetric") and
                           w.get("strategy") in ("group", "channel") for w in groups) and
            not any(g.get("input_activations") for g in q["config_groups"].values()))


def hf_layout(cfg: ModelConfig, interleaved=True):
    """Our parameter and buffer names -> (checkpoint key, how ours is laid out from it, a row permutation or
    None). Kinds: "same" (rows maybe permuted), "heads" ([H*d, in] -> [H, d, in], each head's rows maybe
    permuted), "wo" ([D, H*v] -> [H, D, v]) and "experts" (E keys [out, in] -> [E, out, in]; "{}" in the key
    is the expert)."""
    r = cfg.qk_rope_head_dim  # interleaved pairs (0, 1), (2, 3), ... -> halves (0, 2, 4, ...), (1, 3, 5, ...)
    rope = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)]) if interleaved else torch.arange(r)
    q_rows = torch.cat([torch.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + rope])
    kv_rows = torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + rope])
    out = {"embed.weight": ("model.embed_tokens.weight", "same", None),
           "norm.weight": ("model.norm.weight", "same", None),
           "lm_head.weight": ("lm_head.weight", "same", None)}
    for i in range(cfg.n_layer):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        ours = {"attn_norm.weight": (f"model.layers.{i}.input_layernorm.weight", "same", None),
                "ffn_norm.weight": (f"model.layers.{i}.post_attention_layernorm.weight", "same", None),
                "attn.wkv_a.weight": (a + "kv_a_proj_with_mqa.weight", "same", kv_rows),
                "attn.kv_norm.weight": (a + "kv_a_layernorm.weight", "same", None),
                "attn.wkv_b": (a + "kv_b_proj.weight", "heads", None),
                "attn.wo": (a + "o_proj.weight", "wo", None)}
        if cfg.q_lora_rank:
            ours.update({"attn.wq_a.weight": (a + "q_a_proj.weight", "same", None),
                         "attn.q_norm.weight": (a + "q_a_layernorm.weight", "same", None),
                         "attn.wq_b": (a + "q_b_proj.weight", "heads", q_rows)})
        else:
            ours["attn.wq"] = (a + "q_proj.weight", "heads", q_rows)
        swiglu = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        if i < cfg.n_dense_layers:
            ours.update({f"ffn.{w}.weight": (f"{m}{hf}.weight", "same", None) for w, hf in swiglu.items()})
        else:
            ours.update({"ffn.router.weight": (m + "gate.weight", "same", None),
                         "ffn.expert_bias": (m + "gate.e_score_correction_bias", "same", None)})
            ours.update({f"ffn.experts.{w}": (m + "experts.{}." + hf + ".weight", "experts", None)
                         for w, hf in swiglu.items()})
            if cfg.n_shared_experts:
                ours.update({f"ffn.shared.{w}.weight": (f"{m}shared_experts.{hf}.weight", "same", None)
                             for w, hf in swiglu.items()})
        out.update({f"layers.{i}.{k}": v for k, v in ours.items()})
    return out


def to_hf(key, kind, rows, t):
    """One of our tensors, whole -> {checkpoint key: tensor} (the inverse of SafetensorsFolder.read_ours)."""
    if kind == "experts":
        return {key.format(e): w for e, w in enumerate(t)}
    if kind == "wo":  # ours [H, D, v] -> [D, H*v]
        return {key: t.transpose(0, 1).reshape(t.size(1), -1)}
    if rows is not None:
        t = t[:, rows.argsort()] if kind == "heads" else t[rows.argsort()]
    return {key: t.reshape(-1, t.size(-1)) if kind == "heads" else t}


def safetensors_torch():
    """The optional safetensors package (its torch API), or one line saying how to install it."""
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError("Hugging Face checkpoints need the safetensors package: "
                              "pip install safetensors") from None
    return safetensors.torch


class SafetensorsFolder:
    """The tensors of a Hugging Face checkpoint folder (model.safetensors.index.json and its shards, or one
    model.safetensors), read by slices; quantized weights come back dequantized (fp8 with block scales,
    INT4)."""

    def __init__(self, path, config: dict):
        self.path, self.open, self.handles = Path(path), safetensors_torch().safe_open, {}
        prefix = config.get("weight_prefix", "")
        self.block = ((config.get("quantization_config") or {}).get("weight_block_size") or [128, 128])
        index, single = self.path / "model.safetensors.index.json", self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
        elif single.is_file():
            weight_map = dict.fromkeys(self._handle(single.name).keys(), single.name)
        else:
            raise CheckpointError(f"{path}: no model.safetensors.index.json or model.safetensors")
        for name in sorted(set(weight_map.values())):
            if not (self.path / name).is_file():
                raise CheckpointError(f"{self.path / name}: missing (model.safetensors.index.json lists it); "
                                      "download the checkpoint again")
        # our key without the prefix -> (file, key in it); transformers 5 saves Kimi K2.5's text layers as
        # "blocks" (its vision tower's rename, reversed), the release as "layers": both load
        self.files = {re.sub(r"^model\.blocks\.", "model.layers.", k.removeprefix(prefix)): (f, k)
                      for k, f in weight_map.items() if k.startswith(prefix)}

    def _handle(self, name):
        if name not in self.handles:
            try:
                self.handles[name] = self.open(self.path / name, framework="pt")
            except Exception as e:  # safetensors' own error type: a truncated or corrupt file
                raise CheckpointError(f"{self.path / name}: not a readable safetensors file ({e})") from None
        return self.handles[name]

    def _slice(self, key):
        name, real = self.files[key]
        return self._handle(name).get_slice(real)

    def where(self, key):
        """'file: key' of a tensor (its packed INT4 form, if that is how it is stored)."""
        key = key if key in self.files or key + "_packed" not in self.files else key + "_packed"
        if key not in self.files:
            raise CheckpointError(f"{self.path}: no tensor {key} (the config.json and the weights disagree, "
                                  "or the download is incomplete)")
        return f"{self.path / self.files[key][0]}: {self.files[key][1]}"

    def shape(self, key):
        self.where(key)
        if key + "_packed" in self.files:  # INT4: the unpacked shape is stored beside it
            return tuple(int(n) for n in self._slice(key + "_shape")[:])
        return tuple(self._slice(key).get_shape())

    def read(self, key, r0=0, r1=None, c0=0, c1=None):
        """Rows [r0, r1) and columns [c0, c1) of a 1-D or 2-D tensor, as float32."""
        shape = self.shape(key)
        r1 = shape[0] if r1 is None else r1
        if len(shape) == 1:
            return self._slice(key)[r0:r1].float()
        c1 = shape[1] if c1 is None else c1
        if key + "_packed" in self.files:
            return self._int4(key, r0, r1, shape[1])[:, c0:c1]
        w = self._slice(key)[r0:r1, c0:c1]
        if key + "_scale_inv" in self.files:  # fp8: one float32 scale a block of weights
            bo, bi = self.block
            s = self._slice(key + "_scale_inv")[r0 // bo:-(-r1 // bo), c0 // bi:-(-c1 // bi)]
            s = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
            return w.float() * s[r0 % bo:r0 % bo + r1 - r0, c0 % bi:c0 % bi + c1 - c0]
        return w.float()

    def _int4(self, key, r0, r1, cols):
        """compressed-tensors' pack-quantized INT4, rows [r0, r1): eight values an int32, the first in the
        lowest bits, each stored as value + 8 (a little-endian host reads byte j as values 2j and 2j+1); one
        scale a group of input columns (a channel: one group)."""
        nibbles = self._slice(key + "_packed")[r0:r1].contiguous().view(torch.uint8)  # [rows, 4 * words]
        # [rows, cols]
        q = torch.stack([nibbles & 15, nibbles >> 4], -1).view(r1 - r0, -1)[:, :cols].float() - 8
        scale = self._slice(key + "_scale")[r0:r1].float()  # [rows, groups]
        return q * scale.repeat_interleave(-(-cols // scale.size(1)), 1)[:, :cols]

    def read_ours(self, key, kind, rows, shape, a, b):
        """Our tensor of full shape `shape`, rows [a, b) of its first dim (every other dim whole), as
        float32."""
        if kind == "experts":
            return torch.stack([self.read(key.format(e)) for e in range(a, b)])
        if kind == "wo":  # [D, H*v] -> [H, D, v]
            _, D, v = shape
            return self.read(key, c0=a * v, c1=b * v).view(D, b - a, v).transpose(0, 1)
        if kind == "heads":  # [H*d, in] -> [H, d, in]
            w = self.read(key, a * shape[1], b * shape[1]).view(b - a, shape[1], -1)
            return w if rows is None else w[:, rows]
        if rows is None:
            return self.read(key, a, b)
        need = rows[a:b]  # a permuted block: read the rows that cover it
        return self.read(key, int(need.min()), int(need.max()) + 1)[need - need.min()]


@torch.no_grad()
def load_hf(model, path):
    """Fill every parameter and buffer of `model` (built from hf_config(path)'s config, materialized on any
    device, sharded or not) from the checkpoint folder; each rank reads only the blocks its shards hold. Every
    shape is checked against the file headers first, so a mismatch is one line before anything is read."""
    _, config, _ = hf_config(path)
    ckpt, layout = SafetensorsFolder(path, config), hf_layout(model.cfg, config.get("rope_interleave", True))
    tensors = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if n in layout}}
    for name, t in tensors.items():
        key, kind, rows = layout[name]
        for k, want in to_hf(key, kind, rows, torch.empty(t.shape, device="meta")).items():
            if ckpt.shape(k) != tuple(want.shape):
                raise CheckpointError(f"{ckpt.where(k)} has shape "
                                      f"{list(ckpt.shape(k))}, config.json means {list(want.shape)}")
    for name, t in tensors.items():
        (shape, offset), mine = box(t), local(t)
        if mine.numel():
            block = ckpt.read_ours(*layout[name], t.shape, offset[0], offset[0] + shape[0])
            mine.copy_(block[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:]))])
    for m in model.moe_layers():
        m.tokens_per_expert.zero_()


def hf_config_dict(cfg: ModelConfig, dtype, base=None):
    """ModelConfig -> a DeepSeek-V3 config.json for transformers, vLLM and SGLang; base (the config a run
    started from) keeps its other fields, such as the special token ids."""
    c = {k: v for k, v in (base or {}).items() if k not in (
        "weight_prefix", "quantization_config", "auto_map", "rope_parameters", "rope_scaling",
        "num_mtp_layers")}
    c.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=cfg.vocab_size,
             hidden_size=cfg.dim, intermediate_size=cfg.dense_hidden, moe_intermediate_size=cfg.moe_hidden,
             num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
             n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.num_experts,
             routed_scaling_factor=cfg.route_scale, kv_lora_rank=cfg.kv_lora_rank,
             q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.qk_rope_head_dim,
             v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
             n_group=cfg.n_group, topk_group=cfg.topk_group, num_experts_per_tok=cfg.top_k,
             first_k_dense_replace=cfg.n_dense_layers, norm_topk_prob=True, hidden_act="silu",
             max_position_embeddings=cfg.max_seq_len, initializer_range=cfg.init_std,
             rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_interleave=True,
             tie_word_embeddings=False, num_nextn_predict_layers=0,
             attention_bias=False, dtype=str(dtype).removeprefix("torch."))
    if cfg.rope_factor > 1:
        c["rope_scaling"] = {"type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.rope_beta_fast,
                             "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale,
                             "mscale_all_dim": cfg.rope_mscale_all_dim,
                             "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return c


@torch.no_grad()
def save_hf(model, path, dtype=torch.bfloat16, base_config=None, shard_bytes=5 * 2**30, extra_files=()):
    """Write the model as a Hugging Face DeepSeek-V3 checkpoint folder: config.json,
    model-0000k-of-0000n.safetensors (about shard_bytes each) and model.safetensors.index.json, with the rope
    rows interleaved as DeepSeek's reference lays them out, and copies of extra_files (the tokenizer's).
    Every rank must call it: a sharded tensor is gathered whole, one at a time; rank 0 writes into path.tmp
    and renames it to path when complete. The router and its bias stay in float32. A file that cannot be
    written raises CheckpointError on every rank, after every rank has done its gathers."""
    save_file = safetensors_torch().save_file
    writer = not dist.is_initialized() or dist.get_rank() == 0
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    layout, files, pending, size, err = hf_layout(model.cfg), [], {}, 0, None

    def write(step):  # rank 0's file work: the first error is kept, and the gathers go on
        nonlocal err
        if writer and err is None:
            try:
                step()
            except Exception as e:  # OSError, or safetensors' own error around one (a full disk)
                err = f"{path}: {e.strerror if isinstance(e, OSError) else str(e).strip().splitlines()[-1]}"

    def flush():
        nonlocal pending, size
        files.append(sorted(pending))
        save_file(pending, tmp / f"part-{len(files)}.safetensors", metadata={"format": "pt"})
        pending, size = {}, 0

    def finish():
        if pending or not files:
            flush()
        weight_map = {}
        for k, keys in enumerate(files, 1):
            name = f"model-{k:05d}-of-{len(files):05d}.safetensors"
            (tmp / f"part-{k}.safetensors").rename(tmp / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(model.cfg, dtype, base_config), indent=2))
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)

    write(lambda: (shutil.rmtree(tmp, ignore_errors=True), tmp.mkdir(parents=True)))
    for name, t in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in layout)]:
        keep = torch.float32 if name.endswith(("router.weight", "expert_bias")) else dtype
        t = t.detach()
        # cast, then gather: the whole tensor exists once a rank, in the export dtype
        if isinstance(t, DTensor):
            t = DTensor.from_local(t.to_local().to(keep), t.device_mesh, t.placements, shape=t.shape,
                                   stride=t.stride()).full_tensor()
        if writer:
            for key, v in to_hf(*layout[name], t.to("cpu", keep)).items():
                pending[key] = v.contiguous()
                size += v.numel() * v.element_size()
            if size >= shard_bytes:
                write(flush)
    write(finish)
    if dist.is_initialized():  # rank 0's verdict, to every rank
        shared = [err]
        dist.broadcast_object_list(shared, src=0)
        err = shared[0]
    if err:
        if writer:  # no partial folder is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(err)


# A released model's tokenizer, for RL on it: its tokenizer.json (the tokenizers package) and its chat template
# (jinja2, compiled as transformers compiles it), the same interface as ByteTokenizer above.

class TokenizerError(ValueError):
    """A checkpoint folder's tokenizer or chat template that RL cannot use: one line."""


def chat_template(template, where, own=False):
    """The template compiled as transformers compiles it: transformers' own environment when it is installed
    (own=False), else the same one built here: sandboxed, trim_blocks and lstrip_blocks, loop controls, the
    {% generation %} tag, tojson without HTML escapes, strftime_now, raise_exception."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise TokenizerError("jinja2 is missing (it renders the chat template): pip install jinja2") from None
    try:
        if not own:
            with contextlib.suppress(ImportError, AttributeError):
                from transformers.utils.chat_template_utils import _compile_jinja_template
                return _compile_jinja_template(template)

        class Generation(jinja2.ext.Extension):  # what the assistant wrote: rendered as it is
            tags = {"generation"}

            def parse(self, parser):
                line = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[
            Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                       sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception, namespace=jinja2.utils.Namespace,
                           strftime_now=lambda f: time.strftime(f))
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{where}: the chat template does not parse ({e})") from None


# how turns RL writes may be rendered where a template has no place for them, the most faithful first: (a
# tool's output as, a hint (a system turn after the opening) as, an opening system turn as, a summary as,
# whether turns of one role in a row are joined into one)
FAITHFUL = ("tool", "system", "system", "assistant", False)
MAPPINGS = sorted(itertools.product(("tool", "user"), ("system", "user"), ("system", "user"),
                                    ("assistant", "user"), (False, True)),
                  key=lambda m: sum(map(operator.ne, m, FAITHFUL)))


TOOL_TURN = ("tool", "QqTOOLqQ")  # a marker text any template keeps as it is


def article(role):
    return ("an " if role == "assistant" else "a ") + role


# -----------------------------------------------------------------------------
# Tool calls in a model's own format: where a template renders an assistant's `tool_calls`, the policy writes
# a call as the template writes one (Qwen's <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
# DeepSeek's, GLM's key and value pairs), the rollout parses it back into (name, arguments) for the
# environment, and the conversation gives the template the call as a structured `tool_calls` entry, the
# environment's tools as its `tools` (as vLLM serves such a model).

NAME = r"(?P<name>[A-Za-z_]\w{0,63})"  # a tool's name in a call
PROBE_NAME, PROBE_ARGS = "QqNAMEqQ", {"QqKEYqQ": "QqVALqQ", "QqK2qQ": "QqV2qQ"}  # markers any template keeps
PROBE_TOOLS = [{"type": "function", "function": {"name": PROBE_NAME, "description": "QqDOCqQ", "parameters": {
    "type": "object", "properties": {k: {"type": "string"} for k in PROBE_ARGS}, "required": []}}}]
# a call's id as templates want it (the id, its pattern): 9 letters or digits (Mistral's), or
# "functions.NAME:N" (Kimi's, whose template writes the name only there)
CALL_IDS = ((lambda name, n: f"{n:09d}", "[A-Za-z0-9]{9}"),
            (lambda name, n: f"functions.{name}:{n}", rf"functions\.{NAME}:\d+"))


class CallFormat:
    """How a chat template writes one tool call, read off its rendering of a call with marker texts (`text`):
    a pattern where the markers were (the name; the arguments as a JSON object, or as key and value pairs
    between the texts the template puts around each; the id) and literal text elsewhere. how: how the
    template takes a call (call_message's); answer: the role of the call's output."""

    def __init__(self, text, how, answer):
        self.how, self.answer, self.pair = how, answer, None
        make_id, id_pattern = CALL_IDS[how[0]]
        spans = self.arguments(text)  # [(start, end, pattern)] of the arguments, then the id and the name
        if spans is None:
            raise ValueError("the template writes a call's arguments neither as JSON nor as pairs")
        free = lambda m: not any(a < m.end() and m.start() < b for a, b, _ in spans)
        for mark, pattern in ((make_id(PROBE_NAME, 0), id_pattern), (PROBE_NAME, NAME)):  # the id first (it
            # may hold the name), then the name where no other part holds it
            spans += [(m.start(), m.end(), pattern) for m in re.finditer(re.escape(mark), text) if free(m)]
        spans, named = sorted(spans), False  # the name's first place captures it, the others repeat it
        for i, (a, b, pattern) in enumerate(spans):
            spans[i] = (a, b, pattern.replace(NAME, "(?P=name)") if named else pattern)
            named = named or NAME in pattern
        if not named:
            raise ValueError("the template writes no call's name")
        out, at = "", 0
        for a, b, pattern in spans:
            out, at = out + re.escape(text[at:a]) + pattern, b
        self.pattern, self.opens = re.compile(out + re.escape(text[at:]), re.S), text[:spans[0][0]]
        if self.parse(text) != (PROBE_NAME, PROBE_ARGS, ""):
            raise ValueError("the template's call does not read back")

    def arguments(self, text):
        """Where the probe's arguments lie in text, as a JSON object, or as key and value pairs (the text
        before a key, between a key and its value, after a value: GLM's <arg_key>k</arg_key>...)."""
        decoder = json.JSONDecoder()
        for m in re.finditer(r"\{", text):
            try:
                value, end = decoder.raw_decode(text, m.start())
            except ValueError:
                continue
            if value == PROBE_ARGS:
                return [(m.start(), end, r"(?P<args>\{.*\})")]
        (k1, v1), (k2, v2) = PROBE_ARGS.items()
        at = [text.find(x) for x in (k1, v1, k2, v2)]
        if -1 in at or at != sorted(at):
            return None
        ends = [a + len(x) for a, x in zip(at, (k1, v1, k2, v2))]
        mid, between, head, tail = text[ends[0]:at[1]], text[ends[1]:at[2]], text[:at[0]], text[ends[3]:]
        pre = between[len(between) - len(os.path.commonprefix([between[::-1], head[::-1]])):]
        post = between[:len(between) - len(pre)]
        if mid != text[ends[2]:at[3]] or not tail.startswith(post) or not pre + mid + post:
            return None
        self.pair = re.compile(f"{re.escape(pre)}(.*?){re.escape(mid)}(.*?){re.escape(post)}", re.S)
        return [(at[0] - len(pre), ends[3] + len(post), "(?P<args>.*)")]  # pairs read by parse

    def parse(self, text):
        """A reply that ends in one call in this format -> (name, arguments, the text before the call), else
        None (a reply in any other words is text for the environment). The call is looked for from the last
        place its opening text appears (one pattern match a place: time linear in the reply's length each)."""
        starts = [i for i in range(len(text)) if text.startswith(self.opens, i)]
        for start in reversed(starts):
            m = self.pattern.match(text, start)
            if m is None or text[m.end():].strip():
                continue
            if self.pair is None:
                try:
                    args = json.loads(m["args"])
                except ValueError:
                    continue
            else:  # key and value pairs, one after another, nothing else
                pairs = list(self.pair.finditer(m["args"]))
                args = {p[1]: p[2] for p in pairs} if "".join(p[0] for p in pairs) == m["args"] else None
            if isinstance(args, dict):
                return m["name"], args, text[:start]
        return None


def call_message(how, content, name, args, n):
    """The assistant turn a template is given for the n-th call of a conversation. how: (the id's form in
    CALL_IDS, whether the arguments are JSON text rather than an object, the content where there is none: ""
    or None, no content at all)."""
    ident, as_json, empty = how
    call = {"type": "function", "id": CALL_IDS[ident][0](name, n),
            "function": {"name": name, "arguments": json.dumps(args) if as_json else args}}
    content = content.rstrip() or empty  # None: no content, as transformers drops a key whose value is None
    return {"role": "assistant", **({} if content is None else {"content": content}), "tool_calls": [call]}


class HFTokenizer(ByteTokenizer):
    """A released model's tokenizer, read from its checkpoint folder: tokenizer.json (through the
    `tokenizers` package) and the chat template of tokenizer_config.json (or chat_template.jinja), rendered
    as transformers renders it. What a turn adds is taken from renderings of the conversation, so a template
    that puts a BOS or a default system turn first, merges the system prompt into the first user turn, or
    opens a reply with a generation prompt unlike its in-conversation opening is followed as it is. Turns RL
    writes that the template has no place for are written, as probing finds, in turns it has (`mapping`: a
    tool's output or a hint as a user turn, a summary as a user turn, turns of one role in a row joined into
    one); a template no such rendering can hold is refused in one line naming why. kwargs: the template's
    variables (`{"enable_thinking": false}`), as vLLM's chat_template_kwargs."""

    def __init__(self, folder, vocab_size=None, kwargs=None):
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json (RL on a released model writes and reads its "
                                 "tokens with the model's own tokenizer)")
        try:
            from tokenizers import Tokenizer as Fast
        except ImportError:
            raise TokenizerError("the tokenizers package is missing: pip install tokenizers") from None
        try:
            self.fast = Fast.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 (the library raises its own exception types)
            raise TokenizerError(f"{folder}/tokenizer.json: not a tokenizer ({e})") from None
        config = json.loads((folder / "tokenizer_config.json").read_text()) \
            if (folder / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise TokenizerError(f"{folder}: no chat template (tokenizer_config.json's chat_template)")
        self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and self.vocab_size > vocab_size:
            raise TokenizerError(f"{folder}/tokenizer.json has {self.vocab_size} tokens but config.json's "
                                 f"vocab_size is {vocab_size}: the tokenizer is not this model's")
        token = lambda k: config[k].get("content") if isinstance(config.get(k), dict) else config.get(k)
        self.template, self.where = chat_template(template, folder), folder
        self.thinks = "</think>" in template  # a reasoning template: a reply's thinking is the model's own
        self.tokens = {**(kwargs or {}), **{k: token(k) for k in ("bos_token", "eos_token")}}
        added = self.fast.get_added_tokens_decoder()  # {id: AddedToken}
        self.specials = {i for i, t in added.items() if t.special}
        self.calls = None  # tool calls as text until the probe finds the template's own format
        self.end = self.probe()
        self.calls = self.call_format()
        pad = token("pad_token") or token("eos_token")
        self.pad = self.fast.token_to_id(pad) if pad and self.fast.token_to_id(pad) is not None else self.end

    def encode(self, text):
        return self.fast.encode(text, add_special_tokens=False).ids

    def decode(self, ids):  # special tokens too: a reasoning model's <think> is the reply's text
        return self.fast.decode(list(ids), skip_special_tokens=False)

    def chat(self, messages, prompt=False):
        """The conversation as the template is given it, in the turns the probe chose: after the opening (the
        system turns and the first user turn) each role as `roles` maps it, an opening system turn as
        `opening`, a summary (a reply that another reply follows) as `restart`, and where `join`, turns of
        one role in a row as one turn; a reply that is a call in the template's format as its `tool_calls`,
        the tool's output after it with the call's id and name. A ("tools", JSON) turn is the template's
        `tools` (render's), no turn. -> [{"role", "content", ...}]"""
        messages = [m for m in messages if m[0] != "tools"]
        first = next((i for i, (role, _) in enumerate(messages) if role != "system"), len(messages))
        msgs: list[dict] = []
        for i, (role, text) in enumerate(messages):
            role = self.roles[role] if i > first else self.opening if role == "system" else role
            follows = messages[i + 1][0] if i + 1 < len(messages) else "assistant" if prompt else None
            if role == "assistant" == follows:
                role = self.restart
            call = self.calls.parse(text) if self.calls and role == "assistant" else None
            if call:
                n = sum("tool_calls" in m for m in msgs)  # the conversation's calls so far
                msgs.append(call_message(self.calls.how, call[2], *call[:2], n))
            elif messages[i][0] == "tool" and self.calls and msgs and "tool_calls" in msgs[-1]:
                called = msgs[-1]["tool_calls"][0]
                msgs.append({"role": self.calls.answer, "content": text, "tool_call_id": called["id"],
                             "name": called["function"]["name"]})
            elif self.join and msgs and msgs[-1]["role"] == role != "assistant":
                msgs[-1]["content"] += "\n\n" + text
            else:
                msgs.append({"role": role, "content": text})
        return msgs

    def render(self, messages, prompt=False):
        """The template's text of a conversation (chat's turns, a ("tools", JSON) turn's tools)."""
        tools = next((json.loads(text) for role, text in messages if role == "tools"), None)
        return self.fill(self.chat(messages, prompt), tools, prompt)

    def fill(self, msgs, tools=None, prompt=False):
        """The template rendered on messages as transformers renders it; TokenizerError where it refuses."""
        import jinja2
        try:
            return self.template.render(messages=msgs, tools=tools, documents=None,
                                        add_generation_prompt=prompt, **self.tokens)
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise TokenizerError(f"{self.where}: the chat template refuses the conversation "
                                 f"{[m['role'] for m in msgs]} ({e})") from None

    def declare(self, env):
        """The turns that declare an environment's tools ([("tools", JSON)]), where calls are in the
        template's format."""
        return [("tools", json.dumps(env.declared()))] if self.calls and hasattr(env, "declared") else []

    def call(self, text):
        """A reply that is a call in the template's own format -> (name, arguments), else None."""
        call = self.calls.parse(text) if self.calls else None
        return call and call[:2]

    def shown(self, text):
        """A reply as the model's user (the environment) reads it: where the template writes thinking blocks,
        the text after the last one's end, as a server's reasoning parser splits a reply."""
        return text.rsplit("</think>", 1)[-1].lstrip("\n") if self.thinks else text

    def call_format(self):
        """How the template writes an assistant's tool call (CallFormat), tried in each way templates take one
        (the id's form, the arguments as an object or as JSON text, no content as "" or none, the call's
        output in the template's tool turn or the turn the probe mapped tool outputs to). None where it writes
        no call, or cannot hold an episode of calls (a call, its output, a user turn, a call, its output, a
        hint; a summary restart's call): a call is text then, `call name(args)`."""
        ways = itertools.product(range(len(CALL_IDS)), (False, True), ("", None))
        for how, answer in itertools.product(ways, dict.fromkeys(("tool", self.roles["tool"]))):
            try:
                text = self.written_call(PROBE_NAME, PROBE_ARGS, how)
                self.calls = CallFormat(text, how, answer)
                a, u, tools = ("assistant", text), ("user", "QqUSER1qQ"), ("tools", json.dumps(PROBE_TOOLS))
                t0, t1 = ("tool", "QqTOOL0qQ"), ("tool", "QqTOOL1qQ")
                hint, summary = ("system", "QqHINTqQ"), ("assistant", "QqSUMMARYqQ")
                for episode in ([u, a, t0, u, a, t1, hint], [u, summary, a, t0]):
                    rendered = self.render([tools, *episode], True)
                    if rendered.count(PROBE_NAME) < episode.count(a) or "QqTOOL0qQ" not in rendered:
                        raise ValueError("the template drops a call of the episode")
                return self.calls
            except (TokenizerError, ValueError):
                self.calls = None
        return None

    def written_call(self, name, args, how=None):
        """The text of a call as the template writes it in a reply: what the call adds to a reply with no
        content, between what precedes a reply and what closes one (or the end token a reply stops on)."""
        user = {"role": "user", "content": "QqUSERqQ"}
        head, closing = self.fill([user, {"role": "assistant", "content": "QqREPLYqQ"}], PROBE_TOOLS).split(
            "QqREPLYqQ")
        called = self.fill([user, call_message(how or self.calls.how, "", name, args, 0)], PROBE_TOOLS)
        start = len(self.common([head, called]))
        text = called[start:len(called) - len(self.common([closing, called[start:]], last=True))]
        return text.split(self.mark, 1)[0]  # a reply stops on its end token

    def added(self, before, after):
        """What the rendering `after` adds to the rendering `before`: the text after their common start (all
        of it past `before` where the template renders the earlier turns alike, as it should)."""
        return after[len(os.path.commonprefix([before, after])):]

    def delta(self, messages, new, prompt=False, seen=None):
        before = seen if seen is not None else self.render(messages) if messages else ""
        return self.encode(self.added(before, self.render([*messages, *new], prompt)))

    def at_once(self, seg):
        return self.encode(seg.text)

    def common(self, texts, last=False):
        """The longest common start (last: end) of texts that ends (starts) where their tokens do (never in a
        special token)."""
        both = os.path.commonprefix([x[::-1] for x in texts])[::-1] if last else os.path.commonprefix(texts)
        part = lambda ids, n: ids[len(ids) - n:] if last else ids[:n]
        while both and any(part(self.encode(x), len(self.encode(both))) != self.encode(both) for x in texts):
            both = both[1:] if last else both[:-1]
        return both

    def closing(self, seen, messages, text, ended):
        # after the reply as the policy saw and wrote it: what the template writes there both where the
        # conversation ends and where a tool's output follows (and the next turn's marker, where that closes
        # a reply); where the template renders the reply otherwise (a space before it, an earlier reply
        # rewritten), or writes text before the end token the policy sampled, its usual closing: a segment
        # starts after it
        head = seen + text
        renders = [self.render([*messages, ("assistant", text), *more]) for more in ([], [TOOL_TURN])]
        after = self.common([r[len(head):] for r in renders]) + self.close * self.by_next \
            if all(r.startswith(head) for r in renders) else self.close
        if ended and not after.startswith(self.mark):
            after = self.close
        ids = self.encode(after)
        return (ids[1:] if ended else ids), after  # the end token: sampled, or added here

    def probe(self):
        """The turns RL writes, rendered with marker texts in each mapping of MAPPINGS, the most faithful
        first; the first the template holds is kept, else the last one's refusal is raised. -> the id that
        ends a reply."""
        for tool, system, self.opening, self.restart, self.join in MAPPINGS:
            self.roles = {**{r: r for r in ROLES}, "tool": tool, "system": system}
            try:
                return self.holds()
            except TokenizerError as e:
                refused = e
        raise refused

    def holds(self):
        """Refuses in one line a mapping under which the template has no place for a turn after a reply (a
        tool's output, a summary request, a feedback hint, a summary restart's next reply) or for a hint
        before the first reply, renders such turns elsewhere than after what precedes them, or writes a reply
        otherwise than right after its generation prompt (then the policy's tokens would not be the
        template's). A template that renders earlier turns otherwise once more follow is taken: rollout starts
        a segment there. -> the id that ends a reply."""
        s, u, a = ("system", "QqSYSTEMqQ"), ("user", "QqUSERqQ"), ("assistant", "QqREPLYqQ")  # markers any
        # template keeps as they are
        self.replies([s, u])
        cases = [([u, a], [(role, f"Qq{role.upper()}{i}qQ") for i, role in enumerate(roles)]) for roles in (
            (), ("tool",), ("tool", "user"), ("user",), ("system",), ("tool", "system"),
            ("tool", "user", "system"))] + [([u], [("system", "QqHINTqQ")])]  # a hint before the first reply
        cases += [([s, *before], after) for before, after in cases]  # and after an opening system turn
        for before, after in cases:
            roles = [role for role, _ in after]
            what = (f"{article(roles[-1])} turn after "
                    + " and ".join(["a reply" if before[-1] is a else "the first user turn", *roles[:-1]])
                    if roles else "a reply right after a reply (a summary restart's next reply)")
            try:
                text = self.render([*before, *after], True)
            except TokenizerError as e:
                raise TokenizerError(f"{e}: it has no place for {what}") from None
            # the new turns after the user's, in their order; the turns before them may be rendered otherwise
            # than before (rollout starts a segment there: a reasoning template drops earlier thinking)
            at = [text.find(x) for _, x in after]
            if -1 in at or at != sorted(at) or at and at[0] < text.find(u[1]):
                raise TokenizerError(f"{self.where}: the chat template puts {what} elsewhere than after what "
                                     "precedes it")
            self.replies([*before, *after])
        # what closes a reply: what the template writes after one both where the conversation ends and where
        # a tool's output follows, from its first special token (the end token sampling stops on; text before
        # it, a newline, is the reply's to write); where that has none, the next turn's marker closes a reply
        # (GLM's), and the reply stops on the marker of the turn that most often follows one, a tool's output
        ends, more = (self.render([s, u, a, *m]) for m in ([], [TOOL_TURN]))
        ends = ends.split(a[1], 1)[1]
        more = more.split(a[1], 1)[1] if a[1] in more else ends  # (a reply rewritten once a turn follows)
        close = self.common([ends, more])
        self.by_next = not self.specials & set(self.encode(close))
        close = more if self.by_next else close
        end = next((i for i in self.encode(close) if i in self.specials), None)
        if end is None:
            raise TokenizerError(f"{self.where}: the chat template ends an assistant turn with no special "
                                 "token to stop on")
        self.mark = self.fast.decode([end], skip_special_tokens=False)
        self.close = close[close.index(self.mark):][:len(self.mark) if self.by_next else None]
        return end

    def mapping(self):
        """The probe's choice, in words: a line of the run's header."""
        said = [f"{'hints' if role == 'system' else 'tool outputs'} as {self.roles[role]} turns"
                for role in ("tool", "system") if self.roles[role] != role]
        said += ["an opening system turn as a user turn"] * (self.opening != "system")
        said += ["a summary as a user turn"] * (self.restart != "assistant")
        said += ["turns of one role in a row joined"] * self.join
        return ("; ".join(said) or "every turn in its own role") + \
            ("; tool calls in the template's own format" if self.calls else "; tool calls as text")

    def replies(self, messages):
        """Refuses a template that has no place for a reply after messages. One that writes text of its own
        before a reply (a space, an empty thinking block) or renders the turns before it otherwise is taken:
        the policy writes right after the generation prompt, and rollout starts a segment where the template's
        rendering no longer extends what the policy saw."""
        marker = "QqNEXTqQ"
        try:
            head = self.render([*messages, ("assistant", marker)]).split(marker, 1)
        except TokenizerError as e:
            raise TokenizerError(f"{e}: it has no place for a reply after {article(messages[-1][0])} "
                                 "turn") from None
        if len(head) < 2:
            raise TokenizerError(f"{self.where}: the chat template renders no assistant turn after "
                                 f"{article(messages[-1][0])} turn")


# -----------------------------------------------------------------------------
# Accounting: parameter counts and FLOPs (work on the meta device)


def param_counts(model: Transformer):
    """(total, active): active counts what one token touches: every dense weight, the lm_head, one row of the
    embedding table, and top_k of num_experts routed experts (the shared expert is always active)."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())
    embed = model.embed.weight.numel()
    active = total - embed + cfg.dim - routed + routed * cfg.top_k // cfg.num_experts
    return total, active


def flops_per_token(model: Transformer, T: int):
    """Training FLOPs per token (forward + backward = 3x forward): 6 per active matmul weight plus attention
    scores and values (6 * n_layer * n_head * T * (qk_head + v_head), no causal discount, like nanoGPT)."""
    cfg = model.cfg
    _, active = param_counts(model)
    matmul_params = active - cfg.dim - sum(p.numel() for p in model.parameters() if p.ndim == 1)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return 6 * matmul_params + 6 * cfg.n_layer * cfg.n_head * T * (qk + cfg.v_head_dim)


def activation_elements(cfg: ModelConfig, layer_id: int, cp: int = 1):
    """Numbers autograd keeps a token for block layer_id's backward, counted from the code above with fused
    attention (MLA pads its heads to one size for it: no T x T scores). An RMSNorm over n keeps its input,
    x * rstd and rstd (2n + 1, as CPU runs it; CUDA's fused kernel keeps no x * rstd, so there the count is
    n a norm high); its output is counted where the next op keeps it. Under context parallelism a rank
    expands the gathered latent into keys and values for cp times its own tokens. Not per token, so not here:
    each layer's einsum copy of wo (H * v * D) and the rope tables. test_all.py checks the count against
    saved-tensor hooks."""
    D, H, r, rope, v = cfg.dim, cfg.n_head, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    qk, q_lora = cfg.qk_nope_head_dim + rope, cfg.q_lora_rank
    d = max(qk, v)  # SDPA's one head size for q, k and v
    attn = (3 * D + 1 + (3 * q_lora + 1 if q_lora else 0)  # x and the query latent: 2n + 1 and the output
            + r + rope + r + 1  # wkv_a's output: 2n + 1 (the norm's output goes on in kv_a)
            + 2 * H * d + H + H * v  # SDPA's q, output and logsumexp; the output cut to v, laid out for wo
            # the (gathered) latent and rope key kv_a for wkv_b, k, and v: padded, or a view of [k_nope | v]
            + cp * (r + rope + H * d + (H * qk if v < qk else H * (cfg.qk_nope_head_dim + v))))
    if layer_id < cfg.n_dense_layers:  # the residual stream, normed; SwiGLU: gate, silu(gate), up, product
        return attn + 3 * D + 1 + 4 * cfg.dense_hidden
    # router scores; per choice its expert, gate, sort order, token and sorted gate, and the gates' sum; the
    # top-k copies of the token in, out and gated; each copy's SwiGLU; the shared expert (n_group 1)
    k = cfg.top_k
    return attn + 3 * D + 1 + cfg.num_experts + 5 * k + 1 + 3 * k * D + 4 * k * cfg.moe_hidden \
        + 4 * cfg.moe_hidden * cfg.n_shared_experts


def memory_plan(model, layout, muon_params, bf16=False, accum=1, reduce_each=False, checkpointing=False,
                batch_size=8, seq_len=256, rl_tokens=0, rl_copies=0, sample_gathered=False):
    """What a rank holds at its peak, from shapes alone (model on the meta device), so a layout can be sized
    before any GPU is booked. -> ({kind: bytes a rank}, bytes of a checkpoint). layout: mesh.Layout's degrees
    (world, dp, dp_shard, cp, ep, ep_shard); muon_params: the parameters Muon steps (one momentum; the others
    get AdamW's two moments). fp32 weights, gradients and optimizer state, sharded as mesh.parallelize shards
    them: dense weights over dp_shard * cp ranks, experts over ep * ep_shard. With gradient accumulation
    (accum > 1, not reduce_each) the gradients stay unsharded until the last micro-batch (FSDP's no-sync:
    dense ones whole, experts over ep). FSDP's unsharded working set: the two largest units in the compute
    dtype (the current one and the prefetched next) plus one unit's fp32 gradient before its reduce-scatter;
    in one process with bf16, autocast's bf16 copy of every weight instead. Activations of this rank's tokens
    for a micro-batch: activation_elements per layer (with activation checkpointing only each block's input,
    plus one block being recomputed) in the compute dtype, and the fp32 logits with their gradient. RL
    (rl_tokens > 0: a data-parallel group's trainer tokens) adds its forward under CP, rl_copies other values
    of the rank's shards (grpo.Weights) and the model's own saved while one is loaded, and with
    sample_gathered the units kept whole while sampling (an upper bound: sampling and training never overlap).
    A checkpoint holds the fp32 weights and optimizer state of all ranks together."""
    cfg, L = model.cfg, layout
    expert_ids = {id(p) for moe in model.moe_layers() for p in moe.experts.parameters()}
    muon_ids = {id(p) for p in muon_params}
    plan = dict.fromkeys(["weights", "gradients", "optimizer", "working copies", "activations"], 0.0)
    checkpoint = sum((8 if id(p) in muon_ids else 12) * p.numel() for p in model.parameters())
    for p in model.parameters():
        n = p.numel() / (L.ep * L.ep_shard if id(p) in expert_ids else L.dp_shard * L.cp)
        plan["weights"] += 4 * n
        plan["gradients"] += 4 * (p.numel() / (L.ep if id(p) in expert_ids else 1)
                                  if accum > 1 and not reduce_each and L.world > 1 else n)
        plan["optimizer"] += (4 if id(p) in muon_ids else 8) * n
    compute = 2 if bf16 else 4
    # a unit as FSDP gathers it (experts stay EP-split)
    gathered = lambda mods: sum(p.numel() / (L.ep if id(p) in expert_ids else 1) for mod in mods
                                for p in mod.parameters())
    if L.world > 1:
        units = [[block] for block in model.layers] + [[model.embed], [model.norm, model.lm_head]]
        plan["working copies"] = max(map(gathered, units)) * (2 * compute + 4)
    elif bf16:
        plan["working copies"] = 2 * sum(p.numel() for p in model.parameters())
    per_layer = [activation_elements(cfg, i, cp=L.cp) for i in range(cfg.n_layer)]
    per_token = cfg.n_layer * cfg.dim + max(per_layer) if checkpointing else sum(per_layer)
    tokens = batch_size // L.dp // accum * (seq_len // L.cp)
    plan["activations"] = tokens * (per_token * compute + 2 * 4 * cfg.vocab_size)
    if rl_tokens:  # under CP the hidden states split over the cp ranks and the logits come back whole
        plan["activations"] = max(plan["activations"],
                                  rl_tokens * (per_token * compute / L.cp + 2 * 4 * cfg.vocab_size))
        plan["rl copies"] = (rl_copies + (rl_copies > 0)) * plan["weights"]
        if sample_gathered and L.world > 1:
            plan["sampling weights"] = compute * gathered([model])
    return plan, checkpoint


# -----------------------------------------------------------------------------
# Appendix: running and measuring it (python model.py: parameter counts, a forward, the benchmarks)


def bench_experts(device):
    """Forward and backward of the routed experts, torch._grouped_mm against a matmul per expert, on expert
    shapes of the small preset and of a slice of Kimi K2's layer (8 of its 384 experts, 7168 -> 2048), with
    tokens spread unevenly. bf16 on CUDA (8192 rows, best of 5); on CPU fp32 and a quick look (128 rows, 2 of
    K2's experts, one run). Prints ms of each and the ratio."""
    gpu = device.type == "cuda"
    dtype, rows, repeats, k2 = (torch.bfloat16, 8192, 5, 8) if gpu else (torch.float32, 128, 1, 2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    for name, (E, dim, hidden) in {"small": (32, 512, 256), f"kimi-k2 x{k2}": (k2, 7168, 2048)}.items():
        counts = torch.distributions.Dirichlet(torch.ones(E)).sample() * rows  # uneven loads
        counts = counts.floor().long().to(device)
        xs = torch.randn(int(counts.sum()), dim, generator=gen).to(device, dtype).requires_grad_()
        ws = [(torch.randn(E, *shape, generator=gen) * 0.02).to(device, dtype).requires_grad_()
              for shape in ((hidden, dim), (hidden, dim), (dim, hidden))]
        dy, times = torch.randn(len(xs), dim, generator=gen).to(device, dtype), {}
        for path in ("grouped", "loop"):
            ok = grouped_mm_ok(xs, ws[0])
            if path == "grouped" and not ok:
                times[path] = None
                continue
            fn = expert_swiglu if path == "grouped" else (
                lambda x, c, a, b, d: torch.cat([F.silu(r @ u.T) * (r @ v.T) @ w.T
                                                 for r, u, v, w in zip(x.split(c.tolist()), a, b, d)]))
            best = float("inf")
            for _ in range(repeats + 1):  # the first is a warm-up
                sync()
                t0 = time.perf_counter()
                fn(xs, counts, *ws).backward(dy)  # a dense gradient: sum()'s is a stride-0 view
                sync()
                best = min(best, time.perf_counter() - t0)
            times[path] = best * 1000
        g, l = times["grouped"], times["loop"]
        print(f"experts {name:10s} E={E} {dim}->{hidden}, {int(counts.sum())} rows, "
              f"{str(dtype)[6:]} on {device.type}: "
              + (f"grouped {g:.2f} ms, loop {l:.2f} ms ({l / g:.2f}x)" if g else
                 f"loop {l:.2f} ms (no grouped GEMM for these shapes here)"))


def bench_decode(presets=("tiny", "small"), contexts=(256, 1024, 4096), B=16, steps=8):
    """Decode speed with MLA's KV cache: B rows (16: a rank's rollouts in the default RL step) prefilled with
    `contexts` tokens, then `steps` one-token steps, expanding every cached latent through wkv_b at each step
    (KVCache(expand=True)) against the absorbed weights. Prints tokens/s of each (all rows) and the ratio."""
    for name in presets:
        torch.manual_seed(0)
        model = Transformer(PRESETS[name]).eval()
        for S in contexts:
            rates = {}
            for expand in (True, False):
                cache, gen = KVCache(model.cfg.n_layer, B, expand=expand), torch.Generator().manual_seed(0)
                full = torch.full((B,), S)
                with torch.no_grad():
                    for s0 in range(0, S, 512):  # prefill in chunks: [B, 512, 512] scores at most a head
                        n = min(512, S - s0)
                        model(torch.randint(256, (B, n), generator=gen),
                              pos=cache.advance(full.clamp(max=n), n), cache=cache)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        model(torch.randint(256, (B, 1), generator=gen),
                              pos=cache.advance(full.clamp(max=1), 1), cache=cache)
                rates[expand] = B * steps / (time.perf_counter() - t0)
            print(f"decode {name:5s} context {S:5d}, {B} rows: expanded {rates[True]:7.0f} tok/s, "
                  f"absorbed {rates[False]:7.0f} tok/s ({rates[False] / rates[True]:.2f}x)")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(
        description="Parameter counts of every preset and a forward, or a benchmark.")
    parser.add_argument("--bench-experts", action="store_true",
                        help="grouped GEMM against a matmul per expert")
    parser.add_argument("--bench-decode", action="store_true",
                        help="decode tokens/s, absorbed MLA against expanded")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"],
                        help="--bench-decode: these presets")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096],
                        help="--bench-decode: contexts")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="--bench-experts: where (auto: cuda when there is one)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.bench_experts:
        bench_experts(torch.device("cuda" if args.device == "cuda" or args.device == "auto"
                                   and torch.cuda.is_available() else "cpu"))
    if args.bench_decode:
        bench_decode(args.presets, args.contexts)
    if args.bench_experts or args.bench_decode:
        sys.exit(0)
    for name, cfg in PRESETS.items():
        with torch.device("meta"):  # shapes only, no memory: the 1T model builds in a blink
            m = Transformer(cfg)
        total, active = param_counts(m)
        print(f"{name:8s} total {total / 1e9:9.4f}B  active {active / 1e9:8.4f}B  "
              f"layers {cfg.n_layer} experts {cfg.num_experts} top-{cfg.top_k}")
    print("Kimi K2 published: total 1.04T, active 32B")
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    idx = torch.tensor([encode("def forward(self, x):")])
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    print(f"tiny forward: logits {tuple(logits.shape)}, loss {loss.item():.3f} "
          f"(ln V = {math.log(VOCAB_SIZE):.3f})")
