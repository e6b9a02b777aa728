"""A study's report, computed from its run directories alone (metrics.jsonl, eval.json and
eval-<split>.json), so it can be rebuilt at any time: report.md, report.json, curves.png and
frontier.png.

Per arm and grid point, over seeds: the final-window task reward, KL and combined reward of
training (each run: the mean over its last `window` iterations and over its agents), and, when
the runs were evaluated, the same on each held-out split (each agent alone; accuracy and pass@k
when the reward is 0/1; the collapse figures: distinct-n, overlap, length, off-task KL). Each
cell is the mean, the Student-t 95% interval of the mean and n, or, with 3 seeds or fewer, the
range of the seeds' values (stats.py). Between every pair of arms at each grid point: the paired
difference over seeds (a seed gives every arm the same prompt order and first rollout) with its
t-interval, the paired t-test's p and the exact sign-flip p; a gap is called clear only when the
paired test supports it (stats.py says the rule), and the report says how many comparisons it
made. The frontier puts one point per (arm, grid point) in the task reward–KL plane with error
bars over seeds, labels it, and marks, for each η of the study, each arm's best point under
task − η·KL (by the means: a choice, not a test).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np

from cory_lora.config import toml_value
from cory_lora.errors import UserError
from cory_lora.run.atomic import atomic_file, atomic_write_text
from cory_lora.run.records import read_metrics
from cory_lora.science.plots import agent_names
from cory_lora.science.schemas import EvalRecord, StudyRecord, read_record
from cory_lora.science.stats import MIN_SEEDS_FOR_INTERVAL, paired, summarise
from cory_lora.science.study import STATE_FILE

METRICS = ("task_reward", "kl", "combined_reward")
COLLAPSE = ("distinct_1", "distinct_2", "overlap", "length", "offtask_kl")
COMPARED = ("task_reward", "kl", "combined_reward", "accuracy", "offtask_kl")
SHORT_NAMES = {"ppo.init_kl_coef": "β", "cory.other_coef": "other", "reset.every": "reset"}
ARM_NOTES = {
    "independent": "the A/A noise floor: two PPO learners side by side (no transfer, own reward), "
    "so its gaps to `ppo` measure how far apart two runs of the same method land by chance",
}
TRAIN = "train"
HELDOUT = "heldout"  # eval.json; eval-<split>.json is part "heldout-<split>"


def run_final(metrics: list[dict], window: int) -> dict[str, float | None]:
    """A run's final-window means: over its last `window` iterations and over its agents."""
    tail = metrics[-window:]
    agents = agent_names(tail)
    out = {}
    for key in METRICS:
        values = [m[f"{a}/{key}"] for m in tail for a in agents if m.get(f"{a}/{key}") is not None]
        out[key] = sum(values) / len(values) if values else None
    return out


def run_heldout(evaluation: dict) -> dict[str, float | None]:
    """Held-out figures of a run: the mean over its agents evaluated alone."""
    rows = [r for r in evaluation["rows"] if r["name"].startswith("llm") and "→" not in r["name"]]
    out = {}
    for key in (*METRICS, "accuracy", *COLLAPSE):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values or key in (*METRICS, "accuracy"):
            out[key] = sum(values) / len(values) if values else None
    for k in evaluation.get("k", []):
        values = [r["pass_at"][str(k)] for r in rows if str(k) in r.get("pass_at", {})]
        if values:
            out[f"pass@{k}"] = sum(values) / len(values)
    return out


def point_label(arm: str, grid: dict) -> str:
    parts = [f"{SHORT_NAMES.get(k, k.split('.')[-1])}={toml_value(v)}" for k, v in grid.items()]
    return " ".join([arm, *parts])


def build_report(study_dir: Path) -> dict:
    """Every number of the report, from the study's run directories."""
    study_dir = Path(study_dir)
    state_path = study_dir / STATE_FILE
    if not state_path.exists():
        raise UserError(f"{study_dir}: not a study directory (no {STATE_FILE})")
    try:
        state = read_record(state_path, StudyRecord)
    except UserError as e:
        raise UserError(
            f"{e}; `cory-lora study` with the same study file rewrites study.json"
        ) from None
    return _report_of(study_dir, state)


