"""Checkpoint readers and the safetensors writer (sdlite.weights.io)."""

from __future__ import annotations

import builtins
import collections
import gc
import json
import os
import pickle
import struct
import subprocess
import sys
import types

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

from sdlite.errors import CheckpointError, SDLiteError
from sdlite.weights.io import open_checkpoint, open_sharded
from sdlite.weights.safetensors import save_safetensors
from sdlite.weights.store import MissingTensorError, TensorStore, merge_stores

MiB = 1024 * 1024


def _sample(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "unet.conv_in.weight": torch.randn(8, 4, 3, 3, generator=g).to(dtype),
        "unet.conv_in.bias": torch.randn(8, generator=g).to(dtype),
        "odd": torch.randn(3, generator=g).to(dtype),  # odd byte count for 16-bit types
        "scalar": torch.tensor(0.5).to(dtype),
        "empty": torch.zeros(0, 5, dtype=dtype),
    }


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


# ---------------------------------------------------------------------------------------------
# safetensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_safetensors_round_trip(tmp_path, dtype):
    tensors = _sample(dtype)
    tensors["text.position_ids"] = torch.arange(77, dtype=torch.int64)[None]
    tensors["mask"] = torch.tensor([True, False, True])
    tensors["bytes"] = torch.arange(7, dtype=torch.uint8)
    tensors["i32"] = torch.tensor([-1, 2], dtype=torch.int32)
    path = tmp_path / "model.safetensors"
    save_safetensors(tensors, path, metadata={"format": "pt", "note": "x"})

    with open_checkpoint(path) as store:
        assert store.format == "safetensors"
        assert store.path == str(path)
        assert store.metadata == {"format": "pt", "note": "x"}
        assert set(store.keys()) == set(tensors)
        for key, ref in tensors.items():
            assert store.shape(key) == ref.shape
            assert store.dtype(key) == ref.dtype
            assert store.nbytes(key) == ref.numel() * ref.element_size()
            got = store[key]
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(got, ref), key

    # the reference implementation reads what we wrote ...
    other = st_load_file(str(path))
    assert set(other) == set(tensors)
    for key, ref in tensors.items():
        assert torch.equal(other[key], ref)
    # ... and we read what it writes
    path2 = tmp_path / "theirs.safetensors"
    st_save_file({k: v.contiguous() for k, v in tensors.items()}, str(path2), metadata={"a": "b"})
    with open_checkpoint(path2) as store:
        assert store.metadata == {"a": "b"}
        for key, ref in tensors.items():
            assert torch.equal(store[key], ref)


