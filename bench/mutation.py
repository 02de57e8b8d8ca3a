"""``scripts/mutation``: how many mutants of the pure protocol its own unit tests kill.

A mutant is the code with one small change (mutmut's: a comparison flipped, ``and`` for
``or``, a constant or an operator changed, a call's argument dropped...); a test suite
that passes on a mutant would not notice that bug. The run copies the repository's
tracked files to a scratch folder (``ttpeer_wire`` moved to its top level, where mutmut
can name its modules), configures mutmut there, mutates ``--modules`` and judges each
mutant by ``--tests`` (only the tests that run the mutated function), then prints one row
per module: mutants, killed, survived, not reached by the tests, timeouts, and the score
killed / (all but skipped ones). ``--show N`` prints the diffs of the first N survivors.

    scripts/mutation                                  # the default modules (a few minutes)
    scripts/mutation --modules ttpeer/proto/_leases.py --show 20
    scripts/mutation --all --jobs 2                   # every module of proto and ttpeer_wire

Not part of CI: minutes to an hour of CPU. A survivor is either a gap in the tests or an
equivalent mutant (one no behaviour can tell apart); the report cannot say which.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODULES = [f"ttpeer/proto/{m}.py" for m in ("_leases", "_slicer", "_cadence", "_outcome", "_keyring",
                                                     "_slices", "_membership")]
ALL_MODULES = ["ttpeer/proto/*.py", "ttpeer_wire/*.py"]
DEFAULT_TESTS = ["tests/unit/test_proto_*.py", "tests/unit/test_wire*.py", "tests/unit/test_cadence.py",
                 "tests/unit/test_outer_rule.py",
                 "tests/unit/test_security_records.py", "tests/unit/test_local_agreement.py"]
STATES = ("killed", "survived", "no tests", "timeout", "suspicious", "skipped", "segfault")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/mutation", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", nargs="+", default=None, metavar="PATH",
                    help="files to mutate, relative to the repository (ttpeer_wire/... for the wire "
                         f"package); default: {' '.join(DEFAULT_MODULES)}")
    ap.add_argument("--all", action="store_true", help=f"mutate {' and '.join(ALL_MODULES)}")
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, metavar="GLOB",
                    help="the tests that judge the mutants (default: the protocol's own unit tests)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="mutants tested at once (default: half the cores)")
    ap.add_argument("--show", type=int, default=0, metavar="N", help="print the diffs of the first N survivors")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows and survivors here")
    args = ap.parse_args(argv)
    if args.all and args.modules:
        ap.error("give --modules or --all, not both")
    args.modules = ALL_MODULES if args.all else (args.modules or DEFAULT_MODULES)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    return args


def scratch_copy(dest: Path) -> None:
    """The tracked files of the repository, ``bootstrap-relay/ttpeer_wire`` also at the top."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    shutil.copytree(dest / "bootstrap-relay" / "ttpeer_wire", dest / "ttpeer_wire")


def configure(dest: Path, args: argparse.Namespace) -> None:
    tests = sorted({str(p.relative_to(dest)) for pattern in args.tests for p in dest.glob(pattern)})
    if not tests:
        raise SystemExit(f"error: no test file matches {' '.join(args.tests)}")
    config = {"source_paths": ["ttpeer/", "ttpeer_wire/"], "only_mutate": args.modules,
              "pytest_add_cli_args_test_selection": tests,
              # The import-purity tests read the modules' imports, which mutmut's trampolines change.
              "pytest_add_cli_args": ["-p", "no:randomly", "-q", "-k", "not is_pure"],
              "also_copy": ["bootstrap-relay/", "ttpeer_harness/", "bench/", "scripts/"]}
    lines = ["", "[tool.mutmut]", *(f"{k} = {json.dumps(v)}" for k, v in config.items())]
    with open(dest / "pyproject.toml", "a") as f:
        f.write("\n".join(lines) + "\n")


def results(dest: Path) -> dict[str, str]:
    """Each mutant's name and state, from ``mutmut results --all true``."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=dest,
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def module_of(mutant: str) -> str:
    """``ttpeer.proto._leases`` of ``ttpeer.proto._leases.xǁLeaseTableǁadmit__mutmut_3`` (a
    method) or ``ttpeer.proto._outcome.x_took_part__mutmut_1`` (a function)."""
    m = re.match(r"(.+?)\.x[_ǁ]", mutant)
    return m.group(1) if m else mutant.split("__mutmut_")[0]


def table(states: dict[str, str]) -> list[dict[str, object]]:
    by_module: dict[str, Counter[str]] = {}
    for mutant, state in states.items():
        by_module.setdefault(module_of(mutant), Counter())[state] += 1
    rows = []
    for module, c in sorted(by_module.items()):
        judged = sum(c.values()) - c["skipped"]
        rows.append({"module": module, "mutants": sum(c.values()), **{s: c[s] for s in STATES},
                     "score": c["killed"] / judged if judged else None})
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print("| module | mutants | killed | survived | not reached | timeout | score |")
    print("|---|---|---|---|---|---|---|")
    total: Counter[str] = Counter()
    for r in rows:
        score = "-" if r["score"] is None else f"{100 * r['score']:.1f}%"  # type: ignore[operator]
        print(f"| {r['module']} | {r['mutants']} | {r['killed']} | {r['survived']} | {r['no tests']} | "
              f"{r['timeout']} | {score} |")
        total.update({k: int(r[k]) for k in ("mutants", *STATES)})  # type: ignore[call-overload]
    judged = total["mutants"] - total["skipped"]
    print(f"| all | {total['mutants']} | {total['killed']} | {total['survived']} | {total['no tests']} | "
          f"{total['timeout']} | {100 * total['killed'] / max(judged, 1):.1f}% |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("error: mutmut is not installed here ('scripts/mutation' installs it into .venv)", file=sys.stderr)
        return 2
    dest = Path(tempfile.mkdtemp(prefix="ttpeer-mutation-"))
    try:
        scratch_copy(dest)
        configure(dest, args)
        print(f"mutating {' '.join(args.modules)}, judged by {len(args.tests)} test pattern(s), "
              f"{args.jobs} at once (scratch: {dest})", flush=True)
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs)], cwd=dest,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if run.returncode != 0:  # mutmut says why on stdout, after its progress lines
            said = re.sub(r"[^\n]*\r", "", run.stdout)[-3000:]
            print(f"error: mutmut failed ({run.returncode}); it said:\n{said}", file=sys.stderr)
            return 1
        states = results(dest)
        rows = table(states)
        print_table(rows)
        survivors = sorted(m for m, s in states.items() if s == "survived")
        for name in survivors[: args.show]:
            shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=dest, capture_output=True,
                                   text=True).stdout
            print(f"\n{name}:\n{shown.strip()}")
        if args.json:
            args.json.write_text(json.dumps({"modules": args.modules, "tests": args.tests, "rows": rows,
                                             "survivors": survivors}, indent=1))
        return 0
    finally:
        if args.keep:
            print(f"kept {dest}")
        else:
            shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
