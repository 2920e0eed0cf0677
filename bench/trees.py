"""sdlite against sdlite: the same whole runs and start-ups from two source trees, to show a change costs nothing.

    git worktree add ../sdlite-before <commit>
    python bench/trees.py ../sdlite-before . [--repeat 5] [--size 256] [--steps 20]

For each tree, alternating run by run so that a noisy spell of the machine hits both alike, in fresh processes:

* **e2e** -- ``bench/e2e.py``'s sdlite case: ``python -m sdlite generate`` at ``--size`` and ``--steps`` on the full-size
  SD 1.5 bench folder (wall time, peak RSS);
* **start-up** -- ``bench/startup.py``'s sdlite child: import, load, first text encoding.

Each tree is imported from its own folder (``PYTHONPATH`` and the working directory), its bytecode compiled first.
Medians are reported, with the second tree's ratio to the first.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoint import build  # noqa: E402
from startup import CHILD, NEGATIVE, PROMPT, warm_page_cache  # noqa: E402


def _env(tree: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(tree)}


def e2e(tree: Path, folder: Path, size: int, steps: int, out: Path) -> tuple[float, float]:
    """(wall s, peak RSS MB) of one ``sdlite generate`` process run from ``tree``."""
    cmd = [sys.executable, "-m", "sdlite", "generate", "a red circle on a blue background", "--negative", "blurry",
           "--steps", str(steps), "--cfg", "7.5", "--sampler", "dpmpp_2m_karras", "--seed", "42", "--width",
           str(size), "--height", str(size), "--model", str(folder), "--output", f"{out}/"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(tree), cwd=str(tree), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"sdlite generate from {tree} failed:\n{proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def startup(tree: Path, folder: Path) -> float:
    """Seconds from process start to the first text encoding done, ``tree``'s sdlite."""
    cfg = {"engine": "sdlite", "model": str(folder), "prompt": PROMPT, "negative": NEGATIVE}
    warm_page_cache(folder)
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True,
                          env=_env(tree), cwd=str(tree))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"start-up child from {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])["marks"]["text1"] - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    trees = [args.before.resolve(), args.after.resolve()]
    for tree in trees:
        if not (tree / "sdlite" / "__init__.py").is_file():
            raise SystemExit(f"{tree}: not an sdlite source tree (no sdlite/__init__.py)")
        compileall.compile_dir(str(tree / "sdlite"), quiet=1)
    folder, _ = build()
    out = Path(tempfile.mkdtemp())
    runs = {tree: {"e2e": [], "rss": [], "startup": []} for tree in trees}
    for i in range(args.repeat):
        for tree in trees:
            wall, rss = e2e(tree, folder, args.size, args.steps, out)
            up = startup(tree, folder)
            runs[tree]["e2e"].append(wall)
            runs[tree]["rss"].append(rss)
            runs[tree]["startup"].append(up)
            print(f"  run {i + 1}, {tree.name}: e2e {wall:.2f} s, {rss:.0f} MB; start-up {up:.2f} s", flush=True)
    med = {tree: {k: statistics.median(v) for k, v in r.items()} for tree, r in runs.items()}
    before, after = med[trees[0]], med[trees[1]]
    print(f"\n{args.size}x{args.size}, {args.steps} steps, median of {args.repeat}, trees alternating")
    print("| measure | before | after | after / before |\n|---|---|---|---|")
    for key, name, unit, digits in (("e2e", "e2e wall (sdlite generate)", "s", 2), ("rss", "e2e peak RSS", "MB", 0),
                                    ("startup", "start-up to the first text encoding", "s", 2)):
        print(f"| {name} | {before[key]:.{digits}f} {unit} | {after[key]:.{digits}f} {unit} | "
              f"{after[key] / before[key]:.3f} |")


if __name__ == "__main__":
    main()
