"""Training curves of one or more runs (like the paper's Fig. 3) and the reward–KL plane.

Curves: task reward, KL and combined reward per agent over iterations (a moving average over
`smooth` iterations; raw values faint behind). Colours tell runs apart, line styles agents
(solid llm1, dashed llm2, dotted llm3, dash-dot llm4). The reward–KL panel puts each run's final
point (mean of its last `smooth` iterations over its agents) in the plane, labelled with the run
name and its recipe's eta: up and to the left is better. Runs that evaluated during training
(`train.eval_every`) get a fifth panel: each agent's held-out greedy accuracy (task reward where
the reward is not 0/1).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tomllib
from pathlib import Path

from cory_lora.errors import UserError, os_error_message
from cory_lora.run import records

PANELS = (
    ("task_reward", "task reward"),
    ("kl", "KL to reference"),
    ("combined_reward", "combined reward"),
)
AGENT_STYLES = {"llm1": "-", "llm2": "--", "llm3": ":", "llm4": "-."}  # more: solid again


def _style(agent: str) -> str:
    return AGENT_STYLES.get(agent, "-")


def agent_names(rows: list[dict]) -> list[str]:
    """The agents a run's metrics name (llm1, llm2, ...), in order."""
    names = {key.split("/")[0] for m in rows for key in m if key.endswith("/task_reward")}
    return sorted((n for n in names if re.fullmatch(r"llm\d+", n)), key=lambda n: int(n[3:]))


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics, one dict per iteration; damaged lines are left out with a warning
    (`records.read_metrics`): a plot of what is there beats no plot."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not path.exists():
        raise UserError(f"{run_dir}: no metrics.jsonl (not a run directory, or no iteration done)")
    rows = records.read_metrics(path)
    if not rows:
        raise UserError(f"{path} holds no complete iteration yet")
    return rows


def _value(row: dict, key: str) -> float:
    """A metric as a float; NaN where it is missing or null (an update that was skipped)."""
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


def _moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point, NaN values left out (NaN if all are)."""
    out = []
    for i in range(len(values)):
        known = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(known) / len(known) if known else math.nan)
    return out


def _run_label(run_dir: Path) -> tuple[str, float | None]:
    config = Path(run_dir) / "config.toml"
    eta = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no config, or not a recipe
        eta = tomllib.loads(config.read_text(encoding="utf-8")).get("log", {}).get("eta")
    return Path(run_dir).resolve().name, eta


def check_image_path(out: Path) -> None:
    """Refuse, before any work, an output that cannot be an image file of a known type."""
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(out)
    types = FigureCanvasBase.get_supported_filetypes()
    if out.is_dir():
        raise UserError(
            f"-o {str(out)!r} is a directory; name an image file, e.g. {out / 'curves.png'}"
        )
    kind = out.suffix.lstrip(".").lower()
    if kind not in types:
        raise UserError(
            f"-o {str(out)!r}: {'unknown image type .' + kind if kind else 'no image type'}; "
            f"end the name with one of {', '.join('.' + t for t in sorted(types))}"
        )
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"-o {str(out)!r}: {str(parent)!r} is a file, not a directory")
            break


def plot_runs(run_dirs: list[Path], out: Path, smooth: int = 10) -> Path:
    """Write one figure comparing the runs; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    check_image_path(out)
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    evaluated = any(key.startswith("eval/") for _, rows in runs for m in rows for key in m)
    fig, axes = plt.subplots(1, 5 if evaluated else 4, figsize=(25 if evaluated else 20, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, (run_dir, rows) in enumerate(runs):
        colour = colours[r % len(colours)]
        name, eta = _run_label(run_dir)
        agents = agent_names(rows)
        x = [m["iteration"] for m in rows]
        for ax, (key, title) in zip(axes, PANELS, strict=False):
            for agent in agents:
                y = [_value(m, f"{agent}/{key}") for m in rows]
                ax.plot(x, y, color=colour, alpha=0.15, linestyle=_style(agent))
                ax.plot(
                    x,
                    _moving_average(y, smooth),
                    color=colour,
                    linestyle=_style(agent),
                    label=f"{name} {agent}",
                )
            ax.set_title(title)
            ax.set_xlabel("iteration")
        if evaluated:
            _plot_eval(axes[4], rows, agents, colour, name)
        tail = rows[-smooth:]
        final_kl = _mean([_value(m, f"{a}/kl") for m in tail for a in agents])
        final_reward = _mean([_value(m, f"{a}/task_reward") for m in tail for a in agents])
        if not (math.isnan(final_kl) or math.isnan(final_reward)):
            axes[3].scatter([final_kl], [final_reward], color=colour, s=60)
            label = f"{name} (eta={eta})" if eta is not None else name
            axes[3].annotate(
                label, (final_kl, final_reward), textcoords="offset points", xytext=(6, 6)
            )
    axes[3].set_title(f"reward vs KL (mean of last {smooth} iterations)")
    axes[3].set_xlabel("KL to reference")
    axes[3].set_ylabel("task reward")
    if any(ax.get_legend_handles_labels()[0] for ax in axes[:1]):
        axes[0].legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{out.suffix}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, out)  # a reader never sees half a picture
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(os_error_message(e, f"cannot write {out}")) from None
    finally:
        plt.close(fig)
    return out


def _plot_eval(ax, rows: list[dict], agents: list[str], colour: str, name: str) -> None:
    """Held-out figures of the iterations that evaluated: accuracy, else task reward."""
    for agent in agents:
        evaluated = [m for m in rows if f"eval/{agent}/task_reward" in m]
        if not evaluated:
            continue
        accuracy = any(m.get(f"eval/{agent}/accuracy") is not None for m in evaluated)
        key = f"eval/{agent}/{'accuracy' if accuracy else 'task_reward'}"
        ax.plot(
            [m["iteration"] for m in evaluated],
            [_value(m, key) for m in evaluated],
            color=colour,
            linestyle=_style(agent),
            marker="o",
            label=f"{name} {agent}",
        )
    ax.set_title("held-out accuracy (or task reward), during training")
    ax.set_xlabel("iteration")


def _mean(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return sum(known) / len(known) if known else math.nan
