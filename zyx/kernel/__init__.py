"""Kernel IR, its optimizations, and the C-like renderers."""
