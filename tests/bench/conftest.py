"""Fixtures of the harness tests (CLI, report, result files, registry, timing, verification, tuning, provenance,
asv suites, packaging, launch plans, second order): they use the root conftest's ``flash`` as their example
operator and need nothing of their own yet."""
