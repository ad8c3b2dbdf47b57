"""The image condition kind (issue 37, section 5): a super-resolution stage conditioned on a low-resolution version
of its target, and the cascade `islands sample BASE --then SR`."""

import numpy as np
import pytest
import torch
from PIL import Image

from islands.cli import main
from islands.conditions import condition_kind, network_spec
from islands.conditions.image import LOW_RESOLUTION
from islands.config import validate
from islands.data import build_data
from islands.data.batch import Batch
from islands.data.sources import X
from islands.data.space import PIXELS
from islands.errors import ConfigError
from islands.generate import open_run
from islands.nets import build_network
from tests.conftest import tiny_unet_config, write_config


def sr_config(run_dir, data_path, **sections) -> dict:
    """A tiny U-Net that refines 4x4 versions of the 8x8 images of `image_npz` (classes ignored)."""
    cfg = tiny_unet_config(run_dir, data_path, **sections)
    cfg["data"]["condition_resolution"] = 4
    cfg["model"] = {**cfg["model"], "num_classes": 0, "condition": "image"}
    cfg["train"]["label_dropout"] = 0.2
    return cfg


def test_the_condition_is_the_example_averaged_over_cells_and_flips_with_it(image_npz):
    cfg = validate(sr_config("unused", image_npz))
    source = condition_kind(cfg.model).source(cfg, None, build_data(cfg.data, cfg.seed))
    got = source.read([0, 5, 9], (X, LOW_RESOLUTION))
    x = got[X]
    cells = x.reshape(3, 1, 4, 2, 4, 2).mean(dim=(3, 5))  # each 2x2 cell's mean, by hand
    torch.testing.assert_close(got[LOW_RESOLUTION], cells)
    assert set(source.read([1], (LOW_RESOLUTION,))) == {LOW_RESOLUTION}  # the image it is made from is not handed on
    flip = torch.tensor([True, False, True])
    encoded = PIXELS.encode(Batch(x, got[LOW_RESOLUTION], torch.arange(3), flip=flip))
    flipped = torch.where(flip.reshape(-1, 1, 1, 1), x.flip(-1), x)
    torch.testing.assert_close(encoded.x, flipped)
    torch.testing.assert_close(encoded.condition, flipped.reshape(3, 1, 4, 2, 4, 2).mean(dim=(3, 5)))


def test_the_network_reads_the_upsampled_condition_and_none_is_zeros(image_npz):
    cfg = validate(sr_config("unused", image_npz))
    torch.manual_seed(0)
    net = build_network(network_spec(cfg.model, (1, 8, 8))).eval()
    torch.nn.init.normal_(net.conv_out.weight)  # zero-initialised: the output would not depend on anything
    assert net.conv_in.in_channels == 2  # the noisy example's channel and the condition's
    x, t, low = torch.randn(2, 1, 8, 8), torch.rand(2), torch.randn(2, 1, 4, 4)
    with torch.no_grad():
        given, none, zeros = net(x, t, low), net(x, t, None), net(x, t, torch.zeros_like(low))
    assert not torch.allclose(given, none)
    torch.testing.assert_close(none, zeros)  # guidance's unconditional branch: no image at all
    dropped = net.condition.drop(low, torch.tensor([True, False]))
    assert torch.equal(dropped[0], torch.zeros_like(low[0])) and torch.equal(dropped[1], low[1])


