"""The benchmarks, beside the package and not in its wheel: ``scripts/bench/NAME`` runs
``python -m bench.NAME`` from the repository root; docs/benchmarks.md has their figures.
They drive ttpeer through ``ttpeer_harness`` (processes, the network lab)."""
