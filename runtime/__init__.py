"""Run a Plan on Ray with the planned per-module parallelism: ``python -m runtime plan.json`` (docs/runtime.md)."""
