"""Plots of runs' metrics.jsonl (train.py's record of every figure), one PNG of three panels: pretraining loss
(train and validation) against the step; RL reward and the held-out pass rates against the RL step; the rates
the feedback rules target (absent-tool calls, "Call" calls) against the RL step. Several runs are drawn over
each other, and a group of runs (seeds) as its mean with a band of one standard deviation.

    python train.py --plot out                                   # -> out/plot.png
    python train.py --plot on=s1,s2,s3 off=t1,t2,t3 --plot-out feedback.png   # two groups of 3 seeds
"""
import json
from pathlib import Path

# (panel title, x, [(stage, field, legend name, line style)]); stage None: pretraining (no "stage" field)
PANELS = [("pretraining", "step", [(None, "loss", "train loss", "-"), (None, "val_loss", "val loss", "--")]),
          ("RL: reward and held-out pass rates", "rl_step",
           [("rl", "reward", "reward", "-"), ("rl_eval", "pass_level1", "pass level 1", "--"),
            ("rl_eval", "pass_level2", "pass level 2", ":")]),
          ("RL: targeted rates (held-out, per call)", "rl_step",
           [("rl_eval", "tool_error_rate", "tool not found", "-"), ("rl_eval", "capital_rate", "'Call'", "--")])]


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
    """["DIR", "NAME=DIR1,DIR2", ...] -> [(label, [records of each run])]: a bare DIR is its own label, NAME=DIR
    names one run, NAME=DIR1,DIR2,... a group (seeds)."""
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
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, x, lines) in zip(axes, PANELS):
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
        if x == "rl_step" and ax.lines:  # rates and rewards in [0, 1]: the whole range, comparable across plots
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