def _evaluations(run_dir: Path) -> dict[str, dict]:
    """part -> the run's eval record: eval.json as `heldout`, eval-<split>.json as
    `heldout-<split>`."""
    out = {}
    for path in sorted(run_dir.glob("eval*.json")):
        if path.name == "eval.json":
            out[HELDOUT] = read_record(path, EvalRecord)
        elif path.name.startswith("eval-"):
            out[f"{HELDOUT}-{path.stem.removeprefix('eval-')}"] = read_record(path, EvalRecord)
    return out


def _report_of(study_dir: Path, state: dict) -> dict:
    window = state["window"]
    groups: dict[str, dict] = {}
    failed, splits = [], {}
    for record in state["runs"]:
        run_dir = study_dir / record["dir"]
        label = point_label(record["arm"], record["grid"])
        group = groups.setdefault(
            label, {"arm": record["arm"], "grid": record["grid"], "parts": {}, "runs": []}
        )
        metrics = (
            read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        )
        if record["status"] != "done" or not metrics:
            failed.append(
                {"id": record["id"], "status": record["status"], "error": record["error"]}
            )
            continue
        group["runs"].append(record["id"])
        seed = {"seed": record["seed"]}
        group["parts"].setdefault(TRAIN, []).append(run_final(metrics, window) | seed)
        for part, evaluation in _evaluations(run_dir).items():
            group["parts"].setdefault(part, []).append(run_heldout(evaluation) | seed)
            splits.setdefault(part, _split_of(evaluation))
    parts = [TRAIN, *sorted({p for g in groups.values() for p in g["parts"]} - {TRAIN})]
    points = []
    for label, group in groups.items():
        point = {"label": label, "arm": group["arm"], "grid": group["grid"], "runs": group["runs"]}
        for part in parts:
            point[part] = _cells(group["parts"].get(part, []))
        points.append(point)
    best = {part: _best_per_eta(points, state["etas"], part) for part in parts}
    return {
        "study": state["study"],
        "window": window,
        "etas": state["etas"],
        "parts": parts,
        "splits": splits,
        "points": points,
        "best": best,
        "differences": _differences(points, parts),
        "failed": failed,
    }


def _split_of(evaluation: dict) -> dict:
    keys = ("split", "prompts", "sampled_prompts", "samples_per_prompt")
    return {k: evaluation[k] for k in keys if k in evaluation}


def _cells(rows: list[dict]) -> dict:
    """key -> its cell over the rows' seeds (stats.summarise, plus seed -> value)."""
    keys = sorted({k for r in rows for k in r if k != "seed"})
    cells = {}
    for key in keys:
        by_seed = {r["seed"]: r[key] for r in rows if r.get(key) is not None}
        cells[key] = summarise(list(by_seed.values())) | {"by_seed": by_seed}
    cells["seeds"] = [r["seed"] for r in rows]
    return cells


def _differences(points: list[dict], parts: list[str]) -> list[dict]:
    """Every pair of arms at every grid point, per part and compared figure: the paired
    difference over seeds (stats.paired), the first arm minus the second."""
    out = []
    for p, q in itertools.combinations(points, 2):
        if p["grid"] != q["grid"] or p["arm"] == q["arm"]:
            continue
        for part in parts:
            for key in COMPARED:
                a, b = p[part].get(key), q[part].get(key)
                if not a or not b:
                    continue
                result = paired(_seed_keys(a["by_seed"]), _seed_keys(b["by_seed"]))
                if result is not None and result["n"] >= 2:
                    names = {"part": part, "key": key, "a": p["label"], "b": q["label"]}
                    out.append(names | result)
    return out


def _seed_keys(by_seed: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in by_seed.items()}  # JSON turned the seeds into strings