def test_writer_makes_non_contiguous_tensors_contiguous(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = tmp_path / "t.safetensors"
    save_safetensors({"t": base.t(), "s": base[:, 1], "base": base}, path)
    with open_checkpoint(path) as store:
        assert torch.equal(store["t"], base.t())
        assert torch.equal(store["s"], base[:, 1])
        assert store["t"].is_contiguous()


def test_store_api_conversion_and_errors(tmp_path):
    tensors = _sample(torch.float32)
    path = tmp_path / "m.safetensors"
    save_safetensors(tensors, path)
    store = open_checkpoint(path)
    assert isinstance(store, TensorStore)
    assert len(store) == len(tensors) and "odd" in store and "nope" not in store
    key = "unet.conv_in.weight"

    half = store.load(key, dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, tensors[key].half())
    assert store.get(key, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert store.get("nope") is None and store.get("nope", 7) == 7
    assert torch.equal(store.load(key, device="cpu"), tensors[key])

    with pytest.raises(MissingTensorError) as err:
        store["nope"]
    assert isinstance(err.value, KeyError) and isinstance(err.value, CheckpointError)
    assert str(path) in str(err.value) and "'nope'" in str(err.value)
    with pytest.raises(KeyError):
        store.shape("nope")

    # returned tensors are copy-on-write views: writing to them never touches the file
    t = store[key]
    t.fill_(123.0)
    with open_checkpoint(path) as again:
        assert torch.equal(again[key], tensors[key])

    kept = store["odd"]
    store.close()
    assert store.closed
    assert torch.equal(kept, tensors["odd"])  # still valid after close
    assert store.shape(key) == tensors[key].shape  # metadata stays available
    with pytest.raises(CheckpointError, match="closed"):
        store[key]


def _write_big_safetensors(path, n_tensors: int, tensor_mib: int) -> int:
    """A safetensors file of n_tensors x tensor_mib MiB (written in chunks: no big allocation)."""
    numel = tensor_mib * MiB // 4
    header, offset = {}, 0
    for i in range(n_tensors):
        header[f"block.{i}.weight"] = {"dtype": "F32", "shape": [numel], "data_offsets": [offset, offset + numel * 4]}
        offset += numel * 4
    header["tiny"] = {"dtype": "F32", "shape": [4], "data_offsets": [offset, offset + 16]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    chunk = np.arange(MiB // 4, dtype=np.float32).tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _ in range(n_tensors * tensor_mib):
            f.write(chunk)
        f.write(np.array([1, 2, 3, 4], dtype=np.float32).tobytes())
    return os.path.getsize(path)


def test_safetensors_open_reads_only_the_header(tmp_path):
    path = tmp_path / "big.safetensors"
    size = _write_big_safetensors(path, n_tensors=8, tensor_mib=32)  # 256 MiB
    before = _rss()
    store = open_checkpoint(path)
    shapes = {k: store.shape(k) for k in store}
    dtypes = {k: store.dtype(k) for k in store}
    tiny = store["tiny"]
    one = store["block.3.weight"]  # a view: still nothing read
    grown = _rss() - before
    assert len(shapes) == 9 and dtypes["block.0.weight"] == torch.float32
    assert shapes["block.0.weight"] == (8 * MiB,)
    assert tiny.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert one.shape == (8 * MiB,)
    assert grown < size / 10, f"RSS grew by {grown / MiB:.1f} MiB opening a {size / MiB:.0f} MiB file"
    del tiny, one
    store.close()


def test_torch_zip_open_is_lazy(tmp_path):
    path = tmp_path / "big.ckpt"
    big = torch.zeros(64 * MiB, dtype=torch.float32)  # 256 MiB
    torch.save({"state_dict": {"big": big, "tiny": torch.arange(4.0)}}, path)
    del big
    before = _rss()
    store = open_checkpoint(path)
    assert store.shape("big") == (64 * MiB,) and store.dtype("big") == torch.float32
    assert store["tiny"].tolist() == [0.0, 1.0, 2.0, 3.0]
    view = store["big"]
    grown = _rss() - before
    assert grown < os.path.getsize(path) / 10, f"RSS grew by {grown / MiB:.1f} MiB"
    assert float(view[-1]) == 0.0
    del view
    store.close()


# ---------------------------------------------------------------------------------------------
# torch checkpoints


class _InstallFakeLightning:
    """Puts a module named pytorch_lightning.callbacks.model_checkpoint into sys.modules."""

    def __init__(self, monkeypatch):
        names = ["pytorch_lightning", "pytorch_lightning.callbacks", "pytorch_lightning.callbacks.model_checkpoint"]
        mods = [types.ModuleType(n) for n in names]
        mods[0].callbacks = mods[1]
        mods[1].model_checkpoint = mods[2]
        self.calls: list[str] = []
        calls = self.calls

        class ModelCheckpoint:
            def __init__(self, monitor=None):
                self.monitor = monitor
                self.best_model_score = None

            def __setstate__(self, state):  # must never run while sdlite reads the file
                calls.append("setstate")
                self.__dict__.update(state)

        ModelCheckpoint.__module__ = names[2]
        ModelCheckpoint.__qualname__ = "ModelCheckpoint"
        mods[2].ModelCheckpoint = ModelCheckpoint
        self.ModelCheckpoint = ModelCheckpoint
        for name, mod in zip(names, mods):
            monkeypatch.setitem(sys.modules, name, mod)


def test_torch_zip_lightning_checkpoint(tmp_path, monkeypatch):
    fake = _InstallFakeLightning(monkeypatch)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 4, generator=g)
    state_dict = collections.OrderedDict(
        [
            ("model.diffusion_model.in.weight", torch.randn(4, 4, generator=g)),
            ("model.q", qkv[0:2]),  # views sharing one storage, with offsets
            ("model.k", qkv[2:4]),
            ("model.v_t", qkv[4:6].t()),  # non-contiguous view
            ("model.qkv", qkv),
            ("model.half", torch.randn(5, generator=g).half()),
            ("model.bf16", torch.randn(3, generator=g).bfloat16()),
            ("cond_stage_model.transformer.text_model.embeddings.position_ids", torch.arange(77)[None]),
            ("model_ema.decay", torch.tensor(0.9999)),
            ("model_ema.num_updates", torch.tensor(470000, dtype=torch.int32)),
            ("model_ema.diffusion_modelinweight", torch.randn(4, 4, generator=g)),
            ("param", torch.nn.Parameter(torch.ones(2))),
        ]
    )
    ckpt = {
        "epoch": 6,
        "global_step": 470000,
        "pytorch-lightning_version": "1.4.2",
        "state_dict": state_dict,
        "callbacks": {fake.ModelCheckpoint: {"best_model_score": None}, "instance": fake.ModelCheckpoint("val/loss")},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": 1e-4}]}],
        "lr_schedulers": [{"base_lrs": [1e-4], "last_epoch": 3}],
        "numpy_score": np.float64(0.25),
        "numpy_array": np.arange(3),
    }
    path = tmp_path / "sd-v1.ckpt"
    torch.save(ckpt, path)
    listing = sorted(os.listdir(tmp_path))

    with open_checkpoint(path) as store:
        assert store.format == "ckpt" and store.container == "torch-zip"
        assert list(store) == list(state_dict)  # optimizer tensors etc. are not included
        for key, ref in state_dict.items():
            got = store[key]
            assert got.dtype == ref.dtype and got.shape == ref.shape, key
            assert got.stride() == ref.stride(), key
            assert torch.equal(got, ref.detach()), key
        assert store.dtype("model.half") == torch.float16
        assert store.dtype("cond_stage_model.transformer.text_model.embeddings.position_ids") == torch.int64
        # views of one storage share memory, as in the file
        assert store["model.k"].data_ptr() == store["model.qkv"].data_ptr() + 8 * 4
        assert store["model.q"].untyped_storage().data_ptr() == store["model.v_t"].untyped_storage().data_ptr()
        assert store.metadata["global_step"] == "470000"
        assert store.metadata["epoch"] == "6"
        assert store.metadata["pytorch-lightning_version"] == "1.4.2"
        assert store.metadata["numpy_score"] == "0.25"
        assert "state_dict" not in store.metadata and "callbacks" not in store.metadata
    assert fake.calls == []  # the real class was never touched
    assert sorted(os.listdir(tmp_path)) == listing  # nothing written next to the checkpoint


def test_bin_format_and_flat_state_dict(tmp_path):
    sd = {"a.weight": torch.randn(3, 2), "a.bias": torch.zeros(3, dtype=torch.float16), "note": "text", "n": 3}
    path = tmp_path / "diffusion_pytorch_model.bin"
    torch.save(sd, path)
    with open_checkpoint(path) as store:
        assert store.format == "bin"
        assert sorted(store) == ["a.bias", "a.weight"]
        assert store.metadata == {"note": "text", "n": "3"}
        assert torch.equal(store["a.weight"], sd["a.weight"])


def test_nested_dicts_are_flattened(tmp_path):
    emb = torch.randn(2, 8)
    pd = torch.nn.ParameterDict({"*": torch.nn.Parameter(emb.clone())})
    path = tmp_path / "embedding.pt"
    torch.save({"string_to_token": {"*": 265}, "string_to_param": pd, "name": "x", "step": 10}, path)
    with open_checkpoint(path) as store:
        assert list(store) == ["string_to_param.*"]
        assert torch.equal(store["string_to_param.*"], emb)
        assert store.metadata == {"name": "x", "step": "10"}


def test_legacy_torch_format(tmp_path):
    base = torch.arange(10, dtype=torch.float32)
    sd = {"w": base, "view": base[3:7].view(2, 2), "h": torch.ones(3, dtype=torch.float16)}
    path = tmp_path / "old.pt"
    torch.save({"state_dict": sd, "global_step": 3}, path, _use_new_zipfile_serialization=False)
    with open_checkpoint(path) as store:
        assert store.container == "torch-legacy"
        assert store.metadata == {"global_step": "3"}
        for key, ref in sd.items():
            assert torch.equal(store[key], ref), key
        assert store["view"].data_ptr() == store["w"].data_ptr() + 3 * 4


def test_plain_pickle_of_tensors(tmp_path):
    sd = {"w": torch.randn(3, 3), "h": torch.ones(2, dtype=torch.bfloat16)}
    path = tmp_path / "plain.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": sd}, protocol=4))
    with open_checkpoint(path) as store:
        assert store.container == "pickle"
        for key, ref in sd.items():
            assert torch.equal(store[key], ref)


