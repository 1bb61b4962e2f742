"""Checkpoints: Hugging Face folders (hf_folder) and the sharded DCP checkpoints a run resumes from."""