def test_a_super_resolution_run_trains_resumes_and_samples_for_images_and_after_a_base_run(tmp_path, image_npz):
    base = tiny_unet_config(tmp_path / "base", image_npz, data={"resolution": 4},
                            model={"attention_resolutions": []})
    sr = sr_config(tmp_path / "sr", image_npz)
    assert main(["train", write_config(tmp_path / "base.yaml", base), "--quiet"]) == 0
    assert main(["train", write_config(tmp_path / "sr.yaml", sr), "train.images=48", "--quiet"]) == 0
    assert main(["train", str(tmp_path / "sr.yaml"), "--quiet"]) == 0  # resumed at 48 images
    assert main(["train", write_config(tmp_path / "straight.yaml", {**sr, "run_dir": str(tmp_path / "straight")}),
                 "--quiet"]) == 0
    resumed, straight = (open_run(tmp_path / run).denoiser.net.state_dict() for run in ("sr", "straight"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)

    # the cascade: the base run's samples are the super-resolution run's condition images
    assert main(["sample", str(tmp_path / "base"), "--num", "6", "--out", str(tmp_path / "cascade"), "--then",
                 str(tmp_path / "sr"), "--quiet"]) == 0
    low = open_run(tmp_path / "base").generate(6, torch.arange(6) % 4)
    refined = open_run(tmp_path / "sr")
    expected = refined.generate(6, low, seed=3)
    cascade = np.load(tmp_path / "cascade" / "samples.npz")["x"]
    assert cascade.shape == (6, 1, 8, 8)
    np.testing.assert_allclose(cascade, expected.clamp(-1, 1).numpy(), atol=1e-6)  # written as images are

    # condition images from a folder, taken in turn, as the data's images are read
    folder = tmp_path / "lows"
    folder.mkdir()
    pixels = ((low.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    for i in range(2):
        Image.fromarray(pixels[i, 0]).save(folder / f"{i}.png")
    assert main(["sample", str(tmp_path / "sr"), "--num", "4", "--out", str(tmp_path / "from_files"),
                 "--condition-image", str(folder), "--quiet"]) == 0
    from_files = np.load(tmp_path / "from_files" / "samples.npz")["x"]
    read_back = torch.from_numpy(pixels[:2]).float() / 127.5 - 1
    expected = refined.generate(4, read_back[[0, 1, 0, 1]], seed=3).clamp(-1, 1)
    np.testing.assert_allclose(from_files, expected.numpy(), atol=1e-6)


@pytest.mark.parametrize("change,message", [
    ({"data": {"condition_resolution": None}}, "data.condition_resolution: model.condition image needs"),
    ({"model": {"arch": "mlp"}}, "model.condition: image is read by unet and dit networks, not 'mlp'"),
    ({"model": {"num_classes": 4}}, "model.condition: 'image' with model.num_classes=4"),
])
def test_an_image_condition_the_config_cannot_take_is_refused_by_key(tmp_path, image_npz, change, message):
    cfg = sr_config(tmp_path / "r", image_npz)
    for section, values in change.items():
        cfg[section] = {**cfg[section], **values}
        if cfg["model"]["arch"] == "mlp":
            cfg["model"] = {"arch": "mlp", "condition": "image"}
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_requests_of_another_kind_and_a_side_the_data_lacks_are_one_line(tmp_path, image_npz, capsys):
    sr = sr_config(tmp_path / "sr", image_npz, train={"images": 16, "batch_size": 8, "accumulate": 1,
                                                      "checkpoint_every": 16, "sample_every": 16})
    assert main(["train", write_config(tmp_path / "sr.yaml", sr), "--quiet"]) == 0
    capsys.readouterr()
    for args, said in [(["--prompt", "a shoe"], "--prompt: "), (["--class", "1"], "--class: "),
                       (["--condition-image", str(tmp_path / "nowhere")], "--condition-image: ")]:
        assert main(["sample", str(tmp_path / "sr"), "--num", "2", "--out", str(tmp_path / "s"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"islands: config error: {said}") and err.count("\n") == 1, err
    assert main(["export", str(tmp_path / "sr"), str(tmp_path / "exported")]) == 2
    assert "no diffusers pipeline" in capsys.readouterr().err and not (tmp_path / "exported").exists()
    fine = sr_config(tmp_path / "fine", image_npz)
    fine["data"]["condition_resolution"] = 8
    too_fine = write_config(tmp_path / "fine.yaml", fine)
    assert main(["train", too_fine, "--quiet"]) == 2
    assert "data.condition_resolution: 8 is not below the data's 8x8 images" in capsys.readouterr().err
