"""Observability: per-step metrics and the step trace."""
