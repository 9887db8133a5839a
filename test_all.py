"""Tests for the whole stack: honest, small, and under five minutes on two cores.

    python -m pytest -q test_all.py
"""
import copy
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import model as M
import tasks
from tasks import MALFORMED, TOOLS, DifficultySampler, ToolEnv, corpus, gold_transcript, make_tool_task, render
from muon import CLASSIC, POLAR_EXPRESS, Muon, msign, ns_band, param_groups

HERE = Path(__file__).resolve().parent


# -----------------------------------------------------------------------------
# model.py


def test_tokenizer_round_trip():
    text = "def f(x):\n    return 'héllo' + x  # ünïcode"
    ids = M.encode(text)
    assert max(ids) < 256 and M.decode(ids) == text
    assert M.decode([M.TOKEN["<|user|>"], *M.encode("hi"), M.TOKEN["<|end|>"]]) == "<|user|>hi<|end|>"


def test_kimi_k2_shape_on_meta_matches_published_counts():
    with torch.device("meta"):
        m = M.Transformer(M.PRESETS["kimi-k2"])
    assert all(p.is_meta for p in m.parameters())  # no memory was allocated
    total, active = M.param_counts(m)
    assert abs(total / 1.04e12 - 1) < 0.02, total
    assert abs(active / 32e9 - 1) < 0.02, active
    # the layout the optimizer relies on: stacked experts [E, out, in], per-head attention blocks
    moe = m.layers[1].ffn
    assert tuple(moe.experts.w1.shape) == (384, 2048, 7168) and tuple(moe.experts.w2.shape) == (384, 7168, 2048)
    assert isinstance(m.layers[0].ffn, M.SwiGLU) and isinstance(moe, M.MoE)
    attn = m.layers[0].attn
    assert tuple(attn.wq_b.shape) == (64, 192, 1536) and tuple(attn.wo.shape) == (64, 7168, 128)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(**{**M.ModelConfig().__dict__, **overrides})
    return M.Transformer(cfg)


def test_per_head_parameter_is_a_plain_view_of_the_usual_linear():
    """wq_b [H, qk_head, q_lora] used through einsum equals nn.Linear with weight wq_b.reshape(H*qk_head, q_lora)."""
    attn = tiny_model().layers[0].attn
    c = torch.randn(2, 5, attn.cfg.q_lora_rank)
    ours = torch.einsum("btr,hdr->bhtd", c, attn.wq_b)  # [B, H, T, d]
    H, d, r = attn.wq_b.shape
    ref = (c @ attn.wq_b.reshape(H * d, r).T).view(2, 5, H, d).transpose(1, 2)
    torch.testing.assert_close(ours, ref)


def test_causal_and_positions():
    m = tiny_model().eval()
    x = torch.randint(0, 256, (2, 24))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        a, _ = m(x)
        b, _ = m(y)
        c, _ = m(x, pos=torch.arange(24) + 7)  # RoPE sees global positions
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])
    assert not torch.allclose(a, c)


