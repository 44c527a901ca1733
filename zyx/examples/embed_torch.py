"""The same sentence embeddings computed by PyTorch on the same weights: the reference for tests and benchmarks.

An independent forward (Hugging Face's ``BertModel`` arithmetic: additive ``finfo.min`` key mask, erf GELU,
LayerNorm eps from the config), written with ``torch.nn.functional`` only, so it needs no ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class TorchMiniLM:
    """``encode(ids, mask) -> (n, 384)`` numpy embeddings; weights read with ``safetensors`` into torch tensors."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        import torch
        from safetensors.numpy import load_file

        self.torch = torch
        if threads:
            torch.set_num_threads(threads)
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {k: torch.from_numpy(v) for k, v in load_file(str(path / "model.safetensors")).items()}

    def _ln(self, x, name: str):
        f = self.torch.nn.functional
        return f.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"],
                            self.cfg["layer_norm_eps"])

    def _lin(self, x, name: str):
        return self.torch.nn.functional.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def hidden(self, ids: np.ndarray, mask: np.ndarray):
        torch, f, w, cfg = self.torch, self.torch.nn.functional, self.w, self.cfg
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        b, n = ids.shape
        heads = cfg["num_attention_heads"]
        d = cfg["hidden_size"] // heads
        x = w["embeddings.word_embeddings.weight"][ids_t] + w["embeddings.position_embeddings.weight"][:n] \
            + w["embeddings.token_type_embeddings.weight"][0]
        x = self._ln(x, "embeddings.LayerNorm")
        add = (1.0 - mask_t[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def split(t):
                return t.view(b, n, heads, d).permute(0, 2, 1, 3)

            q = split(self._lin(x, p + "attention.self.query"))
            k = split(self._lin(x, p + "attention.self.key"))
            v = split(self._lin(x, p + "attention.self.value"))
            scores = q @ k.transpose(-1, -2) / d ** 0.5 + add
            ctx = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, n, heads * d)
            a = self._ln(self._lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
            h = f.gelu(self._lin(a, p + "intermediate.dense"))
            x = self._ln(self._lin(h, p + "output.dense") + a, p + "output.LayerNorm")
        return x

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with self.torch.inference_mode():
            h = self.hidden(ids, mask)
            m = self.torch.from_numpy(mask).float().unsqueeze(-1)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return self.torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()
