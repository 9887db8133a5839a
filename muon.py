"""
Muon: momentum SGD whose update for each weight matrix is replaced by its nearest semi-orthogonal
matrix (the matrix sign, U V^T of the SVD), computed with a few Newton-Schulz iterations. Matrices
of the same shape (all experts of a layer, all heads, all layers) are stacked and orthogonalized in
one batched call, so a [E, out, in] expert weight is simply E matrices. Parameters Muon must not
touch (embeddings, lm_head, norms, router, biases) are updated by AdamW inside the same optimizer.

Sharded (Composer 2.5's recipe): the same class takes the DTensors FSDP2 leaves and reads each one's mesh
and placements. Where a shard holds whole matrices (experts or heads split on their batch dim) NS runs
locally; where matrices are split, same-shaped shards are batched, all-to-all'd so each rank owns whole
matrices, orthogonalized, and all-to-all'd back, the next bucket's transfer in flight during this one's NS.
It equals full-matrix Muon (tested on 2, 4 and 8 gloo ranks); momentum stays sharded like the parameter.

Reading order: the Newton-Schulz iterations (msign, Gram), the parameter groups, the optimizer (Muon.step in
phases), the split-matrix bucket it sends around (SplitBucket), then the benchmarks and the cluster plan.
Those close this file rather than sit in one of their own because they time and count this file's internals
(msign's chunks, ns_flops, the sharded step's phases), and nothing else imports them.

Sources:
  Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
    https://kellerjordan.github.io/posts/muon/ (the quintic iteration, the CLASSIC coefficients)
  Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982 (match_rms_adamw lr scaling)
  Amsel et al., "The Polar Express", arXiv 2505.16932 (per-iteration coefficients, POLAR_EXPRESS)
  torch.optim.Muon (torch/optim/_muon.py), whose update this file reproduces bit for bit.
  Dao AI Lab, gram-newton-schulz (2026): Newton-Schulz iterated on the Gram matrix X X^T (ns_method="gram").
  Cursor, "Introducing Composer 2.5" (sharded Muon, dual-mesh HSDP); microsoft/dion for distributed Muon.
  (MuonClip's QK-Clip rescales attention weights, so it lives with the attention: model.py,
  Transformer.qk_clip.)

  python muon.py                                # CPU benchmark: ours vs torch.optim.Muon, NS vs matmul, Gram
  python muon.py --world 1 2 4                  # sharded step on 1, 2, 4 gloo processes
  python muon.py --plan kimi-k2 --gpus 512      # analytic step time of the 1T model on a cluster (--ns gram)
"""

import gc
import math
import os
import sys
import tempfile
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

# -----------------------------------------------------------------------------
# Newton-Schulz schedules: one (a, b, c) per iteration, x -> a x + b x^3 + c x^5 on singular values.

# Keller Jordan's quintic, maximal slope at zero, repeated 5 times (torch.optim.Muon's default).
CLASSIC = [(3.4445, -4.7750, 2.0315)] * 5

# Polar Express, as used in KellerJordan/modded-nanogpt train_gpt.py (`polar_express_coeffs`,
# "computed for num_iters=5, safety_factor=2e-2, cushion=2"). modded-nanogpt divides by
# ||X||_F * (1 + 2e-2) before iterating; we fold that safety factor into the first iteration
# (p(x / s) = a/s x + b/s^3 x^3 + c/s^5 x^5) so msign() normalises the same way for every schedule.
_POLAR_EXPRESS_RAW = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
_PE_SAFETY = 1 + 2e-2
POLAR_EXPRESS = [
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) if i == 0 else (a, b, c)
    for i, (a, b, c) in enumerate(_POLAR_EXPRESS_RAW)
]


def default_ns_dtype(device):
    """bf16 on a GPU, fp32 on a CPU. A CPU's bf16 speed cannot be read off its flags: on one 2-core VM
    advertising AVX512-BF16, `python muon.py` measured a 512x512 bf16 matmul at 407-423 GFLOP/s against 167 in
    fp32 on one host, and at 136 against 249 on another under the same flags (there the tiny preset's Muon
    step took 110.0 ms in bf16 against 98.5 ms in fp32). fp32 also keeps a seed's figures the same on every
    CPU; pass ns_dtype (train.py --precision bf16) where bf16 is fast."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def msign(G, coefficients, eps=1e-7, dtype=None, method="standard"):
    """Approximate U V^T for every matrix of G [..., m, n] (G = U S V^T), one NS step per triple.

    Each matrix is Frobenius-normalised on its own, so its singular values start in [0, 1].
    Returns a new tensor in the compute `dtype` (default: default_ns_dtype), as
    torch.optim.Muon returns bf16; G is never modified. The op order follows torch.optim.Muon
    exactly, so with dtype=torch.bfloat16 and CLASSIC the result is bitwise equal to it.
    method="gram": Gram Newton-Schulz (below) where it takes fewer FLOPs for this shape, else the same.
    """
    dtype = dtype or default_ns_dtype(G.device)
    m, n = G.shape[-2:]
    X = G.reshape(-1, m, n).to(dtype)  # [B, m, n]
    tall = m > n
    if tall:
        X = X.mT  # [B, n, m]: keeps the Gram matrix X X^T the small side
    # out-of-place div: X may alias G (G already in dtype), and torch's div_ there corrupts momentum
    X = X.div(X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    if method == "gram" and ns_flops(m, n, len(coefficients), "gram") < ns_flops(m, n, len(coefficients)):
        X = gram_newton_schulz(X, coefficients)
    else:
        for a, b, c in coefficients:
            A = X @ X.mT  # [B, k, k], k = min(m, n)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
            X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    if tall:
        X = X.mT
    return X.reshape(G.shape)


# Gram Newton-Schulz (Dao AI Lab's gram-newton-schulz, 2026): every NS step multiplies X [k, N] (k <= N) on
# the left by a polynomial P = a I + b R + c R^2 of its Gram matrix R = X X^T, so after i steps X_i = Q_i X_0
# with Q_i = P_i ... P_1, and R_{i+1} = P_i R_i P_i. Iterating on the k x k matrices R and Q costs at most 8
# k^3 a step, plus 2 k^2 N for the first R and for the final Q X, against 4 k^2 N + 2 k^3 a step: 1.43x fewer
# FLOPs for Kimi K2's experts (k = 2048, N = 7168, 5 steps), none near square (msign keeps the standard
# iteration there). In half precision the rounding in R builds up, so at a restart step X = Q X is made
# explicit and R recomputed from it (2 x 2 k^2 N more; the reference's default restart is before step 2).
GRAM_RESTARTS = (2,)


def gram_newton_schulz(X, coefficients, restarts=GRAM_RESTARTS):
    """X [B, k, N], k <= N, Frobenius-normalised -> the NS schedule's result, iterated on k x k matrices."""
    R, Q, last = X @ X.mT, None, len(coefficients) - 1  # R [B, k, k]
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts and Q is not None:
            X = Q @ X
            R, Q = X @ X.mT, None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c)  # b R + c R^2: this step's P = a I + Z
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a)  # Q P = a Q + Q Z
        if i < last and i + 1 not in restarts:  # R of the next step: P R P
            RP = torch.baddbmm(R, R, Z, beta=a)
            R = torch.baddbmm(RP, Z, RP, beta=a)
    return Q @ X


