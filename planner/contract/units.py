"""Units both halves of the project count in."""

GIB = 2**30
"""Bytes in a gibibyte (what every memory figure is printed in)."""
