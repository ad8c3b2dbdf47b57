import pytest
import torch

from islands.nets.condition import ClassCondition
from islands.nets.dit import DIT_PRESETS, DiT
from islands.nets.layers import timestep_embedding
from islands.nets.mlp import MLP
from islands.nets.unet import UNet

NUM_CLASSES = 5


def tiny_unet(num_classes=0):
    return UNet(1, 28, channels=16, channel_mult=(1, 2, 2), num_res_blocks=1,
                attention_resolutions=(7, 14), num_heads=2, num_classes=num_classes)


def tiny_dit(patch_size=2, num_classes=0):
    return DiT(28, 3, patch_size=patch_size, hidden_size=32, depth=2, num_heads=2, num_classes=num_classes)


def tiny_mlp(num_classes=0):
    return MLP(2, hidden=32, depth=2, num_classes=num_classes)


# (constructor, input shape without batch)
NETS = {
    "unet": (tiny_unet, (1, 28, 28)),
    "dit_p2": (lambda **kw: tiny_dit(2, **kw), (3, 28, 28)),
    "dit_p4": (lambda **kw: tiny_dit(4, **kw), (3, 28, 28)),
    "mlp": (tiny_mlp, (2,)),
}


def perturb_zero_params(model):
    """Zero-initialised output layers make outputs (and most gradients) trivially zero;
    give every all-zero parameter small random values so the tests see a real function."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def build(name, num_classes=0):
    torch.manual_seed(0)
    make, shape = NETS[name]
    return perturb_zero_params(make(num_classes=num_classes).eval()), shape


@pytest.mark.parametrize("name", NETS)
def test_output_shape(name):
    model, shape = build(name)
    x = torch.randn(3, *shape)
    assert model(x, torch.rand(3)).shape == x.shape


@pytest.mark.parametrize("resolution,mult,attn", [
    (32, (1, 2, 2), (16,)),
    (64, (1, 2, 2, 2), (16, 8)),
    (7, (1, 2, 2), (4,)),  # 7 -> 4 -> 2 and back
])
def test_unet_other_sizes(resolution, mult, attn):
    model = UNet(3, resolution, channels=8, channel_mult=mult, num_res_blocks=1,
                 attention_resolutions=attn, num_heads=2)
    x = torch.randn(2, 3, resolution, resolution)
    assert model(x, torch.rand(2)).shape == x.shape


def test_dit_rejects_bad_patch_size():
    with pytest.raises(ValueError, match=r"input_size \(30\).*patch_size \(4\)"):
        DiT(30, 3, patch_size=4, hidden_size=32, depth=1, num_heads=2)


@pytest.mark.parametrize("name", NETS)
def test_class_conditioning(name):
    model, shape = build(name, num_classes=NUM_CLASSES)
    x, t = torch.randn(4, *shape), torch.rand(4)
    null = torch.full((4,), NUM_CLASSES)
    out_null = model(x, t, null)
    torch.testing.assert_close(model(x, t, None), out_null)
    assert not torch.allclose(model(x, t, torch.tensor([0, 1, 2, 3])), out_null)


@pytest.mark.parametrize("name", NETS)
def test_cond_ignored_without_classes(name):
    model, shape = build(name)
    x, t = torch.randn(2, *shape), torch.rand(2)
    torch.testing.assert_close(model(x, t, torch.tensor([0, 1])), model(x, t))


def test_time_changes_output():
    model, shape = build("dit_p2")
    x = torch.randn(2, *shape)
    assert not torch.allclose(model(x, torch.zeros(2)), model(x, torch.ones(2)))


def test_a_class_condition_is_none_where_absent_or_dropped():
    condition, cond = ClassCondition(10, 4), torch.tensor([1, 2])
    assert condition.or_null(cond, 2, "cpu") is cond
    assert condition.or_null(None, 3, "cpu").tolist() == [10, 10, 10]
    assert condition.drop(cond, torch.tensor([True, False])).tolist() == [10, 2]


def test_timestep_embedding_scales_t():
    emb = timestep_embedding(torch.tensor([0.001]), 4)
    # Frequencies are 1 and 1/100; t = 0.001 is step 1 after scaling by 1000.
    torch.testing.assert_close(emb, torch.tensor([[torch.cos(torch.tensor(1.0)), torch.cos(torch.tensor(0.01)),
                                                   torch.sin(torch.tensor(1.0)), torch.sin(torch.tensor(0.01))]]))


@pytest.mark.parametrize("size,expected", [("S", 33e6), ("B", 130e6), ("L", 458e6), ("XL", 675e6)])
def test_dit_param_counts_match_paper(size, expected):
    # Paper Table 4, /2 models on 32x32x4 latents of ImageNet (1000 classes); built on meta, no memory.
    with torch.device("meta"):
        model = DiT(32, 4, patch_size=2, num_classes=1000, **DIT_PRESETS[size])
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - expected) / expected < 0.01


def test_dit_meta_then_materialise():
    with torch.device("meta"):
        model = DiT(8, 3, patch_size=2, hidden_size=32, depth=1, num_heads=2)
    model.to_empty(device="cpu")
    model.initialize_weights()
    reference = DiT(8, 3, patch_size=2, hidden_size=32, depth=1, num_heads=2)
    torch.testing.assert_close(model.pos_embed, reference.pos_embed)
    x = torch.randn(2, 3, 8, 8)
    assert torch.isfinite(model(x, torch.rand(2))).all()


@pytest.mark.parametrize("name", NETS)
def test_gradients_reach_every_parameter(name):
    model, shape = build(name, num_classes=NUM_CLASSES)
    x = torch.randn(2, *shape)
    model(x, torch.rand(2), torch.tensor([0, NUM_CLASSES])).square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize("name", NETS)
def test_blocks_called_once_each(name):
    model, shape = build(name)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) > 0
    calls = [0] * len(model.blocks)

    def counting(i, forward):
        def wrapped(*args, **kwargs):
            calls[i] += 1
            return forward(*args, **kwargs)
        return wrapped

    for i, block in enumerate(model.blocks):
        block.forward = counting(i, block.forward)
    model(torch.randn(2, *shape), torch.rand(2))
    assert calls == [1] * len(model.blocks)


@pytest.mark.parametrize("name", NETS)
def test_batch_independence(name):
    model, shape = build(name, num_classes=NUM_CLASSES)
    x, t, cond = torch.randn(4, *shape), torch.rand(4), torch.tensor([0, 1, NUM_CLASSES, 3])
    batched = model(x, t, cond)
    for i in range(4):
        alone = model(x[i:i + 1], t[i:i + 1], cond[i:i + 1])
        torch.testing.assert_close(batched[i:i + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NETS)
def test_bf16_autocast(name):
    model, shape = build(name, num_classes=NUM_CLASSES)
    x, t = torch.randn(2, *shape), torch.rand(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, torch.tensor([1, NUM_CLASSES]))
        out.float().square().mean().backward()
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # bf16 rounds to 2^-8 relative; a few dozen roundings in a row stay within a few units of it, and an output
    # that rounded nothing did not run in bf16.
    reference = model(x, t, torch.tensor([1, NUM_CLASSES]))
    error = ((out.float() - reference).norm() / reference.norm()).item()
    assert 2**-10 < error < 8 * 2**-8, error


def test_unet_attention_at_listed_resolutions():
    from islands.nets.unet import AttentionBlock
    # Levels are 28, 14, 7: attention in the 14 and 7 levels (1 down + 2 up blocks each) and the middle.
    model = tiny_unet()
    assert sum(isinstance(m, AttentionBlock) for m in model.modules()) == 2 * 3 + 1
