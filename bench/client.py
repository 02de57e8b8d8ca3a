"""``scripts/bench/client``: how soon the client commands answer, beside a bare Python.

A relay and one peer run as processes on loopback; each command is then run as a user
runs it (a new ``python -m ttpeer`` process), ``--runs`` times, and timed from start to
exit: ``--help``, ``status`` answered by the running daemon, ``config show`` and
``invite`` (its token is read and thrown away, never printed). ``python -c pass`` is the
floor every command pays. Targets on a quiet machine: ``status`` <= 0.25 s and
``--help`` <= 0.15 s. The last column says what each command imported that the client
path must not (``tests/unit/test_client_imports.py`` holds the same rule).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from ttpeer_harness import make_pool, temporary_cluster

TARGETS = {"--help": 0.15, "status": 0.25}
# What the client path must not import (tests/unit/test_client_imports.py runs PROBE too).
HEAVY = ("ttpeer.proto", "torch", "trio", "httpx", "cryptography.x509", "numpy", "zstandard")
# Runs the command as ``python -m ttpeer`` does, then names the heavy modules it imported.
PROBE = ("import sys\nfrom ttpeer.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         f"print('HEAVY', *[m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n")


def _time(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    took = []
    for _ in range(runs):
        began = time.perf_counter()
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        took.append(time.perf_counter() - began)
        if done.returncode:
            raise SystemExit(f"{' '.join(argv[2:])} failed: {done.stderr.decode(errors='replace')[-500:]}")
    return took


def _heavy(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, timeout=60)
    for line in done.stderr.decode(errors="replace").splitlines():
        if line.startswith("HEAVY"):
            return line[len("HEAVY"):].strip() or "-"
    return "?"


def main() -> int:
    p = argparse.ArgumentParser(prog="scripts/bench/client", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--runs", type=int, default=10, help="times each command is run (default 10)")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    with temporary_cluster() as cluster:
        url, fp = cluster.start_relay()
        (home,) = make_pool(cluster, url, fp, ["alice"])
        env, at = cluster.env, ["--home", str(home)]
        rows = [("python -c pass", [sys.executable, "-c", "pass"], None),
                ("--help", [sys.executable, "-m", "ttpeer", "--help"], ["--help"]),
                ("status", [sys.executable, "-m", "ttpeer", "status", *at], ["status", *at]),
                ("config show", [sys.executable, "-m", "ttpeer", "config", "show", *at], ["config", "show", *at]),
                ("invite", [sys.executable, "-m", "ttpeer", "invite", *at], ["invite", *at])]
        print(f"{'command':<16}{'median s':>10}{'min s':>8}{'target':>8}  heavy imports")
        for name, argv, probe in rows:
            took = _time(argv, env, args.runs)
            target = f"{TARGETS[name]:.2f}" if name in TARGETS else "-"
            heavy = _heavy(probe, env) if probe else "-"
            print(f"{name:<16}{statistics.median(took):>10.3f}{min(took):>8.3f}{target:>8}  {heavy}")
    print(f"({args.runs} runs each, a new process every run; 'status' is answered by a running daemon)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
