"""Run the suite: one example process at a time, skipping runs whose result exists."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.aps.grid import ROOT, Run


class Progress:
    """tqdm over the runs when it is installed, else one line per run on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.bar: Any = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, unit="run", dynamic_ncols=True)

    def update(self, text: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_all(runs: list[Run], out: Path, *, timeout: float, python: str = sys.executable) -> None:
    """Run every run of ``runs`` whose result is missing under ``out/runs``, in order.

    A run's figures land in ``out/runs/KEY.json`` only when its process ends well (the
    example writes them at its end), so a run killed halfway leaves no result and runs again
    next time. A run that fails leaves ``KEY.err`` (its command, exit status and the end of
    its stderr) and the suite goes on; a later start tries it again.
    """
    directory = out / "runs"
    directory.mkdir(parents=True, exist_ok=True)
    pending = [run for run in runs if not (directory / f"{run.key}.json").exists()]
    skipped = len(runs) - len(pending)
    if skipped:
        print(f"{skipped} of {len(runs)} runs already have results; skipping them", flush=True)
    progress = Progress(len(pending))
    try:
        for run in pending:
            need = run.task.needs
            if need is not None and importlib.util.find_spec(need) is None:
                progress.update(f"{run.key}: skipped, needs the {need} module")
                continue
            result = directory / f"{run.key}.json"
            partial = directory / f"{run.key}.json.partial"
            command = run.command(python, partial)
            started = time.perf_counter()
            try:
                proc = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )
                status: int | str = proc.returncode
                stderr = proc.stderr
            except subprocess.TimeoutExpired as exc:
                status = f"timed out after {timeout:g} s"
                stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else ""
            seconds = time.perf_counter() - started
            if status == 0 and partial.exists():
                partial.replace(result)
                (directory / f"{run.key}.err").unlink(missing_ok=True)
                figures = json.loads(result.read_text())
                ret = figures["final_return"]
                text = "n/a" if ret is None else f"{ret:.1f}"
                progress.update(f"{run.key}: return {text} in {seconds:.0f} s")
            else:
                partial.unlink(missing_ok=True)
                (directory / f"{run.key}.err").write_text(
                    f"command: {' '.join(command)}\nstatus: {status}\n\n{stderr[-8000:]}"
                )
                progress.update(f"{run.key}: FAILED ({status}), see {run.key}.err")
    finally:
        progress.close()
