"""What a trial's workers cost to start, by what the forkserver preloads.

    python bench/worker_start.py [--trials 5] [--repeats 2] [--preset dp2]

Each variant is a fresh driver process that runs ``--trials`` trials one after another in
itself (gpt_tiny, ``trainer=smoke``, 3 steps, on the CPU), as a sweep on the basic launcher or a
test module does, with ``orchestrator.launch.FORKSERVER_PRELOAD`` set to:

- ``trainer``: torch, torch.distributed and the trainer's loop (what it preloaded before);
- ``full``: the shipped list (the parallel packages a rank builds with, and rank 0's MLflow
  reporter).

Per trial it reads the wall time of ``trial.run`` and the CPU-seconds the whole machine spent in
that time (``/proc/stat``, so the forked workers count: run it on an idle machine). The first
trial of a driver pays for the server's own imports; the figure that matters for a sweep is the
median over the trials after it. Variants alternate over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER_ONLY = ("torch", "torch.distributed", "trainers.loop")

DRIVER = r"""
import json, sys, time
sys.path.insert(0, {root!r})

def busy():
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / 100.0  # all but idle and iowait

def main():
    from orchestrator import launch, trial
    from tests.conftest import composed
    launch.FORKSERVER_PRELOAD = tuple({preload!r})
    out = []
    for k in range({trials}):
        cfg = composed(["+chip=cpu", "parallel={preset}", "trainer=smoke", "trainer.steps=3",
                        "data.num_workers=0", "tracking.uri=sqlite:///{tmp}/%d.db" % k])
        b, t = busy(), time.time()
        status = trial.run(cfg, [], progress=False)["status"]
        out.append({{"status": status, "wall": time.time() - t, "cpu": busy() - b}})
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main()
"""


def run_driver(preload, trials: int, preset: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        code = DRIVER.format(root=str(ROOT), preload=list(preload), trials=trials, preset=preset, tmp=tmp)
        script = Path(tmp) / "driver.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp, capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"driver failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(line[len("RESULT ") :])
    bad = [r["status"] for r in rows if r["status"] != "finished"]
    if bad:
        raise SystemExit(f"a trial did not finish: {bad}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--preset", default="dp2")
    args = ap.parse_args(argv)
    from orchestrator.launch import FORKSERVER_PRELOAD

    variants = {"trainer": TRAINER_ONLY, "full": FORKSERVER_PRELOAD}
    rows = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, preload in variants.items():
            rows[name].append(run_driver(preload, args.trials, args.preset))
    print(f"parallel={args.preset}, {args.trials} trials a driver, {args.repeats} drivers a variant")
    print(f"{'preload':8} {'first wall-s':>12} {'first cpu-s':>11} {'later wall-s':>12} {'later cpu-s':>11}")
    later = {}
    for name, drivers in rows.items():
        first = [d[0] for d in drivers]
        rest = [r for d in drivers for r in d[1:]]
        later[name] = statistics.median(r["cpu"] for r in rest)
        med = {key: statistics.median(r[key] for r in first) for key in ("wall", "cpu")}
        wall = statistics.median(r["wall"] for r in rest)
        print(f"{name:8} {med['wall']:12.2f} {med['cpu']:11.2f} {wall:12.2f} {later[name]:11.2f}")
    print(f"CPU-seconds of a later trial, trainer / full: {later['trainer'] / later['full']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
