"""Prompt data: verl-style parquet/JSONL datasets, the built-in synthetic task, and the resumable loader
that turns them into the prompt batches a training step generates from."""