def ns_flops(m, n, steps, method="standard", restarts=GRAM_RESTARTS):
    """Matmul FLOPs of msign on one [m, n] matrix with `steps` NS steps (k = min(m, n), N = max(m, n)); for
    "gram", the cheaper of the two methods, as msign picks."""
    k, N = min(m, n), max(m, n)
    standard = steps * (4 * k * k * N + 2 * k ** 3)
    if method != "gram":
        return standard
    starts = [0] + [r for r in restarts if 0 < r < steps]  # the first step of each stretch
    ends = [r - 1 for r in starts[1:]] + [steps - 1]
    square = sum(1 + (i not in starts) + 2 * (i not in ends) for i in range(steps))  # k^3 products a step
    rect = 2 + 2 * (len(starts) - 1)  # R and Q X at the ends, and both at each restart
    return min(standard, 2 * k ** 3 * square + 2 * k * k * N * rect)


def ns_band(coefficients, lo, num=100_001):
    """[min, max] of the composed scalar polynomial on sigma in [lo, 1]: where the output singular
    values of msign() must land when every normalised input singular value is >= lo."""
    x = np.linspace(lo, 1.0, num, dtype=np.float64)
    for a, b, c in coefficients:
        x = a * x + b * x**3 + c * x**5
    return float(x.min()), float(x.max())


def adjust_lr(lr, adjust_lr_fn, shape):
    """torch.optim.Muon's rule, applied to the matrix shape (the last two dims)."""
    A, B = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))  # Keller: same update RMS for tall matrices
    return lr * 0.2 * math.sqrt(max(A, B))  # Moonshot: update RMS 0.2, like AdamW's


# -----------------------------------------------------------------------------
# Splitting a model's parameters into the two algorithms


def param_groups(named_params, lr, weight_decay, adamw_lr=None, adamw_weight_decay=None,
                 adamw_keywords=("embed", "lm_head", "router")):
    """Split model.named_parameters() into [muon_group, adamw_group, adamw_no_decay_group].

    Rule: a parameter with ndim < 2 (norm gains, biases) or whose name contains one of
    `adamw_keywords` (the embedding and lm_head map tokens to and from the hidden space, not one
    hidden state to another as Muon assumes; the router is small and its logits must stay
    calibrated) goes to AdamW, and the ndim < 2 ones without weight decay: decay would pull the
    norm gains toward 0, which no loss asks for (nanoGPT and most references exempt them too).
    Everything else, 2D weights and stacked 3D weights [E, out, in] / [H, head_dim, in], goes to
    Muon. With adjust_lr_fn="match_rms_adamw" one lr serves both algorithms, so adamw_lr defaults to
    lr and adamw_weight_decay to weight_decay.
    """
    muon, adamw, no_decay = [], [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else adamw if any(k in name for k in adamw_keywords) else muon).append(p)
    adamw_lr = lr if adamw_lr is None else adamw_lr
    return [
        dict(params=muon, lr=lr, weight_decay=weight_decay, algorithm="muon"),
        dict(params=adamw, lr=adamw_lr, algorithm="adamw",
             weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay),
        dict(params=no_decay, lr=adamw_lr, weight_decay=0.0, algorithm="adamw"),
    ]


# -----------------------------------------------------------------------------
# Sharded Muon: whole matrices from FSDP2 shards


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _split_mesh_dims(p):
    """The mesh dims whose placement splits one of p's two matrix dims. Shards of a batch dim (FSDP's Shard(0)
    of [E, out, in] experts or [H, d, in] heads, EP's Shard(0)) leave whole matrices on every rank."""
    return [i for i, pl in enumerate(p.placements) if pl.is_shard() and pl.dim % p.ndim >= p.ndim - 2]


