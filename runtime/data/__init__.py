"""Data: sample layouts and image processing (samples), conversations, a dataset plan's packs, prefetching."""