def test_grouped_mm_and_loop_fallback_agree(monkeypatch):
    m = tiny_model()
    x = torch.randint(0, 256, (3, 40))
    out = {}
    for path in ("grouped", "loop"):
        if path == "loop":
            monkeypatch.setattr(M, "grouped_mm_ok", lambda x, w: False)
        m.zero_grad()
        logits, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        out[path] = (logits.detach(), m.layers[1].ffn.experts.w1.grad.clone(), m.layers[2].ffn.experts.w2.grad.clone())
    for a, b in zip(out["grouped"], out["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert out["grouped"][1].abs().sum() > 0


def test_router_bias_selects_but_does_not_weigh():
    m = tiny_model(num_experts=4, top_k=4)  # every expert picked: the bias can change nothing
    moe = m.layers[1].ffn
    x = torch.randn(2, 7, m.cfg.dim)
    with torch.no_grad():
        ref, _ = moe(x)
        moe.expert_bias.copy_(torch.tensor([5.0, -3.0, 0.0, 1.0]))
        torch.testing.assert_close(moe(x)[0], ref)
    m = tiny_model(num_experts=8, top_k=2)  # a large bias forces its expert into every token's top-k
    moe = m.layers[1].ffn
    moe.tokens_per_expert.zero_()
    with torch.no_grad():
        moe.expert_bias[3] = 10.0
        moe(x)
    assert moe.tokens_per_expert[3] == 14 and moe.tokens_per_expert.sum() == 28
    with torch.no_grad():
        moe.eval()(x)  # evaluation and sampling are not counted: only training tokens steer the bias
    assert moe.tokens_per_expert.sum() == 28
    assert "expert_bias" not in dict(m.named_parameters())  # never trained by gradient


def test_bias_update_moves_toward_balance():
    m = tiny_model(num_experts=8, top_k=2, bias_update_rate=0.01)
    moe = m.layers[1].ffn
    x = torch.randn(8, 64, m.cfg.dim)
    with torch.no_grad():
        moe.router.weight[0] = 0.5 * x.reshape(-1, m.cfg.dim).mean(0)  # expert 0 favoured by most tokens
    loads = []
    for _ in range(50):
        with torch.no_grad():
            moe(x)
        loads.append(moe.tokens_per_expert.max().item() / moe.tokens_per_expert.mean().item())
        m.update_router_bias()
    assert moe.tokens_per_expert.sum() == 0  # counts reset after each update
    assert loads[0] > 1.5 and max(loads[-10:]) < 0.75 * loads[0], loads


def test_switch_aux_loss_reaches_the_router():
    m = tiny_model(aux_loss_coef=0.01)
    x = torch.randint(0, 256, (2, 17))
    _, loss = m(x[:, :-1], x[:, 1:])
    _, plain = tiny_model(aux_loss_coef=0.0)(x[:, :-1], x[:, 1:])
    assert loss.item() > plain.item()  # same weights (same seed), plus a positive balance term
    loss.backward()
    assert m.layers[1].ffn.router.weight.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# muon.py


def _grads(shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(steps)]


def _run(opt, params, grads):
    for gs in grads:
        for p, gr in zip(params, gs):
            p.grad = gr.clone()
        opt.step()


def _random_with_spectrum(s, m, n, gen):
    """G = U diag(s) V^T with orthonormal U [m, k], V [n, k], k = len(s)."""
    k = len(s)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return (U * s) @ V.T


# -----------------------------------------------------------------------------
# parity with torch.optim.Muon


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_matches_torch_muon(nesterov, adjust_lr_fn):
    # square, wide, tall, and two of one shape (so one NS call holds a batch of 2)
    shapes = [(32, 32), (16, 48), (48, 16), (24, 40), (24, 40)]
    torch.manual_seed(0)
    ours = [torch.randn(*s) for s in shapes]
    ref = [p.clone() for p in ours]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    grads = _grads(shapes, 5)
    _run(Muon(ours, ns_dtype=torch.bfloat16, **kw), ours, grads)
    _run(torch.optim.Muon(ref, **kw), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, atol=1e-5, rtol=0)
    # the comparison is not vacuous: the params moved by much more than the tolerance
    torch.manual_seed(0)
    start = [torch.randn(*s) for s in shapes]
    assert min((p - s).abs().max().item() for p, s in zip(ours, start)) > 1e-2


@pytest.mark.parametrize("reference", ["ours", "torch"])
def test_stacked_equals_separate(reference):
    """A [E, m, n] parameter is E matrices: it gives what E separate [m, n] parameters give, with our own
    optimizer (exactly, fp32 NS) and with torch.optim.Muon (bf16 NS, to 1e-5)."""
    E, m, n = 4, 24, 40
    torch.manual_seed(1)
    stacked = torch.randn(E, m, n)
    separate = [stacked[e].clone() for e in range(E)]
    grads = _grads([(E, m, n)], 4, seed=3)
    dtype = torch.float32 if reference == "ours" else torch.bfloat16
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    _run(Muon([stacked], ns_dtype=dtype, **kw), [stacked], grads)
    ref = Muon(separate, ns_dtype=dtype, **kw) if reference == "ours" else torch.optim.Muon(separate, **kw)
    _run(ref, separate, [[g[0][e] for e in range(E)] for g in grads])
    tol = 0.0 if reference == "ours" else 1e-5
    torch.testing.assert_close(stacked, torch.stack(separate), atol=tol, rtol=0)


# -----------------------------------------------------------------------------
# Newton-Schulz properties


@pytest.mark.parametrize("name,coeffs", [("classic", CLASSIC), ("polar_express", POLAR_EXPRESS)])
@pytest.mark.parametrize("m,n", [(32, 32), (24, 64), (64, 24)])
def test_singular_values_in_band(name, coeffs, m, n):
    gen = torch.Generator().manual_seed(5)
    k = min(m, n)
    for trial in range(3):
        s = torch.logspace(-2, 0, k, dtype=torch.float64)[torch.randperm(k, generator=gen)]
        G = _random_with_spectrum(s, m, n, gen) * (10.0 ** (trial - 1))  # scale must not matter
        lo = (s.min() / s.norm()).item()  # smallest singular value after Frobenius normalisation
        band = ns_band(coeffs, lo)
        sv = torch.linalg.svdvals(msign(G.float(), coeffs, dtype=torch.float32).double())
        assert sv.min().item() >= band[0] - 1e-3, (name, sv.min().item(), band)
        assert sv.max().item() <= band[1] + 1e-3, (name, sv.max().item(), band)


def test_polar_express_band_is_tighter():
    for lo in [1e-1, 1e-2, 1e-3]:
        c_lo, c_hi = ns_band(CLASSIC, lo)
        p_lo, p_hi = ns_band(POLAR_EXPRESS, lo)
        assert p_hi - p_lo < c_hi - c_lo, lo
        assert p_lo > c_lo, lo


def test_scale_and_transpose_invariance():
    torch.manual_seed(6)
    G = torch.randn(3, 2, 24, 40)  # two leading batch dims
    for coeffs in (CLASSIC, POLAR_EXPRESS):
        O = msign(G, coeffs, dtype=torch.float32)
        assert O.shape == G.shape
        torch.testing.assert_close(msign(7.5 * G, coeffs, dtype=torch.float32), O, atol=1e-5, rtol=0)
        torch.testing.assert_close(msign(G.mT, coeffs, dtype=torch.float32), O.mT, atol=1e-5, rtol=0)


def test_per_matrix_normalisation():
    torch.manual_seed(7)
    G1, G2 = torch.randn(32, 48), 1000.0 * torch.randn(32, 48)
    O = msign(torch.stack([G1, G2]), CLASSIC, dtype=torch.float32)
    torch.testing.assert_close(O[0], msign(G1, CLASSIC, dtype=torch.float32), atol=1e-6, rtol=0)
    torch.testing.assert_close(O[1], msign(G2, CLASSIC, dtype=torch.float32), atol=1e-6, rtol=0)
    # negative control: dividing by the norm of the whole batch leaves G1 ~1e-3 in size, and
    # the iteration cannot lift it to ~1: the check above would catch that normalisation
    X = torch.stack([G1, G2])
    X = X / X.norm()
    for a, b, c in CLASSIC:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    assert (X[0] - O[0]).abs().max() > 0.1
    assert torch.linalg.svdvals(O[0]).min() > 0.5


def test_msign_does_not_modify_input():
    G = torch.randn(16, 16, dtype=torch.bfloat16)
    G0 = G.clone()
    msign(G, CLASSIC, dtype=torch.bfloat16)  # G already in the compute dtype: X aliases G at first
    assert torch.equal(G, G0)


def test_bf16_params_momentum_not_corrupted():
    # torch.optim.Muon with bf16 params and nesterov=False divides the momentum buffer in place
    p = torch.randn(16, 32, dtype=torch.bfloat16)
    opt = Muon([p], lr=0.02, nesterov=False, momentum=0.9)
    g = torch.randn(16, 32, dtype=torch.bfloat16)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], (0.1 * g.float()).bfloat16())


# -----------------------------------------------------------------------------
# state, groups, AdamW, validation


