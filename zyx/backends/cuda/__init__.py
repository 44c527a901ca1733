"""CUDA backend for zyx."""
