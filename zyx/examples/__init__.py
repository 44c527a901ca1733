"""Runnable examples: ``python -m zyx.examples.train_mlp``."""