def test_state_dict_round_trip():
    shapes = [(3, 16, 24), (24, 16), (16,)]
    torch.manual_seed(8)
    params = [torch.randn(*s) for s in shapes]
    groups = [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw", lr=0.01)]
    opt = Muon(groups, lr=0.02, adjust_lr_fn="match_rms_adamw", ns_schedule="polar_express")
    grads = _grads(shapes, 4, seed=9)
    _run(opt, params, grads[:2])
    sd = copy.deepcopy(opt.state_dict())
    params2 = [p.clone() for p in params]
    groups2 = [dict(params=params2[:2]), dict(params=params2[2:], algorithm="adamw", lr=0.5)]
    opt2 = Muon(groups2)  # different hyperparameters: load_state_dict must restore them
    opt2.load_state_dict(sd)
    assert opt2.param_groups[1]["algorithm"] == "adamw" and opt2.param_groups[1]["lr"] == 0.01
    assert opt2.param_groups[0]["ns_schedule"] == "polar_express"
    _run(opt, params, grads[2:])
    _run(opt2, params2, grads[2:])
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.attn_w = torch.nn.Parameter(torch.randn(4, 8, 16))  # [n_head, head_dim, in]
        self.experts_w1 = torch.nn.Parameter(torch.randn(3, 32, 16))  # [E, out, in]
        self.proj = torch.nn.Linear(16, 16)  # weight -> Muon, bias -> AdamW
        self.router = torch.nn.Linear(16, 3, bias=False)
        self.norm = torch.nn.RMSNorm(16)
        self.lm_head = torch.nn.Linear(16, 50, bias=False)


def test_param_groups_split():
    model = _Tiny()
    muon_g, adamw_g = param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    name = {id(p): n for n, p in model.named_parameters()}
    assert sorted(name[id(p)] for p in muon_g["params"]) == ["attn_w", "experts_w1", "proj.weight"]
    assert sorted(name[id(p)] for p in adamw_g["params"]) == [
        "embed.weight", "lm_head.weight", "norm.weight", "proj.bias", "router.weight"]
    assert adamw_g["algorithm"] == "adamw" and adamw_g["lr"] == 0.02 and adamw_g["weight_decay"] == 0.1
    Muon(param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1), adjust_lr_fn="match_rms_adamw")


def test_adamw_group_matches_torch_adamw():
    shapes = [(50, 16), (16,), (3, 16)]
    torch.manual_seed(10)
    ours = [torch.randn(*s) for s in shapes]
    ref = [p.clone() for p in ours]
    grads = _grads(shapes, 5, seed=11)
    _run(Muon([dict(params=ours, algorithm="adamw")], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95),
              adamw_eps=1e-8), ours, grads)
    _run(torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8), ref, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, atol=1e-7, rtol=0)


def test_closure_and_validation():
    p = torch.randn(8, 8, requires_grad=True)
    opt = Muon([p], lr=0.02)

    def closure():
        loss = (p**2).sum()
        loss.backward()
        return loss

    p0 = p.detach().clone()
    loss = opt.step(closure)
    assert torch.equal(loss, (p0**2).sum()) and not torch.equal(p.detach(), p0)
    with pytest.raises(ValueError, match=r"\(8,\)"):
        Muon([torch.randn(8)])
    with pytest.raises(ValueError):
        Muon([torch.randn(8, 8)], lr=-1.0)
    with pytest.raises(ValueError):
        Muon([torch.randn(8, 8)], adjust_lr_fn="bogus")
    with pytest.raises(ValueError):
        Muon([dict(params=[torch.randn(8)], algorithm="sgd")])
    with pytest.raises(ValueError):
        Muon([torch.randn(8, 8)], ns_schedule="fast")
    Muon([dict(params=[torch.randn(8)], algorithm="adamw")])  # 1-D is fine for AdamW


# -----------------------------------------------------------------------------
# train.py, run as a user would: in a subprocess


