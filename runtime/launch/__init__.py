"""Launching a plan: Ray actors (launcher), torchrun (torchrun), the per-rank entry (driver)."""
