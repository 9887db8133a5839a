"""
Muon: momentum SGD whose update for each weight matrix is replaced by its nearest semi-orthogonal
matrix (the matrix sign, U V^T of the SVD), computed with a few Newton-Schulz iterations. Matrices
of the same shape (all experts of a layer, all heads, all layers) are stacked and orthogonalized in
one batched call, so a [E, out, in] expert weight is simply E matrices. Parameters Muon must not
touch (embeddings, lm_head, norms, router, biases) are updated by AdamW inside the same optimizer.

Sources:
  Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
    https://kellerjordan.github.io/posts/muon/ (the quintic iteration, the CLASSIC coefficients)
  Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982 (match_rms_adamw lr scaling)
  Amsel et al., "The Polar Express", arXiv 2505.16932 (per-iteration coefficients, POLAR_EXPRESS)
  torch.optim.Muon (torch/optim/_muon.py), whose update this file reproduces bit for bit.

Run the CPU benchmark (ours vs torch.optim.Muon, NS vs matmul throughput):
  python muon.py                  # --presets tiny small --repeats 3 --threads 0
"""

import math

import numpy as np
import torch
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
    # bf16 is what the GPU is fast at. On CPU, fp32 is the safe choice: bf16 matmul speed ranges
    # from ~2x faster (avx512_bf16 / AMX, large matrices) to many times slower (no bf16 units).
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def msign(G, coefficients, eps=1e-7, dtype=None):
    """Approximate U V^T for every matrix of G [..., m, n] (G = U S V^T), one NS step per triple.

    Each matrix is Frobenius-normalised on its own, so its singular values start in [0, 1].
    Returns a new tensor in the compute `dtype` (default: bf16 on CUDA, fp32 on CPU), as
    torch.optim.Muon returns bf16; G is never modified. The op order follows torch.optim.Muon
    exactly, so with dtype=torch.bfloat16 and CLASSIC the result is bitwise equal to it.
    """
    dtype = dtype or default_ns_dtype(G.device)
    m, n = G.shape[-2:]
    X = G.reshape(-1, m, n).to(dtype)  # [B, m, n]
    tall = m > n
    if tall:
        X = X.mT  # [B, n, m]: keeps the Gram matrix X X^T the small side
    # out-of-place div: X may alias G (G already in dtype), and torch's div_ there corrupts momentum
    X = X.div(X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    for a, b, c in coefficients:
        A = X @ X.mT  # [B, k, k], k = min(m, n)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    if tall:
        X = X.mT
    return X.reshape(G.shape)


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
    """Split model.named_parameters() into [muon_group, adamw_group].

    Rule: a parameter with ndim < 2 (norm gains, biases) or whose name contains one of
    `adamw_keywords` (the embedding and lm_head map tokens to and from the hidden space, not one
    hidden state to another as Muon assumes; the router is small and its logits must stay
    calibrated) goes to AdamW.
    Everything else, 2D weights and stacked 3D weights [E, out, in] / [H, head_dim, in], goes to
    Muon. With adjust_lr_fn="match_rms_adamw" one lr serves both groups, so adamw_lr defaults to
    lr and adamw_weight_decay to weight_decay.
    """
    muon, adamw = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        use_adamw = p.ndim < 2 or any(k in name for k in adamw_keywords)
        (adamw if use_adamw else muon).append(p)
    return [
        dict(params=muon, lr=lr, weight_decay=weight_decay, algorithm="muon"),
        dict(params=adamw, lr=lr if adamw_lr is None else adamw_lr, algorithm="adamw",
             weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay),
    ]


# -----------------------------------------------------------------------------
# The optimizer


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update (same arguments, defaults and numerics), generalised to
    stacked matrices [..., m, n] and batched across parameters, plus an AdamW path for param
    groups with algorithm="adamw" (keys lr, betas, adamw_eps, weight_decay; torch.optim.AdamW
    semantics). Extra Muon options: ns_schedule (None: ns_coefficients repeated ns_steps times;
    "polar_express": POLAR_EXPRESS; or an explicit list of (a, b, c)) and ns_dtype (None: bf16 on
    CUDA, fp32 on CPU)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                 adjust_lr_fn=None, ns_schedule=None, ns_dtype=None,
                 betas=(0.9, 0.95), adamw_eps=1e-8, ns_chunk_bytes=4 << 20):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, ns_schedule=ns_schedule, ns_dtype=ns_dtype,
                        betas=tuple(betas), adamw_eps=adamw_eps, algorithm="muon")
        super().__init__(params, defaults)
        # NS runs on chunks of at most this many (fp32-sized) bytes of matrices: a bucket of hundreds of
        # experts as one bmm falls out of cache and runs ~1.5x slower on CPU than 4 MiB chunks
        self.ns_chunk_bytes = ns_chunk_bytes

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
        # 1) momentum, then bucket the updates: one msign call per (matrix shape, dtype, device,
        #    NS settings). This key is also what a sharded path would group on.
        buckets = {}
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                self._adamw(g)
                continue
            mu = g["momentum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p) or p.grad.is_sparse:
                    raise RuntimeError("Muon supports only dense real parameters")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if g["nesterov"] else buf  # msign never writes to it
                ns_dtype = g["ns_dtype"] or default_ns_dtype(p.device)
                key = (tuple(p.shape[-2:]), p.dtype, p.device,
                       tuple(self._schedule(g)), g["eps"], ns_dtype)
                buckets.setdefault(key, []).append((p, g, update))
        # 2) one batched Newton-Schulz per bucket, split back, apply torch.optim.Muon's update.
        #    A sharded update (a DTensor under FSDP2) is gathered whole first, since NS needs complete
        #    matrices, and each rank keeps its own shard of the result: exact, but every rank holds and
        #    orthogonalizes every matrix. The sharded-Muon issue replaces this with batched all-to-alls.
        for (shape, _, _, coeffs, eps, ns_dtype), items in buckets.items():
            X = torch.cat([(u.full_tensor() if isinstance(u, DTensor) else u).reshape(-1, *shape)
                           for _, _, u in items])  # [sum of batch, m, n]
            chunk = max(1, self.ns_chunk_bytes // (4 * shape[0] * shape[1]))
            O = torch.cat([msign(x, coeffs, eps=eps, dtype=ns_dtype) for x in X.split(chunk)])
            sizes = [u.numel() // (shape[0] * shape[1]) for _, _, u in items]
            for (p, g, _), o in zip(items, O.split(sizes)):
                o = o.view(p.shape)
                if isinstance(p, DTensor):  # every rank has all of o: take the local shard, no communication
                    o = distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None)
                lr = g["lr"]
                p.mul_(1 - lr * g["weight_decay"])  # decoupled decay uses the unadjusted lr
                p.add_(o, alpha=-adjust_lr(lr, g["adjust_lr_fn"], p.shape))
        return loss

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


# -----------------------------------------------------------------------------
# Benchmark: python muon.py


def _median_time(fn, repeats, warmup=1):
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _preset_matrices(name):
    """The Muon-group parameter shapes of a model preset, built on the meta device (no memory)."""
    from model import PRESETS, Transformer  # lazy: muon.py itself never imports the model
    with torch.device("meta"):
        model = Transformer(PRESETS[name])
    muon_group, _ = param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    return [tuple(p.shape) for p in muon_group["params"]]


def _bench_step(shapes, repeats):
    """Seconds per step over ALL of a preset's Muon matrices: torch.optim.Muon (bf16 NS, one 2D param
    per expert / head slice, since it takes only 2D) vs ours (stacked params, batched NS, fp32 and bf16)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen) for s in shapes]
    for p in ours:
        p.grad = torch.randn(p.shape, generator=gen)
    ref = [m.clone() for p in ours for m in p.reshape(-1, *p.shape[-2:])]  # one [m, n] per slice
    for r, g in zip(ref, [g for p in ours for g in p.grad.reshape(-1, *p.shape[-2:])]):
        r.grad = g.clone()
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    t_torch = _median_time(torch.optim.Muon(ref, **kw).step, repeats)
    t_fp32 = _median_time(Muon(ours, ns_dtype=torch.float32, **kw).step, repeats)
    t_bf16 = _median_time(Muon(ours, ns_dtype=torch.bfloat16, **kw).step, repeats)
    return t_torch, t_fp32, t_bf16, len(ref)


def _matmul_gflops(n, dtype, repeats):
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _median_time(lambda: a @ b, repeats) / 1e9


def _bench_ns(shapes, repeats, max_batch, coefficients=CLASSIC):
    """Per matrix shape: GFLOP/s of one batched fp32 msign vs a plain fp32 bmm [B, m, n] @ [B, n, m]
    (m <= n, B capped at max_batch: throughput no longer depends on B there). NS per iteration
    costs 2m^2n (X X^T) + 2m^3 (A A) + 2m^2n (B X)."""
    per_shape = {}
    for s in shapes:
        mn = tuple(sorted(s[-2:]))
        per_shape[mn] = min(max_batch, per_shape.get(mn, 0) + math.prod(s[:-2]))
    rows = []
    for (m, n), B in sorted(per_shape.items(), key=lambda kv: kv[0][0] ** 2 * kv[0][1]):
        X = torch.randn(B, m, n)  # [B, m, n]
        Y = torch.randn(B, n, m)  # [B, n, m]
        ns_flops = len(coefficients) * B * (4 * m * m * n + 2 * m**3)
        t_ns = _median_time(lambda: msign(X, coefficients, dtype=torch.float32), repeats)
        t_mm = _median_time(lambda: torch.bmm(X, Y), repeats)
        rows.append(((B, m, n), ns_flops / t_ns / 1e9, 2 * B * m * m * n / t_mm / 1e9))
    return rows


if __name__ == "__main__":
    import argparse
    import os
    parser = argparse.ArgumentParser(description="Benchmark batched Muon against torch.optim.Muon on CPU.")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], help="model presets (model.py)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (median)")
    parser.add_argument("--ns-max-batch", type=int, default=32, help="batch cap in the NS throughput table")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # OpenMP threads wait at a barrier after every op: another busy process on the cores makes
    # small ops milliseconds slower, so print the load next to the figures
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    # torch.optim.Muon always runs NS in bf16; whether that is slow on a CPU decides the step ratio
    f32, b16 = _matmul_gflops(512, torch.float32, 10), _matmul_gflops(512, torch.bfloat16, 10)
    print(f"512x512 matmul on this CPU: fp32 {f32:.0f} GFLOP/s, bf16 {b16:.0f} GFLOP/s (bf16/fp32 {b16 / f32:.2f})")
    for name in args.presets:
        shapes = _preset_matrices(name)
        tt, t32, t16, n = _bench_step(shapes, args.repeats)
        print(f"\n[{name}] one Muon step over all {n} matrices ({len(shapes)} parameters), "
              f"median of {args.repeats}:")
        print(f"  torch.optim.Muon, one 2D param per slice, bf16 NS {tt * 1e3:9.1f} ms")
        print(f"  ours, batched, fp32 NS (CPU default)             {t32 * 1e3:9.1f} ms  {tt / t32:5.2f}x faster")
        print(f"  ours, batched, bf16 NS                           {t16 * 1e3:9.1f} ms  {tt / t16:5.2f}x faster")
        print(f"  {'[B, m, n]':>18} {'NS GFLOP/s':>11} {'bmm GFLOP/s':>12} {'NS/bmm':>7}   (fp32)")
        for (B, m, n), ns, mm in _bench_ns(shapes, args.repeats, args.ns_max_batch):
            print(f"  {str([B, m, n]):>18} {ns:11.1f} {mm:12.1f} {ns / mm:7.0%}")
