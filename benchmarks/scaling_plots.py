"""The curves of docs/scaling.md, drawn from the fleet and weight-group results in the repo.

Reads a ``fleet.py`` report (admission time, learner RSS and CPU per lockstep message against
the workers) and a ``weight_group.py`` report (the learner's copies and CPU per version against
the workers, over the sessions and by the weight group) and draws them side by side. Draws
only what the files hold; it measures nothing.

    python benchmarks/scaling_plots.py --fleet benchmarks/results/fleet-curve-2026-12-06.json \\
        --weight-group benchmarks/results/weight-group-2026-12-06.json \\
        --out benchmarks/results/scaling-fleet-2026-12-06.png

Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def load(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(path.read_text())["rows"]
    return rows


def draw(fleet: list[dict[str, Any]], group: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    workers = [row["workers"] for row in fleet]
    panels = (
        ("admission of all workers (s)", [row["admission_s"] for row in fleet]),
        ("learner CPU per lockstep message (µs)", [row["cpu_us_per_message"] for row in fleet]),
    )
    for ax, (title, values) in zip(axes[:2], panels, strict=True):
        ax.plot(workers, values, "o-")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
    rss = axes[0].twinx()
    rss.plot(workers, [row["rss_admitted_bytes"] / 2**20 for row in fleet], "s--", color="grey")
    rss.set_ylabel("learner RSS (MiB), dashed", fontsize=9)
    rss.set_ylim(bottom=0)
    for ax, key, title in (
        (axes[2], "copies", "learner's copies per 6.7 MB version"),
        (axes[3], "cpu_ms", "learner CPU per version (ms)"),
    ):
        for path in sorted({row["path"] for row in group}):
            rows = [row for row in group if row["path"] == path]
            ax.plot([r["workers"] for r in rows], [r[key] for r in rows], "o-", label=path)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--fleet", type=Path, default=RESULTS / "fleet-curve-2026-12-06.json")
    p.add_argument("--weight-group", type=Path, default=RESULTS / "weight-group-2026-12-06.json")
    p.add_argument("--out", type=Path, default=RESULTS / "scaling-fleet-2026-12-06.png")
    args = p.parse_args(argv)
    draw(load(args.fleet), load(args.weight_group), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
