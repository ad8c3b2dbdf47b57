"""The bundled configs are valid, and the paper-scale presets have the papers' sizes."""

from pathlib import Path

import pytest
import torch

from islands.conditions import network_spec
from islands.config import load_config
from islands.nets import build_network

CONFIGS = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_bundled_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.run_dir.startswith("runs/")


def _parameters(cfg, shape, classes):
    with torch.device("meta"):
        net = build_network(network_spec(cfg.model, shape, classes))
    return sum(p.numel() for p in net.parameters())


def test_dit_xl2_preset_has_the_papers_675m_parameters():
    cfg = load_config("configs/dit_xl2_latents.yaml")
    assert _parameters(cfg, (4, 32, 32), 1000) == pytest.approx(675e6, rel=0.01)


def test_adm_imagenet64_preset_is_the_papers_296m_network_but_for_its_resampling_blocks():
    """Our U-Net resamples with a strided convolution down and nearest-neighbour up; ADM (resblock_updown) uses a
    residual block for each, has no "no label" row and learns its variance (6 output channels). Put those
    back, layer by layer, and the count is the paper's 296M."""
    from islands.nets.unet import Downsample

    cfg = load_config("configs/unet_adm_imagenet64.yaml")
    with torch.device("meta"):
        net = build_network(network_spec(cfg.model, (3, 64, 64), 1000))
    ours = sum(p.numel() for p in net.parameters())
    emb = 4 * cfg.model.channels

    def resblock(ch):  # two GroupNorms, two 3x3 convolutions, the embedding's scale and shift
        return 2 * 2 * ch + 2 * (9 * ch * ch + ch) + emb * 2 * ch + 2 * ch

    levels = [m * cfg.model.channels for m in cfg.model.channel_mult]
    downsamplers = [sum(p.numel() for p in m.parameters()) for m in net.modules() if isinstance(m, Downsample)]
    adm = (ours - sum(downsamplers) + sum(resblock(ch) for ch in levels[:-1]) + sum(resblock(ch) for ch in levels[1:])
           - emb + (9 * cfg.model.channels * 3 + 3))
    assert len(downsamplers) == len(levels) - 1
    assert adm == pytest.approx(296e6, abs=0.5e6)  # the paper's figure, rounded to millions


def test_a_class_name_beside_a_pretrained_folder_must_be_the_folders_own(tmp_path):
    """Issue 35.8: model.class_name given with model.pretrained was passed over, and the network built from the
    class's defaults failed later on a confusing block_out_channels message."""
    import diffusers

    from islands.config import validate

    diffusers.UNet2DModel(block_out_channels=(8, 16), norm_num_groups=4, layers_per_block=1, sample_size=8,
                          in_channels=1, out_channels=1,
                          down_block_types=("DownBlock2D", "DownBlock2D"),
                          up_block_types=("UpBlock2D", "UpBlock2D")).save_pretrained(tmp_path / "unet")
    model = {"arch": "diffusers", "pretrained": str(tmp_path / "unet")}
    resolved = validate({"run_dir": str(tmp_path / "run"), "model": model}).model
    assert resolved.class_name == "UNet2DModel" and resolved.config["block_out_channels"] == [8, 16]
    again = validate({"run_dir": "r", "model": {**model, "class_name": "UNet2DModel", "config": resolved.config}}).model
    assert again.config == resolved.config  # a resolved config (both named) validates as it was written
    with pytest.raises(ValueError, match="class_name: DiTTransformer2DModel, but model.pretrained .* holds a "
                                         "UNet2DModel"):
        validate({"run_dir": "r", "model": {**model, "class_name": "DiTTransformer2DModel"}})
    with pytest.raises(ValueError, match="a pretrained network's config is its folder's config.json"):
        validate({"run_dir": "r", "model": {**model, "config": {"layers_per_block": 3}}})