# -----------------------------------------------------------------------------
# The optimizer


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update (same arguments, defaults and numerics), generalised to
    stacked matrices [..., m, n] and batched across parameters, plus an AdamW path for param
    groups with algorithm="adamw" (keys lr, betas, adamw_eps, weight_decay; torch.optim.AdamW
    semantics). Extra Muon options: ns_schedule (None: ns_coefficients repeated ns_steps times;
    "polar_express": POLAR_EXPRESS; or an explicit list of (a, b, c)), ns_dtype (None: bf16 on
    a GPU, fp32 on a CPU) and ns_method ("standard", or "gram": Gram Newton-Schulz where
    it is cheaper).

    A step runs in phases: AdamW for its groups; momentum on each rank's shards and the updates bucketed
    (_momentum_and_buckets); one batched NS a bucket of whole matrices (_orthogonalize_local); then the
    all-to-all pipeline for buckets of split matrices (SplitBucket): every transfer is launched ahead of the
    NS that consumes it, as many as max_inflight_bytes allows, so bucket i+1's whole matrices travel while
    bucket i is orthogonalized and its pieces travel home; the first ones travel during the local NS. The
    updates are applied as the pieces arrive. Communication is two all_to_all_single a split bucket, within
    its shard group only, and nothing for whole matrices."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                 adjust_lr_fn=None, ns_schedule=None, ns_dtype=None, ns_method="standard",
                 betas=(0.9, 0.95), adamw_eps=1e-8, ns_chunk_bytes=4 << 20, max_inflight_bytes=256 << 20):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, ns_schedule=ns_schedule, ns_dtype=ns_dtype,
                        ns_method=ns_method, betas=tuple(betas), adamw_eps=adamw_eps, algorithm="muon")
        super().__init__(params, defaults)
        # NS runs on chunks of at most this many (fp32-sized) bytes of matrices: a bucket of hundreds of
        # experts as one bmm falls out of cache and runs ~1.5x slower on CPU than 4 MiB chunks
        self.ns_chunk_bytes = ns_chunk_bytes
        # sharded parameters: all-to-all bytes launched ahead of the NS that consumes them, the memory spent
        # on overlapping communication with compute; 0 turns overlap off (one transfer at a time)
        self.max_inflight_bytes = max_inflight_bytes

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])  # the group now holds the defaults too

    @staticmethod
    def _check_group(g):
        if isinstance(g["lr"], torch.Tensor) and g["lr"].numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not g["lr"] >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {g['lr']}")
        if not g["weight_decay"] >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {g['weight_decay']}")
        if g["algorithm"] == "adamw":
            b1, b2 = g["betas"]
            if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
                raise ValueError(f"AdamW betas should be in [0, 1) but are: {g['betas']}")
            if not g["adamw_eps"] >= 0.0:
                raise ValueError(f"adamw_eps should be >= 0 but is: {g['adamw_eps']}")
            return
        if g["algorithm"] != "muon":
            raise ValueError(f"algorithm must be 'muon' or 'adamw' but is: {g['algorithm']!r}")
        if not g["momentum"] >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {g['momentum']}")
        if g["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {g['adjust_lr_fn']} is not supported")
        if len(g["ns_coefficients"]) != 3:
            raise ValueError("ns_coefficients must be a tuple of exactly 3 values (a, b, c)")
        if not 0 < g["ns_steps"] < 100:
            raise ValueError(f"ns_steps must be in [1, 100) but is: {g['ns_steps']}")
        if g["ns_method"] not in ("standard", "gram"):
            raise ValueError(f"ns_method must be 'standard' or 'gram' but is: {g['ns_method']!r}")
        s = g["ns_schedule"]
        if not (s is None or s == "polar_express" or (isinstance(s, (list, tuple))
                and all(len(t) == 3 for t in s))):
            raise ValueError(f"ns_schedule must be None, 'polar_express' or a list of (a, b, c); got {s!r}")
        for p in g["params"]:
            if p.ndim < 2:
                raise ValueError(f"Muon needs matrices [..., m, n]; found a parameter of shape "
                                 f"{tuple(p.shape)}: put it in a group with algorithm='adamw'")

    @staticmethod
    def _schedule(g):
        s, steps = g["ns_schedule"], g["ns_steps"]
        if s is None:
            return [tuple(g["ns_coefficients"])] * steps
        s = POLAR_EXPRESS if s == "polar_express" else [tuple(t) for t in s]
        return s[:steps] + s[-1:] * (steps - len(s))  # extra steps repeat the last (converged) one

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.stats = {"ns_flops": 0, "a2a_bytes": 0, "a2a_wait_s": 0.0, "ns_s": 0.0, "peak_buffer_bytes": 0}
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                self._adamw(g)
        local, split = self._momentum_and_buckets()
        inflight, done = deque(), []
        next_task = self._launch(split, inflight, 0)  # the first transfers travel while the local NS runs
        self._orthogonalize_local(local)
        while inflight:  # the all-to-all pipeline: whole matrices arrive, NS, pieces go home
            task = inflight.popleft()
            self._wait(task)
            next_task = self._launch(split, inflight, next_task)  # the next ones travel during this NS
            task.send_back(self._msign(task.whole_matrices(), *task.ns))
            if not self.max_inflight_bytes:
                self._wait(task)
            done.append(task)
            self.stats["peak_buffer_bytes"] = max(self.stats["peak_buffer_bytes"],
                                                  sum(3 * t.nbytes for t in list(inflight) + done))
        for task in done:
            self._wait(task)
            for (p, g, _), o in zip(task.items, task.updates()):
                self._apply(p, g, o)
        return loss

    def _momentum_and_buckets(self):
        """Phase 1: momentum on the local shards (the state is sharded like the parameter), and the updates
        bucketed: plain tensors by matrix shape, so all same-shaped matrices share one batched NS; DTensors by
        (global shape, placements, mesh), so a bucket's shards line up for one all-to-all. -> (local, split):
        buckets whose shards hold whole matrices [(ns, [(param, group, update)])] (plain tensors; experts or
        heads sharded on a batch dim), and SplitBucket's of matrices cut over a shard group."""
        buckets = {}
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                continue
            mu, coeffs = g["momentum"], tuple(self._schedule(g))
            for p in g["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p) or p.grad.is_sparse:
                    raise RuntimeError("Muon supports only dense real parameters")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                grad, buf = _local(p.grad), _local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu) if g["nesterov"] else buf  # msign never writes to it
                ns = (coeffs, g["eps"], g["ns_dtype"] or default_ns_dtype(p.device), g["ns_method"])
                if isinstance(p, DTensor):
                    key = (tuple(p.shape), tuple(p.placements), p.device_mesh, p.dtype, ns)
                else:
                    key = (tuple(p.shape[-2:]), p.dtype, p.device, ns)
                buckets.setdefault(key, []).append((p, g, update))
        local, split = [], []
        for key, items in buckets.items():
            p = items[0][0]
            dims = _split_mesh_dims(p) if isinstance(p, DTensor) else []
            if not dims:
                local.append((key[-1], items))
            elif len(dims) == 1:
                split.append(SplitBucket(key[-1], items, dims[0]))
            else:  # a matrix dim split over two mesh dims (no layout of ours does this): gather it whole
                local.append((key[-1], [
                    (q, g, DTensor.from_local(u, q.device_mesh, q.placements, shape=q.shape,
                                              stride=q.stride()).full_tensor())
                    for q, g, u in items]))
        return local, split

    def _orthogonalize_local(self, local):
        """Phase 2: one batched NS per bucket of whole matrices, no traffic."""
        for ns, items in local:
            shape = items[0][2].shape[-2:]
            O = self._msign(torch.cat([u.reshape(-1, *shape) for _, _, u in items]), *ns)
            for (p, g, u), o in zip(items, O.split([u.numel() // shape.numel() for _, _, u in items])):
                if o.numel() != _local(p).numel():  # gathered whole above: keep this rank's shard
                    o = distribute_tensor(o.view(p.shape), p.device_mesh, p.placements, src_data_rank=None)
                self._apply(p, g, _local(o).view_as(_local(p)))

    def _wait(self, task):
        t0 = time.perf_counter()
        task.work.wait()
        self.stats["a2a_wait_s"] += time.perf_counter() - t0

    def _launch(self, tasks, inflight, i):
        """Start the all-to-alls of tasks[i:] while the bytes of transfers not yet turned into NS work stay
        under max_inflight_bytes (at least one is always in flight). -> index of the next task to launch.
        max_inflight_bytes 0: one transfer at a time, each waited for as it starts (the no-overlap
        baseline)."""
        while i < len(tasks) and (not inflight or sum(t.nbytes for t in inflight) + tasks[i].nbytes
                                  <= self.max_inflight_bytes):
            tasks[i].send()
            if not self.max_inflight_bytes:
                self._wait(tasks[i])
            self.stats["a2a_bytes"] += 2 * tasks[i].nbytes  # there, and back after NS
            inflight.append(tasks[i])
            i += 1
        return i

    def _msign(self, X, coeffs, eps, ns_dtype, method):
        """Batched NS on X [B, m, n], in chunks of at most ns_chunk_bytes (fp32-sized) to stay in cache."""
        m, n = X.shape[-2:]
        t0 = time.perf_counter()
        chunk = max(1, self.ns_chunk_bytes // (4 * m * n))
        O = torch.cat([msign(x, coeffs, eps, ns_dtype, method) for x in X.split(chunk)]) if len(X) else X
        self.stats["ns_s"] += time.perf_counter() - t0
        self.stats["ns_flops"] += len(X) * ns_flops(m, n, len(coeffs), method)
        return O

    @staticmethod
    def _apply(p, g, o):
        """torch.optim.Muon's update on this rank's shard: decoupled decay, then the scaled orthogonal
        step."""
        lr = g["lr"]
        adjusted = adjust_lr(lr, g["adjust_lr_fn"], p.shape)  # a DTensor's shape is the global one
        p = _local(p)
        p.mul_(1 - lr * g["weight_decay"])  # decoupled decay uses the unadjusted lr
        p.add_(o.view_as(p), alpha=-adjusted)

    def _adamw(self, g):
        """torch.optim.AdamW's single-tensor update (decoupled decay, bias-corrected)."""
        lr, wd, eps = g["lr"], g["weight_decay"], g["adamw_eps"]
        beta1, beta2 = g["betas"]
        for p in g["params"]:
            if p.grad is None:
                continue
            grad, state = p.grad, self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)  # a CPU float tensor, as torch keeps it
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = state["step"].item()
            p.mul_(1 - lr * wd)
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = lr / (1 - beta1**step)
            denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-step_size)


class SplitBucket:
    """One bucket of split matrices: the same global shape, placements and mesh, each matrix cut along one
    matrix dim (`length` rows or columns) over a shard group of W ranks, torch.chunk style as FSDP2 and
    DTensor cut: pieces of `piece` = ceil(length / W), the tail ones shorter or empty. One all_to_all_single
    hands every rank `owned` = ceil(count / W) whole matrices (the count padded to a multiple of W, short
    pieces padded with zeros), NS runs on them, and a second all_to_all_single returns each piece to its
    owner. Replicas (HSDP's Replicate dim) each do this within their own shard group and compute the same
    result: redundant NS, but no traffic across replicas, which typically sit on different nodes, to save a
    factor dp_replicate of a small, already-sharded compute."""

    def __init__(self, ns, items, mesh_dim):
        p = items[0][0]
        self.ns, self.items = ns, items  # items: (param, group, this rank's update [..., rows, cols])
        mesh = p.device_mesh
        self.group, self.W, self.rank = (mesh.get_group(mesh_dim), mesh.size(mesh_dim),
                                         mesh.get_local_rank(mesh_dim))
        # split rows, else columns (work on .mT)
        self.rows = p.placements[mesh_dim].dim % p.ndim == p.ndim - 2
        self.length, self.other = (p.shape[-2], p.shape[-1]) if self.rows else (p.shape[-1], p.shape[-2])
        self.piece = -(-self.length // self.W)
        # rows of each matrix held here
        self.mine = min(self.piece, max(0, self.length - self.rank * self.piece))
        self.counts = [math.prod(u.shape[:-2]) for _, _, u in items]  # matrices per parameter
        self.count = sum(self.counts)
        self.owned = -(-self.count // self.W)  # whole matrices each rank orthogonalizes
        self.nbytes = self.owned * self.W * self.piece * self.other * items[0][2].element_size()

    def send(self):
        X = torch.cat([(u if self.rows else u.mT).reshape(n, self.mine, self.other)
                       for (_, _, u), n in zip(self.items, self.counts)])  # [count, mine, other]
        # block s (owned matrices) goes to rank s
        buf = X.new_zeros(self.owned * self.W, self.piece, self.other)
        buf[:self.count, :self.mine] = X
        self.recv = torch.empty_like(buf)
        self.work = dist.all_to_all_single(self.recv, buf, group=self.group, async_op=True)

    def whole_matrices(self):
        """[owned, m, n]: the received pieces (piece s came from rank s) joined, padding cut off."""
        R = self.recv.view(self.W, self.owned, self.piece, self.other).transpose(0, 1)
        R = R.reshape(self.owned, self.W * self.piece, self.other)[:, :self.length]
        return R if self.rows else R.mT

    def send_back(self, O):
        O = O if self.rows else O.mT  # [owned, length, other]
        buf = O.new_zeros(self.owned, self.W * self.piece, self.other)
        buf[:, :self.length] = O
        # piece s -> rank s
        buf = buf.view(self.owned, self.W, self.piece, self.other).transpose(0, 1).contiguous()
        self.back = torch.empty_like(buf)
        self.work = dist.all_to_all_single(self.back, buf, group=self.group, async_op=True)

    def updates(self):
        """This rank's piece of every orthogonalized matrix, shaped like each parameter's local shard."""
        O = self.back.view(self.owned * self.W, self.piece, self.other)[:self.count, :self.mine]
        for (_, _, u), o in zip(self.items, O.split(self.counts)):
            yield o.reshape(u.shape) if self.rows else o.reshape(u.mT.shape).mT


# -----------------------------------------------------------------------------
# Appendix: running and measuring it: the benchmark (python muon.py)


def _median_time(fn, repeats, warmup=1):
    """Median seconds of fn() over `repeats` runs, after `warmup`; CUDA work is waited for."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _preset_matrices(name):
    """The Muon-group parameter shapes of a model preset, built on the meta device (no memory)."""
    from model import PRESETS, Transformer  # lazy: muon.py itself never imports the model
    with torch.device("meta"):
        model = Transformer(PRESETS[name])
    muon_group = param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)[0]
    return [tuple(p.shape) for p in muon_group["params"]]


def _ratio(baseline, ours):
    """'2.10x faster' or '1.64x slower' than the baseline: always a ratio >= 1 with the word that fits."""
    return f"{baseline / ours:5.2f}x faster" if ours <= baseline else f"{ours / baseline:5.2f}x slower"


def _bench_step(shapes, repeats, device):
    """Seconds per step over ALL of a preset's Muon matrices: torch.optim.Muon (bf16 NS, one 2D param
    per expert / head slice, since it takes only 2D) vs ours (stacked params, batched NS, fp32, bf16, and bf16
    with Gram Newton-Schulz)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen).to(device) for s in shapes]
    for p in ours:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    ref = [m.clone() for p in ours for m in p.reshape(-1, *p.shape[-2:])]  # one [m, n] per slice
    for r, g in zip(ref, [g for p in ours for g in p.grad.reshape(-1, *p.shape[-2:])]):
        r.grad = g.clone()
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    t_torch = _median_time(torch.optim.Muon(ref, **kw).step, repeats)
    t_fp32 = _median_time(Muon(ours, ns_dtype=torch.float32, **kw).step, repeats)
    t_bf16 = _median_time(Muon(ours, ns_dtype=torch.bfloat16, **kw).step, repeats)
    t_gram = _median_time(Muon(ours, ns_dtype=torch.bfloat16, ns_method="gram", **kw).step, repeats)
    return t_torch, t_fp32, t_bf16, t_gram, len(ref)


def _matmul_gflops(n, dtype, repeats, device="cpu"):
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _median_time(lambda: a @ b, repeats) / 1e9


def _bench_ns(shapes, repeats, max_batch, device, dtype, coefficients=CLASSIC):
    """Per matrix shape: GFLOP/s of one batched msign vs a plain bmm [B, m, n] @ [B, n, m] in `dtype`
    (m <= n, B capped at max_batch: throughput no longer depends on B there). NS per iteration
    costs 2m^2n (X X^T) + 2m^3 (A A) + 2m^2n (B X)."""
    per_shape = {}
    for s in shapes:
        mn = tuple(sorted(s[-2:]))
        per_shape[mn] = min(max_batch, per_shape.get(mn, 0) + math.prod(s[:-2]))
    rows = []
    for (m, n), B in sorted(per_shape.items(), key=lambda kv: kv[0][0] ** 2 * kv[0][1]):
        X = torch.randn(B, m, n, device=device, dtype=dtype)  # [B, m, n]
        Y = torch.randn(B, n, m, device=device, dtype=dtype)  # [B, n, m]
        ns_flops = len(coefficients) * B * (4 * m * m * n + 2 * m**3)
        t_ns = _median_time(lambda: msign(X, coefficients, dtype=dtype), repeats)
        t_mm = _median_time(lambda: torch.bmm(X, Y), repeats)
        rows.append(((B, m, n), ns_flops / t_ns / 1e9, 2 * B * m * m * n / t_mm / 1e9))
    return rows


def _orthogonality_error(O):
    """RMS over the k singular directions of O O^T - I (O [B, m, n], k = min(m, n)), the worst matrix of B."""
    O = O.double()
    k = min(O.shape[-2:])
    M = O @ O.mT if O.size(-2) <= O.size(-1) else O.mT @ O
    return ((M - torch.eye(k, dtype=M.dtype)).norm(dim=(-2, -1)) / k ** 0.5).max().item()


def _bench_gram(shapes, repeats, device, dtype, coefficients=CLASSIC):
    """Per [B, m, n]: ms of msign, standard against Gram Newton-Schulz, in `dtype`, and each one's
    orthogonality error. -> rows (shape, FLOPs standard / Gram, ms standard, ms Gram, error standard, Gram)"""
    rows, gen = [], torch.Generator().manual_seed(0)
    for B, m, n in shapes:
        X = torch.randn(B, m, n, generator=gen).to(device)
        big = device == "cpu" and B * m * n > 1 << 22  # a K2 expert takes seconds on a CPU: no warm-up run
        t, err = {}, {}
        for method in ("standard", "gram"):
            run = lambda: msign(X, coefficients, dtype=dtype, method=method)
            t[method] = _median_time(run, 1 if big else repeats, warmup=0 if big else 1)
            err[method] = _orthogonality_error(run())
        flops = ns_flops(m, n, len(coefficients)) / ns_flops(m, n, len(coefficients), "gram")
        rows.append(((B, m, n), flops, t["standard"], t["gram"], err["standard"], err["gram"]))
    return rows


def _dist_bench_worker(rank, world, store, preset, repeats, results):
    """One rank of the sharded benchmark: the preset's Muon matrices as FSDP2 leaves them (Shard(0) over all
    ranks; world 1: plain tensors), one thread, timed steps with and without communication overlap. The ranks
    meet at a file (`store`), not a port, so benchmarks running side by side cannot collide."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        mesh = DeviceMesh("cpu", torch.arange(world))
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in _preset_matrices(preset):
        p, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        if world > 1:
            p, grad = (distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in (p, grad))
        p.grad = grad
        params.append(p)
    row = {}
    for name, inflight in (("serial", 0), ("overlap", 256 << 20)):
        opt = Muon(params, lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32,
                   max_inflight_bytes=inflight)
        opt.step()  # state allocation and warm-up
        row[name] = _median_time(opt.step, repeats, warmup=0)
        row[name + "_wait"] = opt.stats["a2a_wait_s"]
    row.update({k: opt.stats[k] for k in ("ns_flops", "a2a_bytes", "peak_buffer_bytes")})
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, row)
        dist.barrier()
        del opt, params, p, grad, mesh  # nothing may hold the process group past its destruction: a gloo
        gc.collect()                    # group freed at interpreter exit can abort the process (terminate)
        dist.destroy_process_group()
    else:
        rows = [row]
    if rank == 0:
        results.put(rows)


def dist_bench(preset, worlds, repeats):
    import torch.multiprocessing as mp
    print(f"\n[{preset}] sharded Muon step, FSDP2 layout (Shard(0) on all ranks), gloo, 1 thread a rank, "
          f"{os.cpu_count()} cores, median of {repeats}:")
    print(f"  {'W':>2} {'step ms':>8} {'vs W=1':>7} {'no-overlap ms':>13} {'comm hidden':>11} "
          f"{'NS GFLOP/rank':>13} {'of total':>8} {'a2a MiB/rank':>12} {'buffers MiB':>11}")
    base = total = None
    for world in worlds:
        # the workers fork from one process that imported torch
        q = mp.get_context("forkserver").SimpleQueue()
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(_dist_bench_worker, args=(world, os.path.join(d, "store"), preset, repeats, q),
                               nprocs=world, start_method="forkserver")
        rows = q.get()
        step, serial = max(r["overlap"] for r in rows), max(r["serial"] for r in rows)
        base = base or step
        total = total or sum(r["ns_flops"] for r in rows)
        flops = max(r["ns_flops"] for r in rows)
        waits = [(r["serial_wait"], r["overlap_wait"]) for r in rows]
        hidden = 1 - sum(w for _, w in waits) / max(1e-9, sum(s for s, _ in waits))
        print(f"  {world:2d} {step * 1e3:8.1f} {step / base:6.2f}x {serial * 1e3:13.1f} "
              f"{(f'{hidden:.0%}' if world > 1 else '-'):>11} {flops / 1e9:13.2f} {flops / total:8.2f} "
              f"{max(r['a2a_bytes'] for r in rows) / 2**20:12.2f} "
              f"{max(r['peak_buffer_bytes'] for r in rows) / 2**20:11.2f}")


def plan(shapes, gpus, dense_shard, ep, tflops, a2a_gbps, ns_steps=5, bytes_per_elem=2, num_experts=None,
         method="standard"):
    """Analytic time of one sharded Muon step, with train.py's layout: dense matrices FSDP-sharded on dim 0
    over `dense_shard` ranks (dp_shard * cp) and replicated gpus/dense_shard times, each replica computing its
    NS; experts [E, out, in] split over `ep` ranks, each rank's E/ep FSDP-sharded over ep_shard = gpus/ep
    ranks, on dim 0 when E/ep >= ep_shard (whole matrices: local NS) else dim 1 (all-to-all). Like the
    optimizer, a bucket is all parameters of one shape, so a rank owns ceil(matrices / group) of it.
    shapes: [(name, shape)].
    -> rows (one per bucket) and totals; time per GPU is FLOPs / tflops and
    bytes (sent + received) / a2a_gbps."""
    buckets = {}
    for name, shape in shapes:  # bucket names like attn.wq_a, experts.w1, shared.w2
        short = ".".join([x for x in name.split(".") if x != "weight"][-2:])
        buckets.setdefault((".experts." in name, tuple(shape)), []).append(short)
    rows = []
    for (expert, shape), names in buckets.items():
        n = len(names)
        m, k = sorted(shape[-2:])
        f1 = ns_flops(m, k, ns_steps, method)  # one matrix
        matrices, mat_bytes = n * math.prod(shape[:-2]), math.prod(shape[-2:]) * bytes_per_elem
        if expert:
            E_local, group = shape[0] // ep, gpus // ep
            local = E_local >= group
            own = n * -(-E_local // group) if local else -(-n * E_local // group)
            per_rank_matrices = n * E_local
        else:
            group, local = dense_shard, len(shape) == 3  # per-head weights: FSDP's Shard(0) splits heads
            own = n * -(-shape[0] // group) if local else -(-matrices // group)
            per_rank_matrices = matrices
        gb = (0.0 if local or group == 1
              else 2 * per_rank_matrices * mat_bytes / group * (group - 1) / group / 1e9)
        rows.append(dict(name="/".join(dict.fromkeys(names)), shape=shape, expert=expert, matrices=matrices,
                         path="local" if local or group == 1 else "a2a", tflop=matrices * f1 / 1e12,
                         tflop_gpu=own * f1 / 1e12, gb_gpu=gb))
    compute = sum(r["tflop_gpu"] for r in rows) / tflops
    comm = sum(r["gb_gpu"] for r in rows) / a2a_gbps
    fill = min((r["gb_gpu"] / a2a_gbps for r in rows if r["path"] == "a2a"), default=0.0)
    # overlapped: while one bucket is orthogonalized the next one's transfer is in flight, so the step costs
    # the larger of the two plus the first (smallest) transfer, which nothing can hide
    return rows, dict(compute_s=compute, comm_s=comm, serial_s=compute + comm,
                      overlap_s=max(compute, comm) + fill)


def print_plan(a):
    from model import PRESETS, Transformer  # lazy, like _preset_matrices
    with torch.device("meta"):
        model = Transformer(PRESETS[a.preset])
    names = {id(p): n for n, p in model.named_parameters()}
    muon_group = param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)[0]
    shapes = [(names[id(p)], tuple(p.shape)) for p in muon_group["params"]]
    ds, ep = min(a.dense_shard, a.gpus), min(a.ep, a.gpus)
    if ds % ep:
        sys.exit(f"error: ep({ep}) must divide the dense shard group dp_shard*cp ({ds}), as in mesh.py")
    rows, t = plan(shapes, a.gpus, ds, ep, a.tflops, a.a2a_gbps, method=a.ns)
    print(f"[{a.preset}] sharded Muon ({a.ns} Newton-Schulz) on {a.gpus} GPUs: dense FSDP groups of {ds} "
          f"({a.gpus // ds} replicas), "
          f"experts ep={ep} x ep_shard={a.gpus // ep}; {a.tflops:g} TFLOP/s NS, "
          f"{a.a2a_gbps:g} GB/s all-to-all a GPU")
    print(f"  {'bucket':<20} {'shape':>18} {'matrices':>8} {'path':>5} {'NS TFLOP':>9} "
          f"{'TFLOP/GPU':>10} {'GB/GPU':>7}")
    for r in rows:
        print(f"  {r['name']:<20} {str(list(r['shape'])):>18} {r['matrices']:8d} {r['path']:>5} "
              f"{r['tflop']:9.1f} {r['tflop_gpu']:10.2f} {r['gb_gpu']:7.2f}")
    ex = sum(r["tflop"] for r in rows if r["expert"]) / sum(r["tflop"] for r in rows)
    print(f"  experts: {ex:.1%} of the NS FLOPs | per GPU: compute {t['compute_s']:.3f} s, all-to-all "
          f"{t['comm_s']:.3f} s; serial {t['serial_s']:.3f} s, overlapped {t['overlap_s']:.3f} s")
    g = ep  # the smallest cluster (same dense group and ep, more expert-shard ranks) that reaches 0.2 s
    while g <= 1 << 16 and plan(shapes, g, ds, ep, a.tflops, a.a2a_gbps, method=a.ns)[1]["overlap_s"] > 0.2:
        g *= 2
    print(f"  0.2 s (the seed's claim for a 1T model) needs {g if g <= 1 << 16 else 'more than 65536'} "
          f"GPUs at {a.tflops:g} TFLOP/s achieved with this layout; at {a.gpus} GPUs the model gives "
          f"{t['overlap_s'] / 0.2:.1f}x the claim")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(
        description="Benchmark batched Muon against torch.optim.Muon, CPU or GPU.")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], help="model presets (model.py)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (median)")
    parser.add_argument("--ns-max-batch", type=int, default=32, help="batch cap in the NS throughput table")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cuda if available")
    g = parser.add_argument_group("--plan: analytic step time of sharded Muon on a cluster (nothing is run)")
    g.add_argument("--plan", default=None, help="preset to plan for, e.g. kimi-k2")
    g.add_argument("--gpus", type=int, default=512, help="GPUs in the job")
    g.add_argument("--dense-shard", type=int, default=64, help="dense FSDP group, dp_shard*cp")
    g.add_argument("--ep", type=int, default=64, help="expert-parallel degree")
    g.add_argument("--tflops", type=float, default=400.0, help="achieved bf16 NS TFLOP/s a GPU (H100-class)")
    g.add_argument("--a2a-gbps", type=float, default=50.0, help="all-to-all GB/s a GPU (one 400 Gb/s NIC)")
    g.add_argument("--ns", default="standard", choices=["standard", "gram"],
                   help="the Newton-Schulz method planned")
    parser.add_argument("--k2", default="all", choices=["all", "heads", "none"],
                        help="Kimi K2's shapes in the Gram table: per-head attention (64 heads) and one "
                             "expert [1, 2048, 7168] (all), the heads only, or none (seconds each on a CPU)")
    parser.add_argument("--world", type=int, nargs="+", default=None,
                        help="instead: time the sharded step on these process counts (gloo), "
                             "e.g. --world 1 2 4")
    args = parser.parse_args()
    if args.world:
        for name in args.presets:
            dist_bench(name, args.world, args.repeats)
        sys.exit(0)
    if args.plan:
        args.preset = args.plan
        print_plan(args)
        sys.exit(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available() else "cpu"
    # the NS dtype each device uses by default (default_ns_dtype), and its matmul peak
    ns_dtype, peak_n = default_ns_dtype(device), 8192 if device == "cuda" else 512
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"{torch.get_num_threads()} threads on {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} "
          "at start")  # another busy process makes small ops slower: the load stands next to the figures
    # torch.optim.Muon always runs NS in bf16; whether bf16 is fast here decides the step ratio
    f32, b16 = (_matmul_gflops(peak_n, dt, 10, device) for dt in (torch.float32, torch.bfloat16))
    print(f"{peak_n}x{peak_n} matmul on {device}: fp32 {f32:.0f} GFLOP/s, bf16 {b16:.0f} GFLOP/s "
          f"(bf16/fp32 {b16 / f32:.2f})")
    for name in args.presets:
        shapes = _preset_matrices(name)
        tt, t32, t16, tg, n = _bench_step(shapes, args.repeats, device)
        print(f"\n[{name}] one Muon step over all {n} matrices ({len(shapes)} parameters), "
              f"median of {args.repeats}:")
        print(f"  torch.optim.Muon, one 2D param per slice, bf16 NS {tt * 1e3:9.1f} ms")
        print(f"  ours, batched, fp32 NS (the CPU default)        {t32 * 1e3:9.1f} ms  {_ratio(tt, t32)}")
        print(f"  ours, batched, bf16 NS (GPUs; --precision bf16) {t16 * 1e3:9.1f} ms  {_ratio(tt, t16)}")
        print(f"  ours, batched, bf16 NS, Gram (--ns gram)       {tg * 1e3:9.1f} ms  {_ratio(tt, tg)}")
        print(f"  {'[B, m, n]':>18} {'NS GFLOP/s':>11} {'bmm GFLOP/s':>12} {'NS/bmm':>7}   "
              f"({str(ns_dtype)[6:]})")
        for (B, m, n), ns, mm in _bench_ns(shapes, args.repeats, args.ns_max_batch, device, ns_dtype):
            print(f"  {str([B, m, n]):>18} {ns:11.1f} {mm:12.1f} {ns / mm:7.0%}")
    # standard against Gram Newton-Schulz: the presets' shapes (batch capped), Kimi K2's per-head attention
    # matrices (64 heads) and one of its experts; on a GPU, NS TFLOP/s against the measured bf16 matmul peak
    from model import PRESETS
    k2 = PRESETS["kimi-k2"]
    shapes = sorted({(min(args.ns_max_batch, math.prod(s[:-2])), *s[-2:]) for name in args.presets
                     for s in _preset_matrices(name)}, key=lambda s: s[0] * s[1] * s[2])
    if args.k2 != "none":
        shapes += [(k2.n_head, k2.qk_nope_head_dim + k2.qk_rope_head_dim, k2.q_lora_rank),
                   (k2.n_head, k2.qk_nope_head_dim + k2.v_head_dim, k2.kv_lora_rank),
                   (k2.n_head, k2.dim, k2.v_head_dim)]
    if args.k2 == "all":
        shapes += [(k, k2.moe_hidden, k2.dim) for k in ((1,) if device == "cpu" else (1, 4, 16))]
    for dtype in (torch.float32, torch.bfloat16):
        peak = f32 if dtype == torch.float32 else b16
        print(f"\nstandard vs Gram Newton-Schulz (5 classic steps, restart before step {GRAM_RESTARTS[0]}), "
              f"{str(dtype)[6:]} on {device}, median of {args.repeats} (K2 experts on a CPU: one run); "
              f"of peak: NS FLOPs a second over the {peak_n}x{peak_n} matmul's:")
        print(f"  {'[B, m, n]':>18} {'FLOPs std/Gram':>14} {'standard ms':>12} {'Gram ms':>9} "
              f"{'speed-up':>8} {'of peak std':>11} {'Gram':>5} {'orth. error std':>15} {'Gram':>6}")
        for (B, m, n), fl, ts, tg, es, eg in _bench_gram(shapes, args.repeats, device, dtype):
            work = [B * ns_flops(m, n, 5, method) / t / 1e9 / peak
                    for method, t in (("standard", ts), ("gram", tg))]
            print(f"  {str([B, m, n]):>18} {fl:13.2f}x {ts * 1e3:12.1f} {tg * 1e3:9.1f} {ts / tg:7.2f}x "
                  f"{work[0]:11.0%} {work[1]:5.0%} {es:15.4f} {eg:6.4f}")
