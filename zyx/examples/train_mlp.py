"""Train an MLP classifier on scikit-learn's handwritten digits (8x8 images, shipped with scikit-learn, no
download), then report test accuracy and training speed.

    python -m zyx.examples.train_mlp [--device host] [--epochs 30] [--batch 64]

The training step is a ``zyx.jit`` function: the first step runs as usual (and compiles), the second is
captured, every later step replays it: no graph is built, nothing is planned or compiled (checked at the
end through ``zyx.debug.stats()``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import zyx
from zyx import nn, optim
from zyx.nn import functional as F


def load_digits(seed: int = 0):
    try:
        from sklearn.datasets import load_digits as sk_digits
        from sklearn.model_selection import train_test_split
    except ImportError:  # pragma: no cover - depends on the environment
        sys.exit("this example needs scikit-learn: pip install 'zyx[examples]'")
    d = sk_digits()
    x = (d.data / 16.0).astype(np.float32)
    return train_test_split(x, d.target.astype(np.int64), test_size=0.2, random_state=seed, stratify=d.target)


def make_model(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


class Progress:
    """A one-line progress bar on stderr: epoch, bar, loss."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0
        self.tty = sys.stderr.isatty()

    def update(self, epoch: int, epochs: int, loss: float) -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        line = f"epoch {epoch:3d}/{epochs} [{'#' * filled}{'.' * (self.width - filled)}] loss {loss:.4f}"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif self.done % max(1, self.total // 10) == 0 or self.done == self.total:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, device: str) -> float:
    model.eval()
    with zyx.no_grad():
        pred = model(zyx.Tensor(x, device=device)).argmax(-1).numpy()
    model.train()
    return float((pred == y).mean())


def train(epochs: int = 30, batch: int = 64, lr: float = 2e-3, device: str | None = None, seed: int = 0,
          quiet: bool = False) -> dict:
    device = device or zyx.default_device()
    zyx.manual_seed(seed)
    x_train, x_test, y_train, y_test = load_digits(seed)
    model = make_model().to(device)
    opt = optim.Adam(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    steps_per_epoch = len(x_train) // batch  # drop the ragged last batch: every step has one shape
    bar = Progress(epochs * steps_per_epoch) if not quiet else None

    @zyx.jit  # step 1 runs as usual, step 2 is captured, later steps replay it: no graph, no planning
    def train_step(xb: zyx.Tensor, yb: zyx.Tensor) -> zyx.Tensor:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step(loss)
        return loss

    zyx.debug.reset_stats()
    first = after_capture = None
    steps = 0
    t0 = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_train))
        for s in range(steps_per_epoch):
            idx = order[s * batch:(s + 1) * batch]
            loss = train_step(zyx.Tensor(x_train[idx], device=device), zyx.Tensor(y_train[idx], device=device))
            steps += 1
            if steps == 1:
                first = zyx.debug.stats()
            if steps == 2:
                after_capture = zyx.debug.stats()
            if bar is not None:
                bar.update(epoch, epochs, loss.item())
    train_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    stats = zyx.debug.stats()
    after_capture = after_capture or stats
    return {"accuracy": evaluate(model, x_test, y_test, device), "steps": steps, "seconds": train_s,
            "steps_per_s": steps / train_s, "compiles_first_step": first["compiles"],
            "compiles_later_steps": stats["compiles"] - first["compiles"],
            "graph_nodes_after_capture": stats["graph_nodes"] - after_capture["graph_nodes"],
            "replays": stats["jit_replays"], "final_loss": loss.item(), "device": device}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zyx.examples.train_mlp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="device to train on (default: zyx's default device)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    r = train(args.epochs, args.batch, args.lr, args.device, args.seed)
    print(f"device: {r['device']}")
    print(f"test accuracy: {r['accuracy'] * 100:.2f}%")
    print(f"{r['steps']} steps in {r['seconds']:.2f} s: {r['steps_per_s']:.1f} steps/s")
    print(f"kernels compiled: {r['compiles_first_step']} in the first step, {r['compiles_later_steps']} after it")
    print(f"zyx.jit: step 2 captured, {r['replays']} steps replayed, {r['graph_nodes_after_capture']} graph nodes "
          "built after the capture")
    if r["compiles_later_steps"] or r["graph_nodes_after_capture"]:
        print("error: a training step after the first compiled kernels or built a graph", file=sys.stderr)
        return 1
    return 0 if r["accuracy"] >= 0.95 else 2


if __name__ == "__main__":
    raise SystemExit(main())