def test_content_not_extension_decides_the_format(tmp_path):
    t = {"x": torch.arange(3.0)}
    st_as_ckpt = tmp_path / "really_safetensors.ckpt"
    save_safetensors(t, st_as_ckpt)
    zip_as_st = tmp_path / "really_torch.safetensors"
    torch.save(t, zip_as_st)
    with open_checkpoint(st_as_ckpt) as a, open_checkpoint(zip_as_st) as b:
        assert a.format == "safetensors" and b.container == "torch-zip"
        assert torch.equal(a["x"], b["x"])


# ---------------------------------------------------------------------------------------------
# malicious pickles


def _marker_command(marker):
    return f"touch {marker}"


class _Evil:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker):
    return [
        (os.system, (_marker_command(marker),), f"{os.system.__module__}.system"),
        (subprocess.Popen, (["touch", str(marker)],), "subprocess.Popen"),
        (builtins.eval, (f"open({str(marker)!r}, 'w')",), "builtins.eval"),
        (builtins.exec, (f"open({str(marker)!r}, 'w')",), "builtins.exec"),
    ]


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("layout", ["torch-zip", "torch-legacy", "plain-pickle"])
def test_malicious_pickle_is_refused_without_running(tmp_path, index, layout):
    marker = tmp_path / "PWNED"
    func, args, global_name = _payloads(marker)[index]
    payload = {"state_dict": {"w": torch.zeros(2)}, "evil": _Evil(func, args)}
    path = tmp_path / "evil.ckpt"
    if layout == "torch-zip":
        torch.save(payload, path)
    elif layout == "torch-legacy":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    message = str(err.value)
    assert str(path) in message
    assert global_name in message, message
    assert "refused" in message
    assert not marker.exists()
    if func is os.system:
        assert "posix.system" in message or "nt.system" in message


