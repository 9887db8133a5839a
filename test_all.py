"""Tests for the whole stack: honest, small, and under five minutes on two cores.

    python -m pytest -q test_all.py
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import model as M

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
    assert tuple(moe.w1.shape) == (384, 2048, 7168) and tuple(moe.w2.shape) == (384, 7168, 2048)
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
        out[path] = (logits.detach(), m.layers[1].ffn.w1.grad.clone(), m.layers[2].ffn.w2.grad.clone())
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
# train.py, run as a user would: in a subprocess


def run_train(*flags, cwd=HERE):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(HERE / "train.py"), *flags], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


SMALL_RUN = ["--batch-size", "4", "--seq-len", "32", "--log-every", "5", "--eval-batches", "2", "--warmup", "40"]


def test_train_learns_and_resume_continues_exactly(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    r = run_train(*SMALL_RUN, "--steps", "40", "--eval-every", "20", "--out", str(a))
    assert r.returncode == 0, r.stderr
    rows = read_metrics(a)
    assert [row["step"] for row in rows] == list(range(41))
    vals = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.5, vals  # validation loss clearly falls
    assert "MFU" in r.stdout and "load max/mean" in r.stdout
    # stop at 20, resume to 40: the same 40 losses as the uninterrupted run (warmup spans all steps, so the
    # lr schedule does not depend on --steps here)
    r = run_train(*SMALL_RUN, "--steps", "20", "--eval-every", "20", "--out", str(b))
    assert r.returncode == 0, r.stderr
    r = run_train(*SMALL_RUN, "--steps", "40", "--eval-every", "20", "--out", str(b), "--resume")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    rows_b = read_metrics(b)
    assert [row["step"] for row in rows_b] == list(range(41))
    np.testing.assert_allclose([r["loss"] for r in rows_b[1:]], [r["loss"] for r in rows[1:]], rtol=1e-5)


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
    (tmp_path / "bad" / "out").mkdir(parents=True)
    (tmp_path / "bad" / "out" / "ckpt.pt").write_bytes(b"not a checkpoint at all")
    cases = {
        "unknown preset": ["--preset", "huge"],
        "must be positive": ["--steps", "0"],
        "--batch-size must be positive": ["--batch-size", "-2"],
        "exceeds the tiny preset's context": ["--seq-len", "100000"],
        "no such file or folder": ["--data", str(tmp_path / "missing")],
        "no text found": ["--data", str(tmp_path / "empty")],
        "corrupt or unreadable": ["--resume", "--out", str(tmp_path / "bad" / "out")],
        "no checkpoint": ["--resume", "--out", str(tmp_path / "nothing")],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {k: subprocess.Popen([sys.executable, str(HERE / "train.py"), *v], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for k, v in cases.items()}
    for expected, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 2, (expected, stderr)
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, (expected, stderr)
        assert stderr.startswith("error: ") and expected in stderr, (expected, stderr)
