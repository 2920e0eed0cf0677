"""Bad input gets one clear message naming the file and the key/shape/value at fault; nothing is written
next to the user's checkpoint. Also: legacy .ckpt single files, and how eps vs v-prediction is decided."""
from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save_file as _save_file

from sdlite.cli import main
from sdlite.errors import CheckpointError
from sdlite.export import save_single_file
from sdlite.loader import load_model, open_model, resolve_prediction_type
from tests.reference import diffusers_pipeline
from tests.test_loading import assert_same_outputs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny SD 1.x model as a diffusers folder and as our original-layout single file."""
    tmp = tmp_path_factory.mktemp("exported")
    pipe = diffusers_pipeline("sd1", tmp)
    pipe.save_pretrained(tmp / "model")
    path = save_single_file(load_model(tmp / "model"), tmp / "model.safetensors")
    return pipe, path


def save_file(tensors, dest, like=None, drop=()):
    """Save ``tensors``, keeping the metadata of the file ``like`` except the keys in ``drop``."""
    metadata = None
    if like is not None:
        with safe_open(like, "pt") as f:
            metadata = {k: v for k, v in (f.metadata() or {}).items() if k not in drop}
    _save_file(tensors, dest, metadata=metadata)


def _cli_error(path, capsys) -> str:
    """Run ``sdlite info PATH``: exit code 2, one line on stderr, no traceback, nothing new beside the file."""
    folder = os.path.dirname(os.path.abspath(path))
    before = sorted(os.listdir(folder))
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdlite: error: ") and "Traceback" not in err and err.count("\n") == 1
    assert sorted(os.listdir(folder)) == before
    return err


def test_missing_path(tmp_path, capsys):
    err = _cli_error(tmp_path / "nope.safetensors", capsys)
    assert "nope.safetensors: no such file or folder" in err


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.ckpt").write_text("these are my notes, not weights\n")
    err = _cli_error(tmp_path / "notes.ckpt", capsys)
    assert "notes.ckpt" in err and "not a checkpoint format" in err


def test_folder_without_model_index(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    err = _cli_error(tmp_path / "empty", capsys)
    assert "model_index.json is missing" in err


def test_truncated_safetensors(exported, tmp_path, capsys):
    _, path = exported
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    err = _cli_error(tmp_path / "cut.safetensors", capsys)
    assert "cut.safetensors" in err and "truncated" in err.lower()
    assert "model.diffusion_model." in err or "first_stage_model." in err or "cond_stage_model." in err


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_ckpt_that_asks_to_run_code(tmp_path, capsys):
    payload = _Payload()
    payload.marker = str(tmp_path / "PWNED")
    torch.save({"state_dict": {"model.diffusion_model.conv_in.weight": torch.zeros(1)}, "evil": payload},
               tmp_path / "evil.ckpt")
    err = _cli_error(tmp_path / "evil.ckpt", capsys)
    assert "evil.ckpt" in err and "system" in err and "refused" in err
    assert not (tmp_path / "PWNED").exists()


def test_shape_that_does_not_match_the_family(exported, tmp_path, capsys):
    _, path = exported
    tensors = load_file(path)
    key = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"
    tensors[key] = tensors[key][:, :, :1, :1].contiguous()  # a 1x1 kernel where the UNet has 3x3
    save_file(tensors, tmp_path / "bad_shape.safetensors", like=path)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "bad_shape.safetensors")
    msg = str(e.value)
    assert "bad_shape.safetensors" in msg and key in msg and "[32, 32, 1, 1]" in msg and "[32, 32, 3, 3]" in msg
    info = main(["info", str(tmp_path / "bad_shape.safetensors")])  # info lists it instead of failing
    out = capsys.readouterr().out
    assert info == 0 and key in out


def test_missing_keys(exported, tmp_path):
    _, path = exported
    tensors = load_file(path)
    gone = [k for k in tensors if k.startswith("first_stage_model.decoder.up.")][:7]
    for k in gone:
        del tensors[k]
    save_file(tensors, tmp_path / "partial.safetensors", like=path)
    ckpt = open_model(tmp_path / "partial.safetensors")
    ckpt.load("unet")  # the intact parts still load
    with pytest.raises(CheckpointError, match=r"partial\.safetensors: 7 vae keys are missing, first few: 'decoder\."):
        ckpt.load("vae")


def test_unknown_layout(tmp_path, capsys):
    save_file({"layer1.weight": torch.zeros(4, 4), "layer2.bias": torch.zeros(4)}, tmp_path / "mlp.safetensors")
    err = _cli_error(tmp_path / "mlp.safetensors", capsys)
    assert "mlp.safetensors" in err and "layer1.weight" in err


def test_sdxl_is_refused_by_name(tmp_path, capsys):
    save_file({"conditioner.embedders.1.model.ln_final.weight": torch.zeros(4),
               "model.diffusion_model.label_emb.0.0.weight": torch.zeros(4, 4),
               "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(320, 4, 3, 3)},
              tmp_path / "xl.safetensors")
    err = _cli_error(tmp_path / "xl.safetensors", capsys)
    assert "SDXL" in err


def test_legacy_ckpt_with_nesting_ema_and_buffers(tmp_path):
    """A Lightning-style .ckpt: ``state_dict`` nesting, EMA copies, schedule buffers, a global step."""
    pipe = diffusers_pipeline("sd1", tmp_path, conventional=True)
    pipe.save_pretrained(tmp_path / "model")
    tensors = load_file(save_single_file(load_model(tmp_path / "model"), tmp_path / "model.safetensors"))
    state = dict(tensors)
    state["betas"] = torch.linspace(1e-4, 2e-2, 1000)
    state["alphas_cumprod"] = torch.cumprod(1 - state["betas"], 0)
    for k, v in list(tensors.items()):
        if k.startswith("model.diffusion_model."):
            state["model_ema." + k[len("model."):].replace(".", "")] = v + 1  # EMA copies differ
    state["model_ema.decay"] = torch.tensor(0.9999)
    torch.save({"state_dict": state, "global_step": 840000, "epoch": 6}, tmp_path / "legacy.ckpt")
    ours = load_model(tmp_path / "legacy.ckpt")
    assert ours.checkpoint.layout == "original" and ours.spec.family == "sd1"
    assert ours.checkpoint.detection.has_ema
    assert_same_outputs(ours, pipe)  # the non-EMA weights are the ones used


def _strip_metadata(path, dest):
    # same tensors and configs, but nothing in the file says eps or v
    save_file(load_file(path), dest, like=path, drop=("modelspec.prediction_type",))
    return dest


@pytest.fixture(scope="module")
def sd2_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd2")
    pipe = diffusers_pipeline("sd2", tmp)
    pipe.save_pretrained(tmp / "model")
    return save_single_file(load_model(tmp / "model"), tmp / "sd2.safetensors")


def test_prediction_type_from_metadata_yaml_and_override(sd2_file, tmp_path):
    assert open_model(sd2_file).prediction_source.startswith("metadata")
    bare = _strip_metadata(sd2_file, tmp_path / "bare.safetensors")
    (tmp_path / "bare.yaml").write_text('model:\n  params:\n    parameterization: "v"\n')
    ckpt = open_model(bare)
    assert ckpt.spec.prediction_type == "v_prediction" and "bare.yaml" in ckpt.prediction_source
    ckpt = open_model(bare, prediction_type="epsilon")
    assert ckpt.spec.prediction_type == "epsilon" and ckpt.prediction_source == "given by the user"
    with pytest.raises(Exception, match="'vee' is not valid"):
        open_model(bare, prediction_type="vee")


@pytest.mark.parametrize("bias,expected", [(-5.0, "v_prediction"), (5.0, "epsilon")])
def test_prediction_type_probed_as_a1111_does(sd2_file, tmp_path, bias, expected):
    """With nothing in or beside the file, an SD 2.x UNet is probed: v-models answer far below the input."""
    tensors = load_file(sd2_file)
    tensors["model.diffusion_model.out.2.bias"] = torch.full_like(tensors["model.diffusion_model.out.2.bias"], bias)
    save_file(tensors, tmp_path / "probe.safetensors", like=sd2_file, drop=("modelspec.prediction_type",))
    ckpt = open_model(tmp_path / "probe.safetensors")
    assert ckpt.prediction_source == "unresolved"
    assert resolve_prediction_type(ckpt) == expected
    assert ckpt.prediction_source.startswith("probed")


def test_nothing_written_and_no_pickle_executed_for_plain_pickles(tmp_path):
    payload = _Payload()
    payload.marker = str(tmp_path / "PWNED2")
    with open(tmp_path / "plain.pt", "wb") as f:
        pickle.dump({"state_dict": payload}, f)
    with pytest.raises(CheckpointError, match="refused"):
        open_model(tmp_path / "plain.pt")
    assert not (tmp_path / "PWNED2").exists()
    assert zipfile.is_zipfile(tmp_path / "plain.pt") is False