def test_handwritten_global_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "p0.ckpt"
    # GLOBAL 'os system', MARK, BINUNICODE command, TUPLE, REDUCE, STOP
    path.write_bytes(b"\x80\x02cos\nsystem\n(X" + struct.pack("<I", len(_marker_command(marker))) + _marker_command(marker).encode() + b"tR.")
    with pytest.raises(CheckpointError, match=r"os\.system"):
        open_checkpoint(path)
    assert not marker.exists()


def test_stand_in_lightning_class_is_not_imported(tmp_path):
    # a checkpoint whose callbacks dict is keyed by the ModelCheckpoint class (as in the SD 1.x
    # release checkpoints) loads without importing pytorch_lightning
    had_lightning = "pytorch_lightning" in sys.modules
    payload = (
        b"\x80\x02}(X\x0a\x00\x00\x00state_dict}X\x09\x00\x00\x00callbacks}"
        b"cpytorch_lightning.callbacks.model_checkpoint\nModelCheckpoint\n}su."
    )
    path = tmp_path / "cb.ckpt"
    path.write_bytes(payload)
    with open_checkpoint(path) as store:
        assert len(store) == 0
    assert ("pytorch_lightning" in sys.modules) == had_lightning


# ---------------------------------------------------------------------------------------------
# damaged and wrong files


