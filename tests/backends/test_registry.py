"""Config file and registry: search path, defaults, malformed files, unavailable backends, device names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zyx.backends import registry as reg
from zyx.utils import parse_debug


def test_missing_file_means_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("ZYX_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    cfg, path = reg.load_config()
    assert path is None and cfg == reg.DEFAULTS


def test_xdg_location_and_merge(tmp_path, monkeypatch):
    monkeypatch.delenv("ZYX_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "zyx").mkdir()
    (tmp_path / "zyx" / "config.json").write_text(json.dumps({"host": {"threads": 1}, "cuda": {"queues": 4}}))
    cfg, path = reg.load_config()
    assert path == tmp_path / "zyx" / "config.json"
    assert cfg["host"] == {"enabled": True, "cc": "cc", "openmp": True, "threads": 1}
    assert cfg["cuda"]["queues"] == 4 and cfg["cuda"]["cudnn"] is True


def test_zyx_config_env_wins(tmp_path, monkeypatch):
    f = tmp_path / "mine.json"
    f.write_text('{"default_device": "host"}')
    monkeypatch.setenv("ZYX_CONFIG", str(f))
    cfg, path = reg.load_config()
    assert path == f and cfg["default_device"] == "host"
    monkeypatch.setenv("ZYX_CONFIG", str(tmp_path / "absent.json"))
    with pytest.raises(reg.ConfigError, match="absent.json: ZYX_CONFIG names a file that does not exist"):
        reg.load_config()


@pytest.mark.parametrize("text,match", [
    ('{"host": {"threads": 2,}}', r"bad.json:1: not valid JSON"),
    ('{\n  "hots": {}\n}', r"bad.json:2: unknown key 'hots'"),
    ('{\n "host": {\n  "threads": "two"\n }\n}', r"bad.json:3: key 'host.threads' must be int or null"),
    ('{"host": {"enabled": 1}}', r"key 'host.enabled' must be bool"),
    ('{"cuda": {"device_ids": [0, -1]}}', r"'cuda.device_ids' must list GPU ordinals"),
    ('{"cuda": {"queues": 0}}', r"'cuda.queues' must be at least 1"),
    ('{"blas": true}', r"key 'blas' must be an object"),
    ('[1, 2]', r"the top level must be a JSON object"),
    ('{"host": {"colour": 1}}', r"unknown key 'host.colour'"),
    ('{"blas": {"library": "atlas"}}', r"'blas.library' must be one of 'auto', 'mkl', 'openblas'"),
])
def test_malformed_files_name_file_line_and_key(tmp_path, text, match):
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(reg.ConfigError, match=match):
        reg.load_config(f)


def test_disabled_and_missing_backends_are_reported_not_fatal(tmp_path, monkeypatch):
    monkeypatch.delenv("ZYX_DEFAULT_DEVICE", raising=False)
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"cuda": {"device_ids": []}, "host": {"cc": "no-such-compiler-xyz"}}))
    r = reg.Registry(f)
    status = r.report()
    assert "disabled in the config" in status["cuda"]
    assert "no-such-compiler-xyz" in status["host"] and "not found" in status["host"]
    with pytest.raises(reg.BackendError, match="no compute device is available"):
        r.default_device()


@pytest.mark.parametrize("library", ["openblas", "mkl"])
def test_the_configured_blas_library_is_used_or_its_absence_explained(tmp_path, library):
    """``blas.library`` picks the CBLAS; "mkl" without the wheel installed says which pip extra to install (and
    the host still computes, through generated matmuls)."""
    import numpy as np

    from zyx.backends.blas import device as blas

    f = tmp_path / "c.json"
    f.write_text(json.dumps({"blas": {"library": library}}))
    r = reg.Registry(f)
    devs = [d for d in r.get("host").devices if d.info().kind == "blas"]
    if library == "mkl" and blas._find_mkl() is None:
        assert not devs
        with pytest.raises(reg.BackendError, match=r"pip install 'zyx\[mkl\]'"):
            blas.BlasDevice(r.get("host").pool, None, "mkl")
        return
    assert devs and devs[0].library == library and devs[0].info().extra["library"] == library
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    dev = devs[0]
    gemm = blas.Gemm(blas.dtypes.float32, (), 3, 3, 4, False, True, 4, 4, 3, 0, 0, (), (), ())
    pid = dev._program(gemm)
    pool = r.get("host").pool
    ids = [pool.allocate(a.nbytes), pool.allocate(a.nbytes), pool.allocate(36)]
    for i in ids[:2]:
        pool.host_to_pool(memoryview(a.reshape(-1).view(np.uint8)), i)
    dev.launch(pid, ids)
    out = pool.view(ids[2]).view(np.float32).reshape(3, 3)
    np.testing.assert_allclose(out, a @ a.T)
    for i in ids:
        pool.release(i)


def test_device_names():
    assert reg.canonical_name("cpu") == "host"
    assert reg.canonical_name("CUDA") == "cuda:0"
    assert reg.canonical_name("cuda:3") == "cuda:3"
    with pytest.raises(ValueError, match="unknown device name"):
        reg.canonical_name("gpu")


def test_default_device_from_config(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"default_device": "cpu"}')
    assert reg.Registry(f).default_device() == "host"


def test_debug_flags():
    assert parse_debug("sched,asm") == 4 | 16
    assert parse_debug("5") == 5
    assert parse_debug("") == 0
    with pytest.raises(ValueError, match="unknown flag 'nope'"):
        parse_debug("dev,nope")


def test_import_never_crashes_and_dev_debug_explains(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"cuda": {"device_ids": []}}')
    code = "import zyx; zyx.registry().report(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"ZYX_CONFIG": str(f), "ZYX_DEBUG": "dev", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "ok" in out.stdout
    assert "[zyx:dev] cuda: unavailable: disabled in the config" in out.stderr


def test_main_job_prints_backends_and_kernels():
    out = subprocess.run([sys.executable, "-m", "zyx", "--size", "65536"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "backends:" in out.stdout and "host" in out.stdout
    assert "generated host" in out.stdout and "max abs error vs NumPy" in out.stdout