def run_train(*flags, world=1):
    """train.py as a user runs it: `python train.py` at world 1, torchrun (gloo on CPU) above."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    return subprocess.run([sys.executable, *launcher, str(HERE / "train.py"), *flags], capture_output=True,
                          text=True, env=env, timeout=300)


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


SMALL_RUN = ["--batch-size", "4", "--seq-len", "32", "--log-every", "5", "--eval-batches", "2", "--warmup", "40"]


def test_train_learns_and_resume_continues_exactly(tmp_path, par_data):
    r = run_train(*SMALL_RUN, "--steps", "40", "--eval-every", "20", "--out", str(tmp_path / "learn"))
    assert r.returncode == 0, r.stderr
    rows = read_metrics(tmp_path / "learn")  # the default corpus: this project's and the stdlib's sources
    assert [row["step"] for row in rows] == list(range(41))
    vals = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.5, vals  # validation loss clearly falls
    assert "MFU" in r.stdout and "load max/mean" in r.stdout
    # stop at 20, resume to 40: the same 40 losses as the uninterrupted run (warmup spans all steps, so the
    # lr schedule does not depend on --steps here); fixed data, so edits to the sources cannot move it
    a, b, data = tmp_path / "a", tmp_path / "b", ["--data", str(par_data)]
    for flags, out in ((["--steps", "40"], a), (["--steps", "20"], b), (["--steps", "40", "--resume"], b)):
        r = run_train(*SMALL_RUN, *flags, *data, "--eval-every", "20", "--out", str(out))
        assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [row["step"] for row in rows_b] == list(range(41))
    np.testing.assert_allclose([r["loss"] for r in rows_b[1:]], [r["loss"] for r in rows_a[1:]], rtol=1e-5)


def test_train_reads_text_folders_and_bin_files(tmp_path):
    (tmp_path / "texts").mkdir()
    for i in range(3):
        (tmp_path / "texts" / f"{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16).tofile(tmp_path / "train.bin")
    for data in ("texts", "train.bin"):
        r = run_train(*SMALL_RUN, "--steps", "3", "--data", str(tmp_path / data), "--out", str(tmp_path / "o"))
        assert r.returncode == 0, r.stderr
        assert read_metrics(tmp_path / "o")[-1]["step"] == 3


def test_train_bad_input_is_one_clear_line(tmp_path):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad" / "out" / "step-00000010"
    bad.mkdir(parents=True)
    (bad / ".metadata").write_bytes(b"not a checkpoint at all")
    (bad / "meta.json").write_text(json.dumps({"step": 10, "config": M.ModelConfig().__dict__, "args": {}}))
    cases = {
        "unknown preset": ["--preset", "huge"],
        "must be positive": ["--steps", "0"],
        "--batch-size must be positive": ["--batch-size", "-2"],
        "exceeds the tiny preset's context": ["--seq-len", "100000"],
        "no such file or folder": ["--data", str(tmp_path / "missing")],
        "no text found": ["--data", str(tmp_path / "empty")],
        "corrupt or unreadable": ["--resume", "--out", str(tmp_path / "bad" / "out")],
        "no checkpoint": ["--resume", "--out", str(tmp_path / "nothing")],
        "GiB of weights, gradients and optimizer state": ["--preset", "kimi-k2"],
        "ep(3) = 3 does not divide world size 1": ["--ep", "3"],
        "the RL stage needs": ["--stage", "rl", "--group-size", "1"],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {k: subprocess.Popen([sys.executable, str(HERE / "train.py"), *v], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for k, v in cases.items()}
    for expected, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 2, (expected, stderr)
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, (expected, stderr)
        assert stderr.startswith("error: ") and expected in stderr, (expected, stderr)


# -----------------------------------------------------------------------------
# mesh.py and train.py under torchrun: real gloo process groups on CPU, compared with one process


def test_layout_arithmetic_and_errors_name_every_factor():
    from mesh import LayoutError, describe, make_layout
    L = make_layout(8, cp=2, ep=8, num_experts=16, seq_len=32, batch_size=8)
    assert (L.dp_replicate, L.dp_shard, L.cp, L.ep_replicate, L.ep_shard, L.ep) == (1, 4, 2, 1, 1, 8)
    assert L.shared_mesh_world() == 16  # the seed's example: one shared mesh needs 16 ranks, two meshes need 8
    assert [L.coords(r) for r in (0, 1, 2, 7)] == [(0, 0), (0, 1), (1, 0), (3, 1)]  # (dp_rank, cp_rank)
    assert "cp=[0, 1]" in describe(L, [0])[0] and "ep=[0, 1, 2, 3, 4, 5, 6, 7]" in describe(L, [0])[0]
    H = make_layout(8, dp_replicate=2, ep=2, ep_replicate=2)
    assert (H.dp_shard, H.ep_shard) == (4, 2)
    bad = {
        "dp_replicate(2) * cp(3) = 6 does not divide world size 8": dict(dp_replicate=2, cp=3),
        "ep(4) must divide dp_shard(2) * cp(1) = 2": dict(dp_replicate=4, ep=4),
        "num_experts(20) is not divisible by ep(8)": dict(ep=8, num_experts=20),
        "seq_len(30) is not divisible by cp(4)": dict(cp=4, seq_len=30),
        "batch_size(6) is not divisible by dp_replicate(1) * dp_shard(8) = 8": dict(batch_size=6),
    }
    for expected, kw in bad.items():
        with pytest.raises(LayoutError) as e:
            make_layout(8, **kw)
        assert expected in str(e.value), (expected, str(e.value))


def test_mesh_demo_prints_both_meshes_for_a_large_world():
    r = subprocess.run([sys.executable, str(HERE / "mesh.py"), "--world", "2048", "--dp-replicate", "4", "--cp", "2",
                        "--ep", "64", "--num-experts", "384"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "rank    0 | dense dp_replicate=[0, 512, 1024, 1536]" in r.stdout and "ep=[0, 1, ..., 63]" in r.stdout
    r = subprocess.run([sys.executable, str(HERE / "mesh.py"), "--world", "8", "--cp", "2", "--ep", "8"],
                       capture_output=True, text=True, timeout=60)
    assert "needs at least dp_replicate(1) * cp(2) * ep(8) = 16 ranks" in r.stdout


def torchrun(world, *flags):
    r = run_train(*flags, world=world)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


PAR_RUN = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--log-every", "1", "--warmup", "40"]


@pytest.fixture(scope="module")
def par_data(tmp_path_factory):
    """A fixed token file, so that edits to the project's sources (the default corpus) do not move the test."""
    path = tmp_path_factory.mktemp("data") / "train.bin"
    text = " ".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000))
    np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16).tofile(path)
    return path


def final_params(out):
    """The parameters in a run's newest DCP checkpoint, loaded into one plain (unsharded) model."""
    import torch.distributed.checkpoint as dcp
    ckpt = sorted(out.glob("step-*"))[-1]
    state = {"model": M.Transformer(M.ModelConfig()).state_dict()}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    return state["model"]


@pytest.fixture(scope="module")
def single_process(par_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("w1")
    torchrun(1, *PAR_RUN, "--steps", "4", "--eval-every", "4", "--data", str(par_data), "--out", str(out))
    return read_metrics(out), final_params(out)


@pytest.mark.parametrize("world,flags", [(2, []), (4, ["--dp-replicate", "2", "--ep-replicate", "2"]),
                                         (4, ["--ep", "4"]),
                                         (4, ["--cp", "2", "--ep", "4"]), (8, ["--cp", "2", "--ep", "8"])],
                         ids=["W2-fsdp", "W4-hsdp", "W4-ep4", "W4-cp2-ep4", "W8-cp2-ep8"])
def test_parallel_layout_matches_single_process(world, flags, par_data, single_process, tmp_path):
    rows, params = single_process
    torchrun(world, *PAR_RUN, *flags, "--steps", "4", "--eval-every", "4", "--data", str(par_data),
             "--out", str(tmp_path))
    rows_w = read_metrics(tmp_path)
    assert [r["step"] for r in rows_w] == [r["step"] for r in rows]
    np.testing.assert_allclose([r["loss"] for r in rows_w], [r["loss"] for r in rows], rtol=1e-5)
    np.testing.assert_allclose(rows_w[-1]["val_loss"], rows[-1]["val_loss"], rtol=1e-5)
    # the gradient norm spans both meshes: dense and expert shards each reduce on their own, then combine
    np.testing.assert_allclose([r["grad_norm"] for r in rows_w[1:]], [r["grad_norm"] for r in rows[1:]], rtol=1e-4)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05  # the runs did move
    params_w = final_params(tmp_path)
    for name, p in params.items():
        torch.testing.assert_close(params_w[name], p, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
    expert = "layers.1.ffn.experts.w1"
    assert (params[expert] - M.Transformer(M.ModelConfig()).state_dict()[expert]).abs().max() > 1e-3


def test_expert_weights_shard_on_dim1_when_experts_are_fewer_than_ranks(par_data, tmp_path):
    """2 experts, EP=2 on 4 ranks: each rank holds 1 expert and the expert-shard group has 2 ranks, so FSDP
    shards the expert weights on dim 1; the run still matches one process."""
    rows = {}
    for world, flags in ((1, []), (4, ["--ep", "2"])):
        out = tmp_path / f"w{world}"
        r = torchrun(world, *PAR_RUN, *flags, "--num-experts", "2", "--steps", "3", "--eval-every", "3",
                     "--data", str(par_data), "--out", str(out))
        rows[world] = [row["loss"] for row in read_metrics(out)]
    assert "1 experts a rank, FSDP Shard(1)" in r.stdout
    np.testing.assert_allclose(rows[4], rows[1], rtol=1e-5)


def test_checkpoint_resumes_at_another_world_size(par_data, single_process, tmp_path):
    """Stopped at step 2 with W=2 (pure FSDP), resumed with W=4 (CP=2, EP=4): steps 3 and 4 give the losses
    of the uninterrupted single-process run (the warmup spans all steps, so the lr schedule agrees)."""
    torchrun(2, *PAR_RUN, "--steps", "2", "--eval-every", "2", "--data", str(par_data), "--out", str(tmp_path))
    r = torchrun(4, *PAR_RUN, "--cp", "2", "--ep", "4", "--steps", "4", "--eval-every", "4", "--resume",
                 "--data", str(par_data), "--out", str(tmp_path))
    assert "resumed from" in r.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in single_process[0]], rtol=1e-5)


