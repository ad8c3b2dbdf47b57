"""The bundled configs are valid, and the paper-scale presets have the papers' sizes."""

from pathlib import Path

import pytest
import torch

from islands.config import load_config
from islands.nets import build_network

CONFIGS = sorted(Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_bundled_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.run_dir.startswith("runs/")


def _parameters(cfg, shape, classes):
    with torch.device("meta"):
        net = build_network(cfg.model, shape, classes)
    return sum(p.numel() for p in net.parameters())


def test_dit_xl2_preset_has_the_papers_675m_parameters():
    cfg = load_config("configs/dit_xl2_latents.yaml")
    assert _parameters(cfg, (4, 32, 32), 1000) == pytest.approx(675e6, rel=0.01)


def test_adm_imagenet64_preset_is_near_the_papers_296m_parameters():
    # Our U-Net resizes skips by interpolation without ADM's up-sampling convolutions: ~10% fewer weights.
    cfg = load_config("configs/unet_adm_imagenet64.yaml")
    assert _parameters(cfg, (3, 64, 64), 1000) == pytest.approx(296e6, rel=0.15)
