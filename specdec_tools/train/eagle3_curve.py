"""EAGLE-3's learning curve: the held-out figures of trained drafters (`specdec train eagle3`) against the
positions each was trained on, as a table and a plot in a run folder (`specdec train eagle3-curve`). Every drafter
is scored again on one held-out set (eagle3.evaluate), whatever shards it was trained on."""

from __future__ import annotations

import json
from pathlib import Path

from specdec_core.models.artifacts import EAGLE3, artifact_dir
from specdec_core.models.runner import ModelRunner

from .eagle3 import evaluate


def curve_points(runner: ModelRunner, names: list[str]) -> list[dict]:
    """Per drafter trained for `runner`'s target (a name under <cache>/eagle3 or a directory), ordered by
    positions: what it was trained on and how, and its held-out per-step accuracy and expected accepted length."""
    points = []
    for name in names:
        meta = json.loads((artifact_dir(EAGLE3, name) / EAGLE3.meta_file).read_text())
        heldout = evaluate(runner, name)
        train = meta["train"]
        points.append({
            "name": name, "positions": meta["data"]["positions"], "shards": meta["data"]["shards"],
            "epochs": train["epochs"], "lr": train["lr"], "length_window": train.get("length_window", 1),
            "batches": meta["batches"], "bf16": train.get("bf16", False),
            "intermediate_size": meta["intermediate_size"], "train_s": meta["train_s"],
            "positions_per_s": round(meta["data"]["positions"] * train["epochs"] / meta["train_s"], 1),
            "machine": meta.get("machine"),
            "step_accuracy": heldout["step_accuracy"], "expected_length": heldout["expected_length"],
            "heldout_shards": heldout["shards"], "heldout_slots": heldout["slots"],
        })
    return sorted(points, key=lambda point: (point["positions"], point["batches"]))


def write_curve(runner: ModelRunner, names: list[str], out: Path, command: str) -> list[dict]:
    """learning-curve.json (with the `command` that wrote it) and learning-curve.png in `out`; the points."""
    points = curve_points(runner, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning-curve.json").write_text(json.dumps({"command": command, "points": points}, indent=1) + "\n")
    plot(points, out / "learning-curve.png")
    return points


def plot(points: list[dict], path: Path) -> None:
    """Held-out expected accepted length and first-draft accuracy against the positions trained on."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (length, first) = plt.subplots(1, 2, figsize=(9, 3.8))
    recipes = sorted({(point["epochs"], point["lr"], point["length_window"]) for point in points})
    for epochs, lr, window in recipes:  # a line per recipe
        chosen = [point for point in points if (point["epochs"], point["lr"], point["length_window"]) == (epochs, lr, window)]
        label = f"{epochs} epoch{'s' if epochs > 1 else ''}, lr {lr:g}" + (f", sorted in {window}" if window > 1 else "")
        positions = [point["positions"] for point in chosen]
        length.plot(positions, [point["expected_length"] for point in chosen], marker="o", label=label)
        first.plot(positions, [point["step_accuracy"][0] for point in chosen], marker="o", label=label)
    length.set_ylim(bottom=1)
    first.set_ylim(bottom=0)
    for axes, what in ((length, "expected accepted length (chain)"), (first, "first-draft accuracy")):
        axes.set_xscale("log")
        axes.set_xlabel("positions trained on")
        axes.set_ylabel(what)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle("EAGLE-3, held out")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