def test_truncated_safetensors_names_first_key_out_of_bounds(tmp_path):
    tensors = {f"layer.{i}.weight": torch.full((256,), float(i)) for i in range(6)}
    path = tmp_path / "cut.safetensors"
    save_safetensors(tensors, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    data_len = len(data) // 2 - 8 - header_len
    first_bad = min((v["data_offsets"][0], k) for k, v in header.items() if v["data_offsets"][1] > data_len)[1]

    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(path) in str(err.value)
    assert repr(first_bad) in str(err.value)
    assert err.value.key == first_bad
    assert "truncated" in str(err.value)


def test_safetensors_cut_inside_header(tmp_path):
    path = tmp_path / "m.safetensors"
    save_safetensors({"a": torch.zeros(4)}, path)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="header length") as err:
        open_checkpoint(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "header, expect",
    [
        (b"{not json at all", "not valid JSON"),
        (b"[1, 2, 3]", "not a valid safetensors file"),
        (b'{"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}', "unsupported dtype 'F33'"),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', "needs 8"),
        (b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "non-negative"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', "byte range"),
    ],
)
def test_bad_safetensors_header(tmp_path, header, expect):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert expect in str(err.value)
    assert str(path) in str(err.value)


def test_truncated_torch_zip(tmp_path):
    path = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.randn(1000)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as err:
        open_checkpoint(path)
    assert str(path) in str(err.value)


def test_torch_zip_missing_storage_record(tmp_path):
    import zipfile

    src = tmp_path / "src.ckpt"
    torch.save({"w": torch.randn(10)}, src)
    dst = tmp_path / "broken.ckpt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if "/data/" not in info.filename:
                zout.writestr(info, zin.read(info))
    with pytest.raises(CheckpointError, match="missing from the archive") as err:
        open_checkpoint(dst)
    assert str(dst) in str(err.value)


@pytest.mark.parametrize("name", ["garbage.ckpt", "garbage.safetensors", "garbage.bin"])
def test_garbage_file(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(bytes(range(7, 255)) * 40)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(path) in str(err.value)
    assert "not" in str(err.value)


def test_missing_directory_and_empty_paths(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointError, match="no such file") as err:
        open_checkpoint(missing)
    assert str(missing) in str(err.value)

    with pytest.raises(CheckpointError, match="directory") as err:
        open_checkpoint(tmp_path)
    assert str(tmp_path) in str(err.value)

    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty") as err:
        open_checkpoint(empty)
    assert str(empty) in str(err.value)
    assert isinstance(err.value, SDLiteError)


def test_top_level_must_be_a_dict(tmp_path):
    path = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), path)
    with pytest.raises(CheckpointError, match="single tensor"):
        open_checkpoint(path)


# ---------------------------------------------------------------------------------------------
# writer


def test_writer_refuses_to_overwrite(tmp_path):
    path = tmp_path / "out.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match="overwrite") as err:
        save_safetensors({"a": torch.zeros(2)}, path)
    assert str(path) in str(err.value)
    assert path.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]  # no temp file left behind

    save_safetensors({"a": torch.ones(2)}, path, overwrite=True)
    with open_checkpoint(path) as store:
        assert torch.equal(store["a"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]


def test_writer_rejects_bad_input_without_leaving_files(tmp_path):
    path = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match="'b'"):
        save_safetensors({"a": torch.zeros(1), "b": [1, 2]}, path)
    with pytest.raises(CheckpointError, match="not a str"):
        save_safetensors({"a": torch.zeros(1)}, path, metadata={"step": 3})
    with pytest.raises(CheckpointError, match="does not exist"):
        save_safetensors({"a": torch.zeros(1)}, tmp_path / "no" / "x.safetensors")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# several files


def test_merge_and_sharded_index(tmp_path):
    a = {"x.weight": torch.randn(2, 2)}
    b = {"y.weight": torch.randn(3).half()}
    save_safetensors(a, tmp_path / "model-00001-of-00002.safetensors")
    torch.save(b, tmp_path / "model-00002-of-00002.bin")
    index = {
        "metadata": {},
        "weight_map": {"x.weight": "model-00001-of-00002.safetensors", "y.weight": "model-00002-of-00002.bin"},
    }
    (tmp_path / "model.index.json").write_text(json.dumps(index))
    with open_sharded(tmp_path / "model.index.json") as store:
        assert sorted(store) == ["x.weight", "y.weight"]
        assert store.format == "mixed" and len(store.paths) == 2
        assert torch.equal(store["y.weight"], b["y.weight"])
        assert torch.equal(store.load("x.weight", dtype=torch.float16), a["x.weight"].half())

    one = open_checkpoint(tmp_path / "model-00001-of-00002.safetensors")
    two = open_checkpoint(tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="also present") as err:
        merge_stores([one, two])
    assert err.value.key == "x.weight"
    one.close()
    two.close()

    index["weight_map"]["z.weight"] = "model-00002-of-00002.bin"
    (tmp_path / "bad.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing from this shard") as err:
        open_sharded(tmp_path / "bad.index.json")
    assert err.value.key == "z.weight"