def test_bad_layout_stops_every_rank_with_one_line(tmp_path):
    """Workers started as torchrun starts them (RANK, WORLD_SIZE, ...): each prints the same single line and
    exits 2 before any collective, so no rank is left waiting."""
    procs = []
    for rank in range(4):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
               "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "train.py"), "--cp", "2", "--ep", "3",
                                       "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    for p in procs:
        _, stderr = p.communicate(timeout=120)
        assert p.returncode == 2 and stderr.strip().splitlines() == [
            "error: layout: ep_replicate(1) * ep(3) = 3 does not divide world size 4, so ep_shard = "
            "world / (ep_replicate * ep) is not an integer"], stderr


# -----------------------------------------------------------------------------
# Sharded Muon: DTensor parameters on gloo process groups equal full-matrix Muon on one process


def _sharded_muon_cases(world):
    """name -> (global shape, mesh shape, placements); built the same way on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    cases = {
        "2d-shard0-uneven": ((37, 50), (world,), [Shard(0)]),
        "2d-shard0-empty": ((5, 24), (world,), [Shard(0)]),  # 5 rows over up to 8 ranks: some hold none
        "2d-shard1-uneven": ((24, 13), (world,), [Shard(1)]),
        "experts-dim0-local": ((6, 16, 24), (world,), [Shard(0)]),  # whole matrices per rank, no traffic
        "experts-dim1-a2a": ((6, 16, 24), (world,), [Shard(1)]),
        "heads-dim0-local": ((3, 8, 32), (world,), [Shard(0)]),
        "hsdp-replicate-shard": ((37, 50), (2, world // 2), [Replicate(), Shard(0)]),
    }
    for i in range(3):  # one bucket of 3 matrices, not a multiple of the group size
        cases[f"count-not-multiple-{i}"] = ((20, 30), (world,), [Shard(0)])
    return cases


def _sharded_muon_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from mesh import build_meshes, make_layout
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cases = _sharded_muon_cases(world)
    meshes = {}
    full, dparams = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, (shape, mesh_shape, placements) in cases.items():
        if mesh_shape not in meshes:
            meshes[mesh_shape] = DeviceMesh("cpu", torch.arange(world).view(mesh_shape))
        full[name] = torch.randn(shape, generator=gen)
        dparams[name] = distribute_tensor(full[name].clone(), meshes[mesh_shape], placements, src_data_rank=None)
    # both meshes of the dual layout at once: a dense weight on the dense FSDP mesh, experts on the expert mesh
    L = make_layout(world, cp=2, ep=2)
    _, expert_mesh, dense_fsdp, expert_fsdp = build_meshes(L, "cpu")
    full["dual-dense"], full["dual-experts"] = torch.randn(40, 24, generator=gen), torch.randn(4, 16, 24, generator=gen)
    dparams["dual-dense"] = distribute_tensor(full["dual-dense"].clone(), dense_fsdp, [Shard(0)], src_data_rank=None)
    dparams["dual-experts"] = distribute_tensor(full["dual-experts"].clone(), expert_mesh["ep_shard", "ep"],
                                                [Shard(1), Shard(0)], src_data_rank=None)
    names = list(full)
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
    ref = [full[n].clone() for n in names]
    inflight = {2: 0, 4: 1, 8: 256 << 20}[world]  # serial; one transfer ahead; the default window
    opt_ref, opt = Muon(ref, **kw), Muon([dparams[n] for n in names], **kw, max_inflight_bytes=inflight)
    naive = [dparams[n].to_local().clone() for n in names]  # the classic mistake: NS on each local shard
    opt_naive = Muon([t for t in naive if t.numel()], **kw)
    for step in range(3):
        for n, r, q in zip(names, ref, naive):
            g = torch.randn(full[n].shape, generator=gen)
            r.grad = g.clone()
            dparams[n].grad = distribute_tensor(g.clone(), dparams[n].device_mesh, dparams[n].placements,
                                                src_data_rank=None)
            q.grad = dparams[n].grad.to_local().clone()
        opt_ref.step(), opt.step(), opt_naive.step()
    errs = {n: (dparams[n].full_tensor() - r).abs().max().item() for n, r in zip(names, ref)}
    moved = {n: (r - full[n]).abs().max().item() for n, r in zip(names, ref)}
    naive_err = {}
    for n, q in zip(names, naive):  # compare the naive local result with the matching piece of the reference
        piece = distribute_tensor(ref[names.index(n)], dparams[n].device_mesh, dparams[n].placements,
                                  src_data_rank=None).to_local()
        naive_err[n] = (q - piece).abs().max().item() if q.numel() else 0.0
    naive_err = {n: max(e, 0.0) for n, e in naive_err.items()}
    all_naive = [None] * world
    dist.all_gather_object(all_naive, naive_err)
    if rank == 0:
        out.put((errs, moved, {n: max(d[n] for d in all_naive) for n in names}, opt.stats))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sharded_muon_equals_full_matrix_muon(world):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = 29600 + world
    mp.start_processes(_sharded_muon_worker, args=(world, port, out), nprocs=world, start_method="spawn")
    errs, moved, naive, stats = out.get()
    for name, err in errs.items():
        assert err < 1e-5, (name, err)
        assert moved[name] > 1e-2, (name, moved[name])  # the parameters really moved
    # negative control: NS on each rank's piece alone is a different update wherever a matrix is split
    for name in ("2d-shard0-uneven", "2d-shard1-uneven", "experts-dim1-a2a") + ("hsdp-replicate-shard",) * (world > 2):
        assert naive[name] > 1e-3, (name, naive[name])
    assert naive["experts-dim0-local"] < 1e-5  # whole matrices per rank: local NS is the right thing there
    assert stats["a2a_bytes"] > 0


# -----------------------------------------------------------------------------
# grpo.py: the Dr. GRPO objective


def _token_batch(adv, lengths, T=12):
    """Leaf log-probs [N, T] with a policy mask covering the first `lengths[i]` tokens of row i."""
    logp = torch.full((len(adv), T), -1.0, requires_grad=True)
    mask = torch.zeros(len(adv), T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return logp, mask, torch.tensor(adv, dtype=torch.float32)


def test_dr_grpo_advantages_and_normaliser():
    from grpo import GRPOConfig, group_advantages, policy_loss
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(r, 4)
    torch.testing.assert_close(adv.view(2, 4).sum(-1), torch.zeros(2))
    assert adv[0].item() == 0.5  # no division by the group's std (it would give 0.866)
    cfg, norm = GRPOConfig(), 2 * 128
    # at ratio 1 the gradient is REINFORCE's, -A / norm on every policy token, whatever the sequence length
    logp, mask, a = _token_batch([1.0, 1.0], [10, 3])
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), a, mask, cfg, norm)
    loss.backward()
    torch.testing.assert_close(logp.grad, -a[:, None] * mask / norm)
    assert logp.grad[0, 0] == logp.grad[1, 0]  # long and short sequences: the same per-token gradient
    assert (logp.grad[mask == 0] == 0).all()  # prompt, tool output, padding: no gradient


def test_clipped_tokens_get_no_gradient():
    from grpo import GRPOConfig, policy_loss
    cfg = GRPOConfig(eps_low=0.2, eps_high=0.28)
    logp, mask, a = _token_batch([1.0, -1.0], [4, 4])
    old = logp.detach() - torch.tensor([[math.log(1.5)], [math.log(0.5)]])  # ratios 1.5 (A>0) and 0.5 (A<0)
    old[:, 2:] = logp.detach()[:, 2:]  # ratio 1 on the last two policy tokens: inside the clip range
    loss, clip_frac = policy_loss(logp, old, old, a, mask, cfg, 100.0)
    loss.backward()
    assert (logp.grad[:, :2] == 0).all() and (logp.grad[:, 2:4] != 0).all()
    assert clip_frac == 0.5


def test_kl_estimators_match_the_exact_kl():
    from grpo import kl_estimates
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    exact = (p * (p / q).log()).sum()
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = kl_estimates(p.log()[x], q.log()[x])
    for name in ("k1", "k3"):
        assert abs(est[name].mean() - exact) < 0.01, (name, est[name].mean().item(), exact.item())
    assert (est["k3"] >= 0).all()  # k3 is non-negative per sample, k1 is not
    assert (est["k1"] < 0).any()


class _ScriptedEnv:
    """A two-turn environment for loss tests: the reply is fixed, the reward is given."""

    def __init__(self, reward, turns=2):
        self.r, self.left = reward, turns

    def first_turns(self):
        return [("user", "add 2 and 3 using tools: add")]

    def step(self, text):
        self.left -= 1
        return ("5" if self.left else None), self.left == 0

    def reward(self):
        return self.r


def test_equal_rewards_give_zero_gradient_and_summaries_share_the_reward():
    from grpo import GRPOConfig, SUMMARY_REQUEST, batch, grpo_loss, rollout
    torch.manual_seed(0)
    model = M.Transformer(M.ModelConfig())
    cfg = GRPOConfig(group_size=2, max_message_tokens=6, context_budget=40)
    gen = torch.Generator().manual_seed(0)
    trajs = rollout(model, [_ScriptedEnv(1.0, 3), _ScriptedEnv(1.0, 3)], cfg, gen)
    loss, stats, _ = grpo_loss(model, trajs, cfg)
    loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())  # A = 0 everywhere
    # the 40-token budget forced a summary: a second segment, trained with the trajectory's reward
    t = trajs[0]
    assert len(t.segments) >= 2
    first = t.segments[0]
    request = M.encode(SUMMARY_REQUEST)
    start = next(i for i in range(len(first.tokens)) if first.tokens[i:i + len(request)] == request)
    assert not any(first.policy[start:start + len(request)])  # the inserted request is not trained
    assert any(first.policy[start + len(request):])  # the summary after it is the policy's
    assert t.segments[1].tokens[:len(t.prompt)] == t.prompt  # continues from prompt + summary
    trajs[0].reward, trajs[1].reward = 1.0, 0.0
    _, _, _, owner = batch(trajs)
    assert (owner == 0).sum() == len([s for s in trajs[0].segments if any(s.policy)])
    model.zero_grad()
    loss, _, _ = grpo_loss(model, trajs, cfg)
    loss.backward()
    assert sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None) > 0


def test_sampler_precision_and_truncated_importance_weights():
    from grpo import GRPOConfig, fake_quantize, grpo_loss, rollout, token_logprobs
    torch.manual_seed(0)
    model = M.Transformer(M.ModelConfig())
    envs = lambda: [_ScriptedEnv(1.0), _ScriptedEnv(0.0)]
    same = GRPOConfig(group_size=2, max_message_tokens=6)
    trajs = rollout(model, envs(), same, torch.Generator().manual_seed(0))
    loss, _, _ = grpo_loss(model, trajs, same)
    loss_no_tis, _, _ = grpo_loss(model, trajs, GRPOConfig(group_size=2, max_message_tokens=6, tis_cap=1e9))
    assert loss.item() == loss_no_tis.item()  # identical precision: every importance weight is exactly 1
    q = fake_quantize(model, 8)
    w = next(p for n, p in q.named_parameters() if n.endswith("experts.w1"))
    w0 = next(p for n, p in model.named_parameters() if n.endswith("experts.w1"))
    assert 0 < (w - w0).abs().max() < 0.01 * w0.abs().max()  # 8-bit blocks: close, not equal
    low = GRPOConfig(group_size=2, max_message_tokens=6, sampler_bits=8, tis_cap=1.5)
    trajs = rollout(model, envs(), low, torch.Generator().manual_seed(0))
    from grpo import batch
    tokens, mask, sampler_logp, _ = batch(trajs)
    with torch.no_grad():
        w = (token_logprobs(model, tokens) - sampler_logp).exp()[mask]
    assert (w != 1).any() and torch.allclose(w, torch.ones_like(w), atol=0.2)  # a small, real mismatch


# -----------------------------------------------------------------------------
# tasks.py: the tool-use task family

def _replay(task, turns):
    """Drive a ToolEnv with the assistant turns of a transcript; check every tool reply matches the transcript."""
    env = ToolEnv(task, max_turns=8)
    assert env.first_turns() == turns[:1]
    for i, (role, text) in enumerate(turns[1:], start=1):
        if role != "assistant":
            continue
        reply, done = env.step(text)
        if reply is not None:
            assert turns[i + 1] == ("tool", reply)
    assert done
    return env


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_gold_transcripts_earn_reward_one(difficulty):
    rng = random.Random(difficulty)
    for _ in range(50):
        task = make_tool_task(rng, difficulty)
        env = _replay(task, gold_transcript(task, rng, p_mistake=0.5))
        assert env.reward() == 1.0
        assert env.malformed == 0 and env.tool_calls == difficulty + env.tool_errors


def test_gold_with_mistake_shows_error_then_recovers():
    rng = random.Random(0)
    task = make_tool_task(rng, 2)
    turns = gold_transcript(task, rng, p_mistake=1.0)
    errors = [t for r, t in turns if r == "tool" and t.startswith("error: tool not found")]
    assert len(errors) == 1 and len(turns) == 1 + 2 * (task.difficulty + 1) + 1
    env = _replay(task, turns)
    assert env.tool_errors == 1 and env.reward() == 1.0


def test_wrong_answer_gets_zero_and_no_answer_gets_zero():
    task = make_tool_task(random.Random(1), 1)
    env = ToolEnv(task)
    assert env.step(f"answer {task.answer + 1}") == (None, True)
    assert env.reward() == 0.0
    env = ToolEnv(task, max_turns=2)  # runs out of turns without answering
    name, a, b = task.plan[0]
    assert env.step(f"call {name} {a} {b}")[1] is False
    assert env.step(f"call {name} {a} {b}")[1] is True
    assert env.reward() == 0.0
    with pytest.raises(RuntimeError):
        env.step("answer 0")


def test_absent_tool_error_lists_available_tools():
    task = tasks.ToolTask("tools: add, sub. compute add(3,4)", ["add", "sub"], 7, 1, [("add", 3, 4)])
    env = ToolEnv(task)
    reply, done = env.step("call mul 3 4")
    assert reply == "error: tool not found: mul. available tools: add, sub" and not done
    assert (env.tool_calls, env.tool_errors, env.malformed) == (1, 1, 0)
    assert env.step("call add 3 4") == ("7", False)
    assert env.step(" answer 7\n") == (None, True)  # surrounding whitespace is tolerated
    assert env.reward() == 1.0 and (env.tool_calls, env.tool_errors) == (2, 1)


@pytest.mark.parametrize("text", ["call add 3", "call add 3 4 5", "call add three 4", "CALL add 3 4", "answer",
                                  "answer seven", "the answer is 7", ""])
def test_malformed_messages_are_reported(text):
    task = tasks.ToolTask("tools: add, sub. compute add(3,4)", ["add", "sub"], 7, 1, [("add", 3, 4)])
    env = ToolEnv(task)
    assert env.step(text) == (MALFORMED, False)
    assert (env.malformed, env.tool_calls, env.tool_errors) == (1, 0, 0)
    assert env.turns[-2:] == [("assistant", text), ("tool", MALFORMED)]


def test_answer_reachable_with_offered_tools_via_plan():
    rng = random.Random(2)
    for _ in range(500):
        d = rng.randint(1, tasks.MAX_DIFFICULTY)
        task = make_tool_task(rng, d)
        assert len(task.plan) == d == task.difficulty
        assert 2 <= len(task.tools) <= len(TOOLS) - 1  # some tool is always absent
        assert task.tools == [t for t in TOOLS if t in task.tools]  # canonical order: does not leak the plan
        prev = None
        for name, a, b in task.plan:
            assert name in task.tools
            assert prev is None or prev in (a, b)  # each call consumes the previous result
            prev = TOOLS[name](a, b)
            assert 0 <= prev <= 99
        assert prev == task.answer
        # The question's expression evaluates to the answer with the same tools.
        expr = task.question.split("compute ", 1)[1]
        assert eval(expr, {"__builtins__": {}}, {n: f for n, f in TOOLS.items()}) == task.answer
        assert task.question.startswith(f"tools: {', '.join(task.tools)}. ")


def test_make_tool_task_rejects_bad_difficulty():
    with pytest.raises(ValueError):
        make_tool_task(random.Random(0), 0)
    with pytest.raises(ValueError):
        make_tool_task(random.Random(0), tasks.MAX_DIFFICULTY + 1)


def test_sampler_moves_up_on_success_and_down_on_failure():
    s = DifficultySampler(window=16, up=0.8, down=0.2)
    rng = random.Random(0)
    assert s.level == 1 and all(s.sample(rng) == 1 for _ in range(20))
    for _ in range(15):
        s.update(1, 1.0)
    assert s.level == 1  # not before a full window
    s.update(1, 1.0)
    assert s.level == 2
    for _ in range(15):
        s.update(2, 0.0)
    assert s.level == 2
    s.update(2, 0.0)
    assert s.level == 1
    assert s.pass_rate(1) is None  # cleared on return: level 1 must be re-earned, no instant bounce
    # Sustained success climbs to the top and stays there.
    for _ in range(16 * tasks.MAX_DIFFICULTY):
        s.update(s.level, 1.0)
    assert s.level == tasks.MAX_DIFFICULTY
    levels = [s.sample(rng) for _ in range(2000)]
    assert 0.7 < levels.count(s.level) / len(levels) < 0.8 and min(levels) == 1


def test_sampler_middling_rate_holds_level():
    s = DifficultySampler(window=16)
    for _ in range(16):
        s.update(1, 1.0)
    for i in range(200):
        s.update(2, float(i % 2))
    assert s.level == 2


def test_sampler_state_dict_roundtrip():
    s = DifficultySampler(window=8)
    for r in [1.0] * 8 + [0.0, 1.0, 1.0]:
        s.update(s.level, r)
    state = s.state_dict()
    assert isinstance(state, dict) and state["level"] == 2 and state["results"]["2"] == [0.0, 1.0, 1.0]
    t = DifficultySampler(window=8)
    t.load_state_dict(state)
    assert t.state_dict() == state
    for _ in range(5):
        s.update(2, 1.0)
        t.update(2, 1.0)
    assert s.level == t.level == 3


def test_render_uses_exact_special_strings():
    turns = [("user", "q"), ("assistant", "call add 1 2"), ("tool", "3"), ("assistant", "answer 3")]
    assert render(turns) == ("<|user|>q<|end|><|assistant|>call add 1 2<|end|><|tool|>3<|end|>"
                             "<|assistant|>answer 3<|end|>")


def test_corpus_is_deterministic_per_seed():
    a, b, c = corpus(50, seed=7), corpus(50, seed=7), corpus(50, seed=8)
    assert a == b and a != c
    lines = a.split("\n")
    assert len(lines) == 50 and all(line.startswith("<|user|>tools: ") and line.endswith("<|end|>") for line in lines)
    assert "error: tool not found" in a  # the default corpus teaches the error format


def test_easy_episode_is_short():
    rng = random.Random(3)
    for _ in range(200):
        task = make_tool_task(rng, 1)
        text = render(gold_transcript(task, rng))
        assert len(text.encode()) < 160
    # Even the hardest level with one mistake fits the tiny model's 256-token context (a special is one token).
    for _ in range(500):
        task = make_tool_task(rng, tasks.MAX_DIFFICULTY)
        text = render(gold_transcript(task, rng, p_mistake=1.0))
        assert len(re.sub(r"<\|\w+\|>", "x", text).encode()) <= 256


# -----------------------------------------------------------------------------
# feedback.py: the hinted teacher


class _ToolNotFoundEnv(_ScriptedEnv):
    """Every reply says the called tool is absent, so every assistant message is a feedback target."""

    def step(self, text):
        self.left -= 1
        return "error: tool not found: mul. available tools: add, sub", self.left == 0


def _feedback_rollout(env_cls=_ToolNotFoundEnv):
    from grpo import GRPOConfig, rollout
    torch.manual_seed(0)
    model = M.Transformer(M.ModelConfig())
    cfg = GRPOConfig(group_size=2, max_message_tokens=6)
    return model, cfg, rollout(model, [env_cls(1.0, 2), env_cls(0.0, 2)], cfg, torch.Generator().manual_seed(0))


def test_feedback_rules_find_the_tool_not_found_turn():
    from feedback import find_targets, tool_not_found
    env = ToolEnv(make_tool_task(random.Random(0), 1))
    absent = next(name for name in TOOLS if name not in env.task.tools)
    reply, _ = env.step(f"call {absent} 1 2")
    assert tool_not_found(reply) == "Reminder: Available tools: " + ", ".join(env.task.tools)
    _, _, trajs = _feedback_rollout()
    targets = find_targets(trajs[0])
    assert len(targets) == 2 and all(name == "tool_not_found" for *_, name in targets)
    seg, start, end, _, _ = targets[0]
    assert all(trajs[0].segments[seg].policy[start:end]) and trajs[0].segments[seg].tokens[start - 1] == \
        M.TOKEN["<|assistant|>"]


def test_empty_hint_gives_zero_kl_and_gradient_and_only_the_target_moves():
    from feedback import Feedback, FeedbackConfig
    model, cfg, trajs = _feedback_rollout()
    fb = Feedback(model, FeedbackConfig(), rules=[("empty", lambda reply: "")])
    loss, stats = fb.loss(model, trajs, norm=100.0)
    loss.backward()
    assert stats["feedback_kl"] == 0.0 and stats["feedback_targets"] == 4
    assert max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None) < 1e-7
    # with the real rule: gradient reaches the student's logits at the target messages' positions only
    model.zero_grad()
    captured = []
    def keep(module, inputs, out):  # the student's pass (the teacher's runs under no_grad); returns None
        if out.requires_grad:
            out.retain_grad()
            captured.append(out)
    hook = model.lm_head.register_forward_hook(keep)
    fb = Feedback(model, FeedbackConfig())
    loss, stats = fb.loss(model, trajs, norm=100.0)
    hook.remove()
    loss.backward()
    assert stats["feedback_kl"] > 0
    grad = captured[0].grad.abs().sum(-1)  # [targets, T]: the student batch (teacher ran under no_grad)
    from feedback import find_targets
    spans = [(start, end) for t in trajs for _, start, end, _, _ in find_targets(t)]
    for row, (start, end) in zip(grad, spans):
        inside = torch.zeros_like(row, dtype=torch.bool)
        inside[start - 1:end - 1] = True
        assert (row[inside] > 0).all() and (row[~inside] == 0).all()


def test_sampled_estimator_matches_full_kl_in_expectation():
    from feedback import message_kl
    torch.manual_seed(0)
    s_logits, t_logits = torch.randn(1, 6, requires_grad=True), torch.randn(1, 6)
    full, full_kl = message_kl(s_logits, t_logits, None, "full")
    g_full, = torch.autograd.grad(full.sum(), s_logits)
    p = torch.softmax(s_logits.detach(), -1)[0]
    g_exp, kl_exp = torch.zeros_like(s_logits), 0.0
    for x in range(6):  # the expectation over the student's own samples, exactly
        loss, kl = message_kl(s_logits, t_logits, torch.tensor([x]), "sampled")
        g, = torch.autograd.grad(loss.sum(), s_logits)
        g_exp += p[x] * g
        kl_exp += p[x] * kl.item()
    torch.testing.assert_close(g_exp, g_full, rtol=1e-5, atol=1e-6)
    assert abs(kl_exp - full_kl.item()) < 1e-5 and full_kl.item() > 0


def test_train_rl_stage_logs_reward_tool_errors_and_feedback(tmp_path):
    r = run_train("--stage", "rl", "--rl-steps", "2", "--group-size", "2", "--tasks-per-step", "1",
                  "--eval-batches", "1", "--log-every", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [row for row in read_metrics(tmp_path) if row.get("stage") == "rl"]
    assert [row["rl_step"] for row in rows] == [1, 2]
    for row in rows:
        assert {"reward", "tool_error_rate", "feedback_kl", "gen_tokens", "level"} <= set(row)
        assert 0 <= row["reward"] <= 1 and row["gen_tokens"] <= 128  # the constant normaliser caps the length
    assert "rl step" in r.stdout
