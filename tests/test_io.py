"""zyx.load / zyx.save: safetensors and .npy interop, laziness, disk slicing, bad files, atomic saves, memory."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zyx
import zyx.io as zio
from zyx import dtypes
from zyx.backends.registry import registry

stn = pytest.importorskip("safetensors.numpy")

SHAPES = [(), (0,), (2, 0, 3), (7,), (3, 4, 5)]


@pytest.fixture
def disk():
    return registry().get("disk").pool


def sample(d: dtypes.DType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values spanning the dtype: full integer range, floats with inf, nan and -0.0."""
    if d.kind == "b":
        return np.asarray(rng.integers(0, 2, shape)).astype(np.bool_)
    if d.kind in "iu":
        info = np.iinfo(d.np_dtype)
        return np.asarray(rng.integers(info.min, info.max, shape, dtype=d.np_dtype, endpoint=True))
    a = np.asarray(rng.standard_normal(shape) * 100).astype(d.np_dtype)
    flat = a.reshape(-1)
    for i, v in enumerate([np.inf, np.nan, -0.0, -np.inf][:flat.size]):
        flat[i] = v
    return a


def same_bytes(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def write_raw(path, header, data: bytes = b"", length: int | None = None) -> str:
    """A safetensors-like file with any header (dict -> JSON, or raw bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# round trips with the official package


@pytest.mark.parametrize("d", dtypes.ALL, ids=lambda d: d.name)
def test_official_file_loads_in_zyx(tmp_path, d, rng, disk):
    arrays = {f"t{i}": sample(d, s, rng) for i, s in enumerate(SHAPES)}
    path = tmp_path / "ref.safetensors"
    stn.save_file(arrays, str(path))
    loaded = zyx.load(path)
    assert set(loaded) == set(arrays)
    for name, want in arrays.items():
        t = loaded[name]
        assert t.device == "disk" and t.dtype is d and t.shape == want.shape
        same_bytes(t.numpy(), want)


@pytest.mark.parametrize("d", dtypes.ALL, ids=lambda d: d.name)
def test_zyx_file_loads_in_official(tmp_path, d, rng):
    arrays = {f"t{i}": sample(d, s, rng) for i, s in enumerate(SHAPES)}
    path = str(tmp_path / "mine.safetensors")
    zyx.save(path, {k: zyx.Tensor(v) for k, v in arrays.items()})
    back = stn.load_file(path)
    for name, want in arrays.items():
        same_bytes(back[name], want)
    # one dtype, no metadata: the official writer produces the very same bytes
    stn.save_file(arrays, str(tmp_path / "ref.safetensors"))
    assert open(path, "rb").read() == open(tmp_path / "ref.safetensors", "rb").read()


def test_bfloat16_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    x = torch.randn(3, 5).to(torch.bfloat16)
    x[0, 0] = float("nan")
    st_torch.save_file({"x": x, "s": torch.tensor(2.5, dtype=torch.bfloat16)}, str(tmp_path / "t.safetensors"))
    d = zyx.load(tmp_path / "t.safetensors")
    want = x.view(torch.int16).numpy()
    assert d["x"].dtype is zyx.bfloat16
    assert d["x"].numpy().view(np.int16).tobytes() == want.tobytes()
    assert d["s"].item() == 2.5
    zyx.save(tmp_path / "back.safetensors", {"x": d["x"], "y": d["x"] * 2})
    back = st_torch.load_file(str(tmp_path / "back.safetensors"))
    assert back["x"].dtype == torch.bfloat16
    assert torch.equal(back["x"].view(torch.int16), x.view(torch.int16))
    np.testing.assert_array_equal(back["y"][1:].float().numpy(), (x[1:].float() * 2).numpy())


def test_metadata_round_trip(tmp_path):
    meta = {"format": "pt", "note": "ünïcode ✓", "empty": ""}
    stn.save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "ref.safetensors"), metadata=meta)
    assert zio.load_metadata(tmp_path / "ref.safetensors") == meta
    zyx.save(tmp_path / "mine.safetensors", {"a": zyx.ones(2)}, metadata=meta)
    assert zio.load_metadata(tmp_path / "mine.safetensors") == meta
    with open(tmp_path / "mine.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        assert n % 8 == 0
        assert json.loads(f.read(n))["__metadata__"] == meta
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mine.safetensors"), framework="np") as f:
        assert f.metadata() == meta
    for m in ({}, {"only": "one"}):  # (one key or none: the official writer's key order is a hash order)
        stn.save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "ref.safetensors"), metadata=m)
        zyx.save(tmp_path / "mine.safetensors", {"a": zyx.ones(2)}, metadata=m)
        assert (tmp_path / "mine.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    zyx.save(tmp_path / "none.safetensors", {"a": zyx.ones(2)})
    assert zio.load_metadata(tmp_path / "none.safetensors") == {}


def test_zyx_round_trip_of_computed_and_loaded_tensors(tmp_path, rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    zyx.save(tmp_path / "a.safetensors", {"a": zyx.Tensor(a), "b": zyx.Tensor(a) * 2 + 1,
                                           "c": zyx.arange(10, dtype=zyx.int16)})
    d = zyx.load(tmp_path / "a.safetensors")
    zyx.save(tmp_path / "b.safetensors", d)  # disk tensors are written straight from their mapping
    d2 = zyx.load(tmp_path / "b.safetensors")
    same_bytes(d2["a"].numpy(), a)
    np.testing.assert_allclose(d2["b"].numpy(), a * 2 + 1, rtol=1e-6)
    same_bytes(d2["c"].numpy(), np.arange(10, dtype=np.int16))
    assert open(tmp_path / "a.safetensors", "rb").read() == open(tmp_path / "b.safetensors", "rb").read()


def test_saved_file_mode_follows_umask(tmp_path):
    zyx.save(tmp_path / "m.safetensors", {"a": zyx.ones(1)})
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(tmp_path / "m.safetensors").st_mode & 0o777 == 0o666 & ~umask


# ---------------------------------------------------------------------------------------------------------------
# .npy


@pytest.mark.parametrize("npd", [np.float32, np.float64, np.float16, np.int8, np.uint16, np.int32, np.uint64,
                                 np.bool_])
@pytest.mark.parametrize("order", ["C", "F"])
def test_npy_load(tmp_path, npd, order, rng):
    d = dtypes.to_dtype(npd)
    for i, shape in enumerate(SHAPES + [(2, 3)]):
        a = np.asarray(sample(d, shape, rng), order=order)
        path = tmp_path / f"a{i}.npy"
        np.save(path, a)
        t = zyx.load(path)
        assert t.dtype is d and t.shape == a.shape
        fortran = order == "F" and a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous
        assert t.device == (zyx.default_device() if fortran else "disk")
        same_bytes(t.numpy(), np.array(a, order="C"))


def test_npy_fortran_in_ops_and_header_versions(tmp_path, rng):
    a = np.asfortranarray(rng.standard_normal((3, 4, 5)))
    np.save(tmp_path / "f.npy", a)
    t = zyx.load(tmp_path / "f.npy")
    np.testing.assert_allclose((t * 2).sum(axis=2).numpy(), (a * 2).sum(axis=2))
    for version in [(1, 0), (2, 0), (3, 0)]:
        with open(tmp_path / "v.npy", "wb") as f:
            np.lib.format.write_array(f, a[0], version=version)
        same_bytes(zyx.load(tmp_path / "v.npy").numpy(), np.array(a[0], order="C"))


def test_npy_save_round_trip(tmp_path, rng):
    a = rng.integers(-9, 9, (3, 4)).astype(np.int32)
    zyx.save(tmp_path / "x.npy", zyx.Tensor(a) * 3)
    same_bytes(np.load(tmp_path / "x.npy"), a * 3)
    with pytest.raises(TypeError, match="bfloat16"):
        zyx.save(tmp_path / "y.npy", zyx.ones(2, dtype=zyx.bfloat16))
    assert not (tmp_path / "y.npy").exists()


@pytest.mark.parametrize("make,match", [
    (lambda p: p.write_bytes(b"NOTNUMPY" + b"\0" * 64), "not a valid .npy"),
    (lambda p: p.write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': garbage"), "not a valid .npy"),
    (lambda p: np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True), "object"),
    (lambda p: np.save(p, np.zeros(3, dtype=[("a", np.int32), ("b", np.float32)])), "structured"),
    (lambda p: np.save(p, np.zeros(3, dtype=">f4")), "byte order"),
    (lambda p: np.save(p, np.zeros(3, dtype=np.complex64)), "not supported"),
    (lambda p: p.write_bytes(open(np.save(p, np.arange(100.0)) or p, "rb").read()[:-8]), "truncated"),
])
def test_bad_npy_files(tmp_path, make, match):
    path = tmp_path / "bad.npy"
    make(path)
    with pytest.raises(ValueError, match=match) as e:
        zyx.load(path)
    assert str(path) in str(e.value)


def test_not_regular_files_are_refused_without_hanging(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"d\.safetensors: not a regular file"):
        zyx.load(tmp_path / "d.safetensors")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "p.npy")  # opening a FIFO for reading would block without O_NONBLOCK
        with pytest.raises(ValueError, match="not a regular file"):
            zyx.load(tmp_path / "p.npy")


def test_empty_dict_and_symlinked_destination(tmp_path):
    zyx.save(tmp_path / "e.safetensors", {})
    assert zyx.load(tmp_path / "e.safetensors") == {} and stn.load_file(str(tmp_path / "e.safetensors")) == {}
    os.symlink(tmp_path / "e.safetensors", tmp_path / "link.safetensors")
    zyx.save(tmp_path / "link.safetensors", {"a": zyx.ones(2)})
    assert os.path.islink(tmp_path / "link.safetensors")  # the target was replaced, the link kept
    np.testing.assert_array_equal(zyx.load(tmp_path / "e.safetensors")["a"].numpy(), np.ones(2, np.float32))
    assert sorted(os.listdir(tmp_path)) == ["e.safetensors", "link.safetensors"]


def test_unknown_file_type(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"hello world, not a tensor file")
    with pytest.raises(ValueError, match=r"x\.bin.*unknown file type"):
        zyx.load(tmp_path / "x.bin")
    with pytest.raises(FileNotFoundError, match="missing"):
        zyx.load(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# laziness and use


def test_load_reads_no_tensor_data(tmp_path, disk, rng):
    a = rng.standard_normal((64, 32)).astype(np.float32)
    stn.save_file({"a": a, "b": np.arange(5, dtype=np.int64)}, str(tmp_path / "m.safetensors"))
    before = disk.bytes_read, disk.reads
    d = zyx.load(tmp_path / "m.safetensors")
    y = (d["a"] * 2).sum(axis=0) + d["b"].sum()  # building ops reads nothing either
    assert (disk.bytes_read, disk.reads) == before
    np.testing.assert_allclose(y.numpy(), (a * 2).sum(axis=0) + 10, rtol=1e-5, atol=1e-4)
    assert disk.bytes_read - before[0] == a.nbytes + 5 * 8  # each tensor read once, entirely


def test_loaded_tensors_in_ops_match_numpy(tmp_path, rng):
    a = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal((16, 4)).astype(np.float32)
    i = rng.integers(-100, 100, (8, 16)).astype(np.int32)
    stn.save_file({"a": a, "b": b, "i": i}, str(tmp_path / "m.safetensors"))
    d = zyx.load(tmp_path / "m.safetensors")
    dev = zyx.default_device()
    cases = [
        ((d["a"] @ d["b"]), a @ b),
        ((d["a"] + d["i"]).max(axis=1), (a + i).max(axis=1)),
        ((d["a"].exp() * zyx.Tensor(a)).mean(), (np.exp(a) * a).mean()),
        ((d["i"] * 1).cast(zyx.float32).T, i.astype(np.float32).T),
        (zyx.cat([d["a"], d["a"]]), np.concatenate([a, a])),
        (d["a"][d["i"][:, 0] % 8], a[i[:, 0] % 8]),
    ]
    for got, want in cases:
        assert got.device == dev
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["cast", "reshape", "T", "flip", "pad", "expand", "contiguous", "where"])
def test_movement_and_cast_on_disk_tensors(tmp_path, op):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    stn.save_file({"a": a}, str(tmp_path / "m.safetensors"))
    t = zyx.load(tmp_path / "m.safetensors")["a"]
    got, want = {
        "cast": (lambda: t.cast(zyx.int32), lambda: a.astype(np.int32)),
        "reshape": (lambda: t.reshape(3, 2), lambda: a.reshape(3, 2)),
        "T": (lambda: t.T, lambda: a.T),
        "flip": (lambda: t.flip(0), lambda: a[::-1]),
        "pad": (lambda: t.pad(((1, 0), (0, 0))), lambda: np.pad(a, ((1, 0), (0, 0)))),
        "expand": (lambda: t.broadcast_to((2, 2, 3)), lambda: np.broadcast_to(a, (2, 2, 3))),
        "contiguous": (lambda: t.contiguous(), lambda: a),
        "where": (lambda: zyx.where(t > 2, t, 0), lambda: np.where(a > 2, a, 0)),
    }[op]
    np.testing.assert_array_equal(got().numpy(), want())


def test_numpy_of_a_disk_tensor_reads_it_once(tmp_path, disk):
    stn.save_file({"a": np.ones(100, np.float32)}, str(tmp_path / "m.safetensors"))
    t = zyx.load(tmp_path / "m.safetensors")["a"]
    before = disk.bytes_read
    t.numpy()
    assert disk.bytes_read - before == 400


def test_file_replaced_under_loaded_tensors(tmp_path, rng):
    path = tmp_path / "m.safetensors"
    a = rng.standard_normal(16).astype(np.float32)
    zyx.save(path, {"w": zyx.Tensor(a)})
    old = zyx.load(path)
    zyx.save(path, {"w": old["w"] * 2})  # rewrite the file the tensor maps
    new = zyx.load(path)
    np.testing.assert_array_equal(old["w"].numpy(), a)
    np.testing.assert_allclose(new["w"].numpy(), a * 2)


# ---------------------------------------------------------------------------------------------------------------
# slicing disk tensors


def flat_range(shape, index) -> tuple[int, int]:
    """[min, max + 1) of the flat element indices ``index`` selects (NumPy), or (0, 0) when empty."""
    sel = np.arange(math.prod(shape)).reshape(shape)[index]
    return (int(sel.min()), int(sel.max()) + 1) if sel.size else (0, 0)


@pytest.fixture
def cube(tmp_path, rng):
    a = rng.standard_normal((4, 5, 6)).astype(np.float32)
    stn.save_file({"pad": np.ones(3, np.int8), "a": a}, str(tmp_path / "c.safetensors"))
    return zyx.load(tmp_path / "c.safetensors")["a"], a


def check_index(t, a, index, disk) -> None:
    want = a[index]
    lo, hi = flat_range(a.shape, index)
    r = t[index]
    assert r.shape == want.shape
    if r.device == "disk":  # exactly the selected range, nothing read yet
        _, off, n = disk.location(r.cls.buffer.id)
        _, base, _ = disk.location(t.cls.buffer.id)
        assert (off - base, n) == (lo * 4, (hi - lo) * 4)
        same_bytes(r.numpy(), want)
    else:
        before = disk.bytes_read
        r.realize()
        assert disk.bytes_read - before == (hi - lo) * 4, f"index {index!r} read more than it needs"
        same_bytes(r.numpy(), want)


INDEXES = [
    0, -1, 3, slice(1, 3), slice(None), slice(None, None, -1), (1, 2), (1, 2, 3), (-1, -1, -1), (2, slice(1, 4)),
    (slice(1, 3), 2), (slice(None), 0, 0), (..., 1), (1, ..., slice(2, 5)), (None, 1), (1, None, slice(2, 4), None),
    (slice(3, 0, -1), slice(None, None, 2)), (slice(None, None, -2), 4, slice(5, None, -3)), (slice(2, 3), 1),
    (slice(2, 3), slice(1, 2), slice(0, 6)), (slice(3, 3),), (slice(None), slice(4, 1)), (..., slice(0, 0)),
    (np.int64(2), slice(None), np.int32(-2)), (), (...,), None, (slice(-100, 100), -5), (slice(1, 2), ..., 0),
]


@pytest.mark.parametrize("index", INDEXES, ids=repr)
def test_disk_getitem_matches_numpy_and_reads_only_its_range(cube, disk, index):
    check_index(*cube, index, disk)


def test_leading_axis_slices_are_exact_disk_sub_buffers(cube, disk):
    t, a = cube
    before = disk.reads
    for idx in (2, slice(1, 3), (1, 2), (slice(1, 3), slice(None)), (3, slice(None), slice(None))):
        r = t[idx]
        assert r.device == "disk" and r.cls.buffer.nbytes == a[idx].nbytes
    assert disk.reads == before
    row = t[1:3][1]  # slicing a slice stays on disk
    assert row.device == "disk"
    same_bytes(row.numpy(), a[2])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_disk_getitem_random_basic_indexes(cube, disk, data):
    t, a = cube
    index = []
    for size in a.shape:
        if data.draw(st.booleans()):
            index.append(None)
        if data.draw(st.booleans()):
            index.append(data.draw(st.integers(-size, size - 1)))
        else:
            bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
            step = data.draw(st.one_of(st.none(), st.integers(-3, 3).filter(lambda s: s != 0)))
            index.append(slice(data.draw(bound), data.draw(bound), step))
    check_index(t, a, tuple(index), disk)


def test_disk_getitem_tensor_indexes_and_errors(cube):
    t, a = cube
    np.testing.assert_array_equal(t[[0, 3]].numpy(), a[[0, 3]])
    np.testing.assert_array_equal(t[1, zyx.Tensor([4, 0, 2])].numpy(), a[1, [4, 0, 2]])
    np.testing.assert_array_equal(t[..., np.array([1, 1])].numpy(), a[..., [1, 1]])
    with pytest.raises(IndexError, match="out of bounds"):
        t[4]
    with pytest.raises(IndexError, match="out of bounds"):
        t[0, -6]
    with pytest.raises(IndexError, match="too many"):
        t[0, 0, 0, 0]
    with pytest.raises(IndexError, match="single ellipsis"):
        t[..., ...]
    with pytest.raises(ValueError, match="zero"):
        t[::0]
    with pytest.raises(IndexError):
        t[True]
    with pytest.raises(IndexError):
        t["a"]


def test_disk_getitem_bool_and_0d(tmp_path, rng):
    b = rng.integers(0, 2, (5, 7)).astype(bool)
    stn.save_file({"b": b, "s": np.array(7, np.int16)}, str(tmp_path / "b.safetensors"))
    d = zyx.load(tmp_path / "b.safetensors")
    same_bytes(d["b"][1:4, ::-2].numpy(), b[1:4, ::-2])
    same_bytes(d["s"][()].numpy(), np.array(7, np.int16))
    same_bytes(d["s"][None].numpy(), np.array([7], np.int16))


# ---------------------------------------------------------------------------------------------------------------
# bad files


def ok_header(**over) -> dict:
    h = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
         "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]}}
    h.update(over)
    return h


DATA = bytes(20)

BAD_FILES = [
    # (name, writer(path), message pattern, tensor named in the message or None)
    ("shorter than 8 bytes", lambda p: p.write_bytes(b"\x05\x00\x00"), "truncated", None),
    ("header length past the end", lambda p: write_raw(p, ok_header(), DATA, length=10_000), "runs past the end",
     None),
    ("header length over the limit", lambda p: write_raw(p, ok_header(), DATA, length=1 << 40), "limit", None),
    ("malformed JSON", lambda p: write_raw(p, b'{"a": {"dtype": ', DATA), "malformed JSON", None),
    ("not UTF-8", lambda p: write_raw(p, b'{"\xff": 1}', DATA), "UTF-8", None),
    ("header not an object", lambda p: write_raw(p, [1, 2], DATA), "JSON object", None),
    ("duplicate key", lambda p: write_raw(p, b'{"a": {}, "a": {}}', DATA), "twice", None),
    ("metadata not str->str", lambda p: write_raw(p, ok_header(__metadata__={"k": 1}), DATA), "__metadata__", None),
    ("entry not an object", lambda p: write_raw(p, ok_header(a=[1]), DATA), "must be an object", "a"),
    ("entry lacks keys", lambda p: write_raw(p, ok_header(a={"dtype": "F32"}), DATA), "lacks shape", "a"),
    ("unknown dtype", lambda p: write_raw(p, ok_header(b={"dtype": "Q7", "shape": [4], "data_offsets": [16, 20]}),
                                          DATA), "unknown dtype", "b"),
    ("dtype zyx lacks", lambda p: write_raw(p, ok_header(b={"dtype": "F8_E4M3", "shape": [4],
                                                            "data_offsets": [16, 20]}), DATA), "not supported", "b"),
    ("negative shape", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [-4],
                                                           "data_offsets": [16, 20]}), DATA), "non-negative", "b"),
    ("float shape", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [4.0],
                                                        "data_offsets": [16, 20]}), DATA), "non-negative", "b"),
    ("bool shape", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [True, 4],
                                                       "data_offsets": [16, 20]}), DATA), "integers", "b"),
    ("shape not a list", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": 4,
                                                             "data_offsets": [16, 20]}), DATA), "shape", "b"),
    ("offsets malformed", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [4],
                                                              "data_offsets": [16]}), DATA), "begin, end", "b"),
    ("offsets negative", lambda p: write_raw(p, ok_header(a={"dtype": "F32", "shape": [2, 2],
                                                             "data_offsets": [-4, 12]}), DATA), "non-negative",
     "a"),
    ("end before begin", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [0],
                                                             "data_offsets": [20, 16]}), DATA), "end before", "b"),
    ("offsets out of range", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [4],
                                                                 "data_offsets": [96, 100]}), DATA),
     "past the end of the data", "b"),
    ("data shorter than offsets", lambda p: write_raw(p, ok_header(), DATA[:18]), "truncated", "b"),
    ("overlapping offsets", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [4],
                                                                "data_offsets": [12, 16]}), DATA[:16]),
     "overlap", "b"),
    ("gap between tensors", lambda p: write_raw(p, ok_header(b={"dtype": "I8", "shape": [2],
                                                                "data_offsets": [18, 20]}), DATA), "gap", "b"),
    ("data past the tensors", lambda p: write_raw(p, ok_header(), DATA + b"xx"), "cover 20 bytes", None),
    ("size mismatch", lambda p: write_raw(p, ok_header(a={"dtype": "F32", "shape": [2, 3],
                                                          "data_offsets": [0, 16]}), DATA), "needs 24 bytes", "a"),
    ("size mismatch by dtype", lambda p: write_raw(p, ok_header(b={"dtype": "I16", "shape": [4],
                                                                   "data_offsets": [16, 20]}), DATA),
     "needs 8 bytes", "b"),
]


@pytest.mark.parametrize("name,make,match,tensor", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_safetensors_files(tmp_path, disk, name, make, match, tensor):
    path = tmp_path / "bad.safetensors"
    make(path)
    live = disk.live_buffers()
    with pytest.raises(ValueError, match=match) as e:
        zyx.load(path)
    msg = str(e.value)
    assert str(path) in msg
    if tensor is not None:
        assert f"tensor {tensor!r}" in msg
    assert disk.live_buffers() == live  # nothing half-made is left behind
    if name not in ("shorter than 8 bytes",):
        with pytest.raises(ValueError):
            zio.load_metadata(path) if "metadata" in name or "JSON" in name else zyx.load(path)


def test_good_header_written_by_hand_loads(tmp_path):
    data = np.arange(4, dtype=np.float32).tobytes() + bytes([1, 2, 3, 4])
    d = zyx.load(write_raw(tmp_path / "ok.safetensors", ok_header(), data))
    same_bytes(d["a"].numpy(), np.arange(4, dtype=np.float32).reshape(2, 2))
    same_bytes(d["b"].numpy(), np.array([1, 2, 3, 4], np.int8))
    # empty tensors may share an offset, in any order in the header
    h = {"e1": {"dtype": "F64", "shape": [0], "data_offsets": [0, 0]}, "x": {"dtype": "U8", "shape": [2],
         "data_offsets": [0, 2]}, "e2": {"dtype": "I64", "shape": [3, 0], "data_offsets": [2, 2]}}
    d = zyx.load(write_raw(tmp_path / "empty.safetensors", h, b"\x01\x02"))
    assert d["e2"].shape == (3, 0) and d["e2"].numpy().size == 0
    same_bytes(d["x"].numpy(), np.array([1, 2], np.uint8))


# ---------------------------------------------------------------------------------------------------------------
# saving: validation and atomicity


def test_save_validates_arguments(tmp_path):
    p = tmp_path / "v.safetensors"
    with pytest.raises(TypeError, match="names must be str"):
        zyx.save(p, {1: zyx.ones(2)})
    with pytest.raises(TypeError, match="'w' must be a zyx.Tensor"):
        zyx.save(p, {"w": np.ones(2)})
    with pytest.raises(TypeError, match="reserved"):
        zyx.save(p, {"__metadata__": zyx.ones(2)})
    with pytest.raises(TypeError, match="metadata must map str to str"):
        zyx.save(p, {"w": zyx.ones(2)}, metadata={"k": 3})
    with pytest.raises(TypeError, match="metadata must be a dict"):
        zyx.save(p, {"w": zyx.ones(2)}, metadata=[("k", "v")])
    with pytest.raises(TypeError, match="pass a dict"):
        zyx.save(p, zyx.ones(2))
    with pytest.raises(TypeError, match="needs a dict"):
        zyx.save(p, [zyx.ones(2)])
    with pytest.raises(TypeError, match="holds one Tensor"):
        zyx.save(tmp_path / "v.npy", {"w": zyx.ones(2)})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zyx.save(tmp_path / "no" / "dir.safetensors", {"w": zyx.ones(2)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exists", [False, True])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_save_is_atomic(tmp_path, monkeypatch, exists, exc):
    path = tmp_path / "model.safetensors"
    if exists:
        zyx.save(path, {"old": zyx.arange(3)})
    previous = path.read_bytes() if exists else None
    real = zio._host_array
    calls = []

    def crash_on_second(t):
        calls.append(t)
        if len(calls) == 2:
            raise exc("disk on fire")
        return real(t)

    monkeypatch.setattr(zio, "_host_array", crash_on_second)
    with pytest.raises(exc, match="disk on fire"):
        zyx.save(path, {"a": zyx.ones(1000), "b": zyx.zeros(1000), "c": zyx.ones(3)})
    assert len(calls) == 2
    assert sorted(os.listdir(tmp_path)) == (["model.safetensors"] if exists else [])
    if exists:
        assert path.read_bytes() == previous
        np.testing.assert_array_equal(zyx.load(path)["old"].numpy(), np.arange(3))


def test_save_crash_in_fsync_or_rename_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    for target in ("fsync", "replace"):
        def boom(*a, **k):
            raise OSError("simulated I/O error")

        with monkeypatch.context() as m:
            m.setattr(zio.os, target, boom)
            with pytest.raises(OSError, match="simulated"):
                zyx.save(path, {"a": zyx.ones(4)})
        assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# memory: a 1 GiB file, one 16 MiB tensor reduced


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_one_gib_file_reduces_one_tensor_in_little_memory(tmp_path, rng):
    n_tensors, shape = 64, (4096, 1024)  # 64 x 16 MiB of float32
    nbytes = math.prod(shape) * 4
    header = {f"t{i:02d}": {"dtype": "F32", "shape": list(shape), "data_offsets": [i * nbytes, (i + 1) * nbytes]}
              for i in range(n_tensors)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    values = rng.standard_normal(shape).astype(np.float32)
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:  # sparse: zeros everywhere except tensor t17
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(data_start + n_tensors * nbytes)
        f.seek(data_start + 17 * nbytes)
        f.write(values.tobytes())
    assert os.path.getsize(path) > 1 << 30
    zyx.Tensor(np.zeros(shape, np.float32)).sum().item()  # compile the reduce before measuring
    before = rss_bytes()
    d = zyx.load(path)
    got = d["t17"].sum().item()
    zero = d["t40"][100:200].sum().item()
    growth = rss_bytes() - before
    np.testing.assert_allclose(got, values.astype(np.float64).sum(), rtol=1e-4, atol=1e-2)
    assert zero == 0.0
    print(f"RSS growth: {growth / 2**20:.1f} MiB")
    assert growth < 100 << 20, f"RSS grew by {growth / 2**20:.1f} MiB"