def _best_per_eta(points: list[dict], etas: list[float], part: str) -> list[dict]:
    """For each η and arm: the point with the highest mean task − η·mean KL."""
    out = []
    for eta in etas:
        for arm in dict.fromkeys(p["arm"] for p in points):
            scored = [
                (p[part]["task_reward"]["mean"] - eta * p[part]["kl"]["mean"], p["label"])
                for p in points
                if p["arm"] == arm
                and p[part].get("task_reward", {}).get("mean") is not None
                and p[part].get("kl", {}).get("mean") is not None
            ]
            if scored:
                value, label = max(scored)
                out.append({"eta": eta, "arm": arm, "label": label, "objective": value})
    return out


# --------------------------------------------------------------------------- writing


def _cell(summary: dict | None) -> str:
    if not summary or summary.get("mean") is None:
        return "–"
    n, seeds = summary["n"], ", ".join(f"{v:.3f}" for v in summary["values"])
    if summary.get("ci95"):
        low, high = summary["ci95"]
        return f"{summary['mean']:.3f} [{low:.3f}, {high:.3f}] n={n} ({seeds})"
    if n == 1:
        return f"{summary['mean']:.3f} (1 seed)"
    return f"{summary['mean']:.3f} (range of {n} seeds: {seeds})"


def _part_title(report: dict, part: str) -> str:
    if part == TRAIN:
        return "Training (final window)"
    split = report.get("splits", {}).get(part, {})
    name = split.get("split") or part.removeprefix(f"{HELDOUT}-")
    sizes = ""
    if "prompts" in split:
        sampled = split.get("sampled_prompts", split["prompts"])
        sizes = f": {split['prompts']} prompts greedy, {sampled} sampled"
    return f"Held-out evaluation, split {name}{sizes}"


def _difference_row(d: dict) -> str:
    low, high = d["ci95"] or (math.nan, math.nan)
    seeds = ", ".join(f"{v:+.3f}" for v in d["differences"])
    verdict = "**clear**" if d["clear"] else "not clear"
    p_t = "–" if d["p_t"] is None else f"{d['p_t']:.3f}"
    return (
        f"| {d['a']} − {d['b']} | {d['key']} | {d['mean']:+.3f} | [{low:+.3f}, {high:+.3f}] | "
        f"{p_t} | {d['p_sign_flip']:.3f} (≥ {d['p_floor']:.3f}) | {d['n']} | {verdict} | "
        f"{seeds} |"
    )


