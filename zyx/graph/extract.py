"""Extraction: choose, for each class the outputs need, the alternative node with the least total time.

Classes holding a single node keep it. Library alternatives come from ``Device.match_graph``.
"""

from __future__ import annotations

from zyx.graph.node import Class, Node


def choose(order: list[Class], outputs: list[Class]) -> dict[int, Node]:
    """Map id(class) → chosen node for classes with alternatives (absent: the class's own node)."""
    return {}
