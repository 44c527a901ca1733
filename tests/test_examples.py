"""The main job: training the digits MLP reaches the accuracy target and compiles only in its first step."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("sklearn")


def test_train_mlp_accuracy_and_no_recompiles():
    from zyx.examples.train_mlp import train

    r = train(epochs=15, quiet=True)
    assert r["accuracy"] >= 0.95, r
    assert r["compiles_first_step"] > 0
    assert r["compiles_later_steps"] == 0, r


def test_train_mlp_command_line():
    out = subprocess.run([sys.executable, "-m", "zyx.examples.train_mlp", "--epochs", "3"], capture_output=True,
                         text=True, timeout=300)
    assert "test accuracy:" in out.stdout and "steps/s" in out.stdout, out.stderr
    assert "0 after it" in out.stdout
    assert "loss" in out.stderr  # the progress bar