def _differences_markdown(report: dict, part: str) -> list[str]:
    rows = [d for d in report.get("differences", []) if d["part"] == part]
    if not rows:
        return []
    lines = [
        "Paired differences between arms at each grid point (first minus second, over the "
        "seeds both have):",
        "",
        "| arms | figure | mean diff. | paired t 95% | p (t) | p (sign flip, floor) | n | "
        "verdict | per seed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_difference_row(d) for d in rows]
    return [*lines, ""]


def markdown(report: dict) -> str:
    differences = report.get("differences", [])
    clear = sum(d["clear"] for d in differences)
    lines = [
        f"# Study report: {report['study']}",
        "",
        f"Final window: the last {report['window']} iterations of each run, averaged over its "
        "agents. Each cell: the mean over seeds [Student-t 95% interval of the mean] n (every "
        f"seed's value); with fewer than {MIN_SEEDS_FOR_INTERVAL} seeds no interval, only the "
        "range of the seeds' values.",
        "",
        f"Comparisons: {len(differences)} paired differences (every pair of arms at every grid "
        f"point, every compared figure: {', '.join(COMPARED)}), {clear} of them clear. A gap is "
        f"**clear** when at least {MIN_SEEDS_FOR_INTERVAL} seeds are paired and the paired t 95% "
        "interval of the difference excludes 0 (paired t-test p < 0.05). The exact two-sided "
        "sign-flip p (all 2^n sign patterns) stands beside it; it cannot go below 2/2^n "
        "(0.125 with 4 seeds, 0.0625 with 5). Nothing is corrected for the number of "
        f"comparisons: about {0.05 * len(differences):.1f} of {len(differences)} would be clear "
        "by chance alone if no arm differed.",
        "",
    ]
    arms = dict.fromkeys(p["arm"] for p in report["points"])
    notes = [f"* `{arm}` is {ARM_NOTES[arm]}." for arm in arms if arm in ARM_NOTES]
    if notes:
        lines += [*notes, ""]
    parts = report.get("parts", [TRAIN, HELDOUT])
    for part in parts:
        keys = [
            k
            for k in ("task_reward", "kl", "combined_reward", "accuracy", *COLLAPSE)
            if any(k in p.get(part, {}) for p in report["points"])
        ]
        keys += sorted(
            {k for p in report["points"] for k in p.get(part, {}) if k.startswith("pass@")}
        )
        if not keys:
            continue
        title = _part_title(report, part)
        lines += [f"## {title}", "", "| arm | " + " | ".join(keys) + " |"]
        lines.append("|---" * (len(keys) + 1) + "|")
        for p in report["points"]:
            lines.append(
                f"| {p['label']} | " + " | ".join(_cell(p[part].get(k)) for k in keys) + " |"
            )
        lines.append("")
        lines += _differences_markdown(report, part)
        best = report["best"].get(part)
        if best:
            lines += [f"Best point per arm under task − η·KL (by the means; {title}):", ""]
            lines += [f"* η = {b['eta']:g}: {b['label']} ({b['objective']:.3f})" for b in best]
            lines.append("")
    if report["failed"]:
        lines += ["## Runs not in the report", ""]
        lines += [
            f"* {f['id']}: {f['status']}" + (f" — {f['error']}" if f["error"] else "")
            for f in report["failed"]
        ]
        lines.append("")
    lines += ["![frontier](frontier.png)", "", "![curves](curves.png)", ""]
    return "\n".join(lines)


def plot_frontier(report: dict, out: Path) -> None:
    """Task reward against KL, one panel per part of the report that has KL figures (training's
    final window, held-out evaluation): each point with its std over seeds as error bars, the
    best point per η circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [
        p
        for p in report.get("parts", [TRAIN, HELDOUT])
        if any("kl" in q[p] and q[p]["kl"]["mean"] is not None for q in report["points"])
    ]
    fig, axes = plt.subplots(1, max(1, len(parts)), figsize=(7.5 * max(1, len(parts)), 6))
    axes = np.atleast_1d(axes)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, part in zip(axes, parts, strict=False):
        _plot_points(ax, report["points"], part, colours)
        _circle_best(ax, report, part)
        title = _part_title(report, part).lower()
        ax.set_title(f"task reward vs KL: {title}\n(error bars: std over seeds)")
        ax.set_xlabel("KL to reference")
        ax.set_ylabel("task reward")
        ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def _plot_points(ax, points: list[dict], part: str, colours: list[str]) -> None:
    """Every point with both figures in `part`, labelled, one colour (and legend entry) per arm."""
    arms = list(dict.fromkeys(p["arm"] for p in points))
    for p in points:
        task, kl = p[part].get("task_reward"), p[part].get("kl")
        if not task or not kl or task["mean"] is None or kl["mean"] is None:
            continue
        colour = colours[arms.index(p["arm"]) % len(colours)]
        ax.errorbar(
            kl["mean"],
            task["mean"],
            xerr=kl["std"],
            yerr=task["std"],
            fmt="o",
            color=colour,
            capsize=3,
            label=p["arm"] if p["arm"] not in ax.get_legend_handles_labels()[1] else None,
        )
        ax.annotate(
            p["label"],
            (kl["mean"], task["mean"]),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=8,
        )


def _circle_best(ax, report: dict, part: str) -> None:
    """Circle each point that is best for some η in `part`, naming those η."""
    etas_of: dict[str, list[float]] = {}  # one label per point, whatever η chose it
    for b in report["best"][part]:
        etas_of.setdefault(b["label"], []).append(b["eta"])
    for label, etas in etas_of.items():
        p = next(q for q in report["points"] if q["label"] == label)
        x, y = p[part]["kl"]["mean"], p[part]["task_reward"]["mean"]
        ax.scatter([x], [y], s=220, facecolors="none", edgecolors="black", linewidths=1)
        ax.annotate(
            f"best η={', '.join(f'{e:g}' for e in etas)}",
            (x, y),
            textcoords="offset points",
            xytext=(5, -12),
            fontsize=7,
        )


TRAINING_CURVES = (("task_reward", "task reward"), ("kl", "KL"))
EVAL_CURVES = (  # collapse over training, where the runs evaluated during it (train.eval_every)
    ("accuracy", "held-out greedy accuracy"),
    ("offtask_kl", "off-task KL"),
    ("distinct_2", "distinct-2 of sampled answers"),
)


def _agents_mean(row: dict, key: str, evaluated: bool) -> float:
    """The mean over agents of `llmK/key` (training) or `eval/llmK/key`; nan where none."""
    values = [
        v
        for k, v in row.items()
        if k.endswith(f"/{key}") and k.startswith("eval/") == evaluated and v is not None
    ]
    return sum(values) / len(values) if values else math.nan


def curve(runs: list[list[dict]], key: str, smooth: int) -> tuple[np.ndarray, np.ndarray]:
    """(iterations, values [seed, iteration]) of one panel. Training metrics: every iteration
    the seeds share, as a trailing moving average; held-out ones (EVAL_CURVES): the iterations
    every seed evaluated at, unsmoothed."""
    if key not in dict(EVAL_CURVES):
        length = min(len(rows) for rows in runs)
        kernel = np.ones(smooth) / smooth
        curves = []
        for rows in runs:
            raw = [_agents_mean(m, key, evaluated=False) for m in rows[:length]]
            padded = np.pad(raw, (smooth - 1, 0), mode="edge")
            curves.append(np.convolve(padded, kernel, mode="valid"))
        return np.arange(1, length + 1), np.asarray(curves).reshape(len(runs), length)
    at = [{m["iteration"]: _agents_mean(m, key, evaluated=True) for m in rows} for rows in runs]
    shared = sorted(set.intersection(*({i for i, v in a.items() if not math.isnan(v)} for a in at)))
    return np.asarray(shared), np.asarray([[a[i] for i in shared] for a in at]).reshape(
        len(runs), len(shared)
    )


def plot_curves(study_dir: Path, report: dict, out: Path, smooth: int = 10) -> None:
    """Per (arm, grid point), the mean over seeds with a std band: task reward and KL of
    training and, where the runs evaluated during training, held-out accuracy, off-task KL and
    distinct-2 at each evaluation (collapse over training, the long-horizon study's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study_dir = Path(study_dir)
    points = [
        (p["label"], [read_metrics(study_dir / r / "metrics.jsonl") for r in p["runs"]])
        for p in report["points"]
        if p["runs"]
    ]
    points = [(label, runs) for label, runs in points if all(runs)]
    panels = list(TRAINING_CURVES) + [
        (key, title)
        for key, title in EVAL_CURVES
        if any(len(curve(runs, key, smooth)[0]) for _, runs in points)
    ]
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7.5 * columns, 5 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, runs) in enumerate(points):
        colour = colours[i % len(colours)]
        for ax, (key, title) in zip(axes.flat, panels, strict=False):
            x, curves = curve(runs, key, smooth)
            if not len(x):
                continue
            mean, std = curves.mean(0), curves.std(0)
            marker = "o" if key in dict(EVAL_CURVES) else None
            ax.plot(x, mean, color=colour, label=label, marker=marker)
            ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.15)
            smoothed = "" if marker else f", moving average {smooth}"
            ax.set_title(f"{title} (band: std over seeds{smoothed})")
            ax.set_xlabel("iteration")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    with atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def write_report(study_dir: Path) -> dict:
    """Write report.json, report.md, frontier.png and curves.png into the study directory."""
    study_dir = Path(study_dir)
    report = build_report(study_dir)
    atomic_write_text(study_dir / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(study_dir / "report.md", markdown(report))
    if any(p["runs"] for p in report["points"]):
        plot_frontier(report, study_dir / "frontier.png")
        plot_curves(study_dir, report, study_dir / "curves.png")
    return report
