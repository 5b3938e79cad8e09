"""EAGLE-3's learning curve: the held-out figures of trained drafters (`specdec train eagle3`) against the optimizer
steps and the positions each saw, as a table and a plot in a run folder (`specdec train eagle3-curve`), a line per
recipe. Every drafter is scored again on one held-out set (eagle3.evaluate), whatever shards it was trained on;
points of an earlier run folder (`--earlier`) are drawn as they were scored there."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specdec_core.models.artifacts import EAGLE3, artifact_dir
from specdec_core.models.runner import ModelRunner

from .eagle3 import evaluate
from .settings import Eagle3Settings

# What makes a recipe: every training setting but how much data and how many passes over it.
RECIPE = ("lr", "warmup", "lr_floor", "batch_sequences", "length_window", "noise", "frozen_head", "steps", "decay",
          "vocab_size", "intermediate_size")
DEFAULTS = dataclasses.asdict(Eagle3Settings())


def curve_points(runner: ModelRunner, names: list[str]) -> list[dict]:
    """Per drafter trained for `runner`'s target (a name under <cache>/eagle3 or a directory): what it was trained
    on and how, and its held-out per-step accuracy and expected accepted length."""
    points = []
    for name in names:
        meta = json.loads((artifact_dir(EAGLE3, name) / EAGLE3.meta_file).read_text())
        heldout = evaluate(runner, name)
        train = meta["train"]
        points.append({
            "name": name, "positions": meta["data"]["positions"], "shards": meta["data"]["shards"],
            "epochs": train["epochs"], **{key: train.get(key, DEFAULTS[key]) for key in RECIPE},
            "length_window": train.get("length_window", 1),  # before the setting, batches were cut at random
            "intermediate_size": meta["intermediate_size"], "bf16": train.get("bf16", False),
            # a piece (--init) stands where its pieces together brought the drafter
            "batches": meta.get("total_batches", meta["batches"]),
            "positions_seen": meta.get("total_positions_seen", meta["data"]["positions"] * train["epochs"]),
            "init": (meta.get("init") or {}).get("from"),
            "train_s": meta["train_s"], "positions_per_s": round(meta["data"]["positions"] * train["epochs"] / meta["train_s"], 1),
            "machine": meta.get("machine"),
            "step_accuracy": heldout["step_accuracy"], "expected_length": heldout["expected_length"],
            "heldout_shards": heldout["shards"], "heldout_slots": heldout["slots"],
        })
    return points


def earlier_points(path: Path) -> list[dict]:
    """The points of a learning-curve.json written before, as they were scored, each marked with where it came from
    (recipe settings it predates take their defaults of today, which are what those runs used)."""
    points = json.loads(path.read_text())["points"]
    return [{**{key: DEFAULTS[key] for key in RECIPE}, "length_window": 1, "positions_seen": point["positions"] * point["epochs"],
             **point, "earlier": str(path)} for point in points]


def write_curve(runner: ModelRunner, names: list[str], out: Path, command: str, earlier: list[Path] = ()) -> list[dict]:
    """learning-curve.json (with the `command` that wrote it) and learning-curve.png in `out`; the points, ordered
    by optimizer steps."""
    points = curve_points(runner, names) + [point for path in earlier for point in earlier_points(path)]
    points.sort(key=lambda point: (point["batches"], point["positions"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning-curve.json").write_text(json.dumps({"command": command, "points": points}, indent=1) + "\n")
    plot(points, out / "learning-curve.png")
    return points


def recipe_label(recipe: tuple) -> str:
    """A recipe's settings that differ from the defaults of the time before them (lr, which every recipe sets)."""
    settings = dict(zip(RECIPE, recipe))
    parts = [f"lr {settings['lr']:g}"]
    parts += [f"{key.replace('_', ' ')} {value:g}" if not isinstance(value, bool) else key.replace("_", " ")
              for key, value in settings.items()
              if key != "lr" and value != (1 if key == "length_window" else DEFAULTS[key]) and value is not False]
    return ", ".join(parts)


def plot(points: list[dict], path: Path) -> None:
    """Held-out expected accepted length against optimizer steps and against positions seen (positions x epochs;
    a piece's: with the pieces before it),
    and first-draft accuracy against steps: a line per recipe, its points by steps, a filled marker at one epoch
    and an open one where the data was seen more than once (the epochs written beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, panels = plt.subplots(1, 3, figsize=(14, 4.2))
    recipes = sorted({tuple(point[key] for key in RECIPE) for point in points}, key=str)
    for recipe in recipes:
        chosen = [point for point in points if tuple(point[key] for key in RECIPE) == recipe]
        label = recipe_label(recipe)
        for axes, x_of, y_of in ((panels[0], lambda p: p["batches"], lambda p: p["expected_length"]),
                                 (panels[1], lambda p: p["positions_seen"], lambda p: p["expected_length"]),
                                 (panels[2], lambda p: p["batches"], lambda p: p["step_accuracy"][0])):
            ordered = sorted(chosen, key=x_of)
            line, = axes.plot([x_of(p) for p in ordered], [y_of(p) for p in ordered], label=label)
            for point in ordered:
                several = point["epochs"] > 1
                axes.plot(x_of(point), y_of(point), "o", color=line.get_color(), markerfacecolor="white" if several else None)
                if several:
                    axes.annotate(f"{point['shards']} sh x{point['epochs']}", (x_of(point), y_of(point)), fontsize=7,
                                  xytext=(4, -9), textcoords="offset points")
    for axes, x_label, y_label in ((panels[0], "optimizer steps (batches)", "expected accepted length (chain)"),
                                   (panels[1], "positions seen (positions x epochs)", "expected accepted length (chain)"),
                                   (panels[2], "optimizer steps (batches)", "first-draft accuracy")):
        axes.set_xscale("log")
        axes.set_xlabel(x_label)
        axes.set_ylabel(y_label)
        axes.grid(alpha=0.3)
    panels[0].set_ylim(bottom=1)
    panels[1].set_ylim(bottom=1)
    panels[2].set_ylim(bottom=0)
    panels[0].legend(fontsize=7)
    figure.suptitle("EAGLE-3, held out (open markers: the data seen more than once)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
