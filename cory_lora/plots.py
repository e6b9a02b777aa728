"""Training curves of one or more runs (like the paper's Fig. 3) and the reward–KL plane.

Curves: task reward, KL and combined reward per agent over iterations (a moving average over
`smooth` iterations; raw values faint behind). Colours tell runs apart, line styles agents
(solid llm1, dashed llm2). The reward–KL panel puts each run's final point (mean of its last
`smooth` iterations over its agents) in the plane, labelled with the run name and its recipe's
eta: up and to the left is better.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from cory_lora.errors import UserError
from cory_lora.outputs import atomic_file, read_jsonl

PANELS = (
    ("task_reward", "task reward"),
    ("kl", "KL to reference"),
    ("combined_reward", "combined reward"),
)
AGENT_STYLES = {"llm1": "-", "llm2": "--"}


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{run_dir}: no metrics.jsonl (not a run directory, or no iteration done)")
    rows = read_jsonl(path)
    if not rows:
        raise UserError(f"{path} is empty")
    return rows


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _run_label(run_dir: Path) -> tuple[str, float | None]:
    config = Path(run_dir) / "config.toml"
    eta = None
    if config.exists():
        eta = tomllib.loads(config.read_text()).get("log", {}).get("eta")
    return Path(run_dir).name, eta


def plot_runs(run_dirs: list[Path], out: Path, smooth: int = 10) -> Path:
    """Write one figure comparing the runs; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, (run_dir, rows) in enumerate(runs):
        colour = colours[r % len(colours)]
        name, eta = _run_label(run_dir)
        agents = [a for a in AGENT_STYLES if f"{a}/task_reward" in rows[0]]
        x = [m["iteration"] for m in rows]
        for ax, (key, title) in zip(axes, PANELS, strict=False):
            for agent in agents:
                y = [m[f"{agent}/{key}"] for m in rows]
                ax.plot(x, y, color=colour, alpha=0.15, linestyle=AGENT_STYLES[agent])
                ax.plot(
                    x,
                    _moving_average(y, smooth),
                    color=colour,
                    linestyle=AGENT_STYLES[agent],
                    label=f"{name} {agent}",
                )
            ax.set_title(title)
            ax.set_xlabel("iteration")
        tail = rows[-smooth:]
        final_kl = sum(m[f"{a}/kl"] for m in tail for a in agents) / (len(tail) * len(agents))
        final_reward = sum(m[f"{a}/task_reward"] for m in tail for a in agents) / (
            len(tail) * len(agents)
        )
        axes[3].scatter([final_kl], [final_reward], color=colour, s=60)
        label = f"{name} (eta={eta})" if eta is not None else name
        axes[3].annotate(label, (final_kl, final_reward), textcoords="offset points", xytext=(6, 6))
    axes[3].set_title(f"reward vs KL (mean of last {smooth} iterations)")
    axes[3].set_xlabel("KL to reference")
    axes[3].set_ylabel("task reward")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:  # a reader never sees half a picture
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return out
