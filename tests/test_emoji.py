"""data.source emoji: Noto Color Emoji's glyphs drawn the same every time, labelled by group, captioned by name, and
kept through `islands shard`; a source or shard folder without captions refuses to give them."""

import hashlib
import re

import numpy as np
import PIL
import pytest
import torch
from conftest import emoji_or_skip, tiny_unet_config, write_config

from islands.cli import main
from islands.config import validate
from islands.data import build_data
from islands.data.clusters import ClusterSubset
from islands.data.emoji import (
    EMOJI_FONT,
    EMOJI_TEST,
    EmojiSource,
    caption,
    emoji_names,
    has_skin_tone,
    read_emoji_test,
)
from islands.data.registry import build_source
from islands.data.shards import ShardSource, file_sha256, write_shards
from islands.errors import DataError
from islands.rundir import latest_checkpoint
from islands.trainer import train

GROUPS = ["Smileys & Emotion", "People & Body", "Animals & Nature", "Food & Drink", "Travel & Places", "Activities",
          "Objects", "Symbols", "Flags"]
# sha256 of the first 32 emoji at 16x16 on white, uint8 (n, 3, 16, 16), recorded after looking at them (a grid of
# the whole set is docs/figures/emoji.png), for Debian bookworm's font (2.042) drawn by Pillow 13.0
KNOWN = {("e5899ed38b8ed83e08bd3ac5de09791e9d19d288333a796de1d35ad17396f1ec", "13.0.0"):
         "b487227b187d062a6d64a0cbcf5d841e922a168ef9e25ed444413d0067186533"}


@pytest.fixture(autouse=True)
def installed():
    emoji_or_skip()


@pytest.fixture
def short_list(tmp_path) -> str:
    """An emoji-test.txt of a face, two emoji the font does not draw as one glyph, and a flag."""
    listed = tmp_path / "emoji-test.txt"
    listed.write_text("# group: Smileys & Emotion\n# subgroup: face-smiling\n"
                      "1F600 ; fully-qualified # 😀 E1.0 grinning face\n"
                      "1FAE9 ; fully-qualified # 🫩 E16.0 face with bags under eyes\n"  # newer than the font
                      "1F34E 200D 1F34E ; fully-qualified # 🍎‍🍎 E0.0 apple joined to apple\n"  # no such glyph
                      "# group: Flags\n# subgroup: country-flag\n"
                      "1F1EF 1F1F5 ; fully-qualified # 🇯🇵 E2.0 flag: Japan\n", encoding="utf-8")
    return str(listed)


def sha256(images: torch.Tensor) -> str:
    return hashlib.sha256(images.numpy().tobytes()).hexdigest()


def test_the_list_is_read_whole_with_the_tone_and_flags_it_names():
    listed = read_emoji_test()
    with open(EMOJI_TEST, encoding="utf-8") as f:  # the file's own count of its fully-qualified emoji
        count = int(re.search(r"^# fully-qualified : (\d+)$", f.read(), re.M).group(1))
    assert len(listed) == count
    assert list(dict.fromkeys(e.group for e in listed)) == GROUPS  # "Component" has no fully-qualified emoji
    # the code points say what the names say
    assert [has_skin_tone(e) for e in listed] == ["skin tone" in e.name for e in listed]
    assert [e.subgroup == "country-flag" for e in listed] == [  # two regional indicators
        len(e.text) == 2 and all(0x1F1E6 <= ord(c) <= 0x1F1FF for c in e.text) for e in listed]


@pytest.mark.parametrize("text, expected", [
    ("\U0001F34E", "red apple, food and drink, food fruit"),
    ("\U0001F1EF\U0001F1F5", "flag of Japan, flags, country flag"),
    ("\U0001F44B\U0001F3FD", "waving hand medium skin tone, people and body, hand fingers open"),
    ("\U0001F3C1", "chequered flag, flags, flag"),
])
def test_captions_name_the_emoji_its_group_and_subgroup(text, expected):
    e = next(e for e in read_emoji_test() if e.text == text)
    assert caption(e, emoji_names()) == expected


def test_drawing_is_the_same_every_time(tmp_path, monkeypatch):
    first = EmojiSource(resolution=16, limit=32)
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path))  # nothing cached: drawn again
    again = EmojiSource(resolution=16, limit=32)
    assert list((tmp_path / "emoji").glob("*.npz")), "the drawing was not cached"
    assert first.data.dtype == torch.uint8 and first.data.shape == (32, 3, 16, 16)
    assert sha256(again.data) == sha256(first.data)
    # drawn or read from the cache, the batches are laid out alike: a channels-last batch (what stacking transposed
    # pixels gives) takes other convolution kernels and trains to other weights
    for source in (first, again):
        assert source.data.is_contiguous() and source.get([0, 1])[0].is_contiguous()
    known = KNOWN.get((file_sha256(EMOJI_FONT), PIL.__version__))
    if known is not None:
        assert sha256(first.data) == known


def test_the_glyph_is_in_colour_cropped_and_centred_on_the_background(short_list):
    white, black = EmojiSource(resolution=32, emoji_test=short_list), \
        EmojiSource(resolution=32, emoji_test=short_list, background=0)
    (face, flag), _ = white.get([0, 1])  # 😀, a round yellow face; 🇯🇵, a flag wider than high
    r, g, b = face[:, 16, 4]
    assert r > 0.5 and g > 0.2 and b < -0.5  # yellow
    assert (face[:, 0, 0] == 1).all() and (black.get([0])[0][0, :, 0, 0] == -1).all()  # the corners: background
    rows, columns = (flag < 1).any(0).any(1).nonzero()[:, 0], (flag < 1).any(0).any(0).nonzero()[:, 0]
    assert columns.min() == 0 and columns.max() == 31  # cropped to the glyph, which fills the width
    assert rows.min() == 31 - rows.max() and rows.min() > 0  # centred in height


def test_labels_are_the_groups_and_skin_tones_are_kept_or_left_out():
    toned, plain = EmojiSource(resolution=8, limit=200), EmojiSource(resolution=8, limit=200, skin_tones=False)
    for source in (toned, plain):
        assert source.classes == GROUPS and source.num_classes == 9 and len(source) == 200
        _, y = source.get(np.arange(len(source)))
        assert [source.classes[i] for i in y] == [e.group for e in source.emoji]
        assert source.captioned and source.flip is False  # a mirrored arrow or flag is not its caption
    assert any("skin tone" in c for c in toned.captions(range(200)))
    assert not any("skin tone" in c for c in plain.captions(range(200)))
    assert toned.captions([0]) == ["grinning face, smileys and emotion, face smiling"]


def test_an_emoji_the_font_lacks_or_draws_in_parts_is_left_out(short_list):
    source = EmojiSource(resolution=8, emoji_test=short_list)
    assert [e.text for e in source.emoji] == ["\U0001F600", "\U0001F1EF\U0001F1F5"]
    assert source.get([0, 1])[1].tolist() == [0, 1] and source.classes == ["Smileys & Emotion", "Flags"]


def test_missing_inputs_are_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=re.escape(f"emoji font {tmp_path / 'no.ttf'} not found")):
        EmojiSource(font=str(tmp_path / "no.ttf"))
    with pytest.raises(DataError, match=re.escape(f"emoji list {tmp_path / 'no.txt'} not found")):
        EmojiSource(emoji_test=str(tmp_path / "no.txt"))
    monkeypatch.setitem(__import__("sys").modules, "emoji", None)
    with pytest.raises(DataError, match=r"emoji package.*islands\[text\]"):
        EmojiSource(limit=1)


def test_the_config_builds_it_and_a_cluster_keeps_its_captions(tmp_path):
    cfg = validate({"run_dir": str(tmp_path), "data": {"source": "emoji", "resolution": 8, "limit": 12}})
    source = build_data(cfg.data, seed=0)
    assert isinstance(source, EmojiSource) and source.shape == (3, 8, 8)
    subset = ClusterSubset(source, np.arange(12) % 3, 1)
    assert subset.captioned and subset.captions([0, 2]) == source.captions([1, 7])


def test_islands_shard_keeps_the_captions_and_a_class_conditional_run_trains_on_them(tmp_path):
    data = {"source": "emoji", "resolution": 8, "limit": 20}
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"), "data": data})
    assert main(["shard", config, str(tmp_path / "shards"), "--shard-size", "8", "--order", "given", "--quiet"]) == 0
    shards, source = ShardSource(tmp_path / "shards"), build_source("emoji", resolution=8, limit=20)
    assert shards.manifest["members"] == ["png", "txt", "cls"] and shards.num_classes == 9
    order = np.random.default_rng(0).permutation(20)
    x, y = shards.get(order)
    assert torch.equal(x, source.get(order)[0]) and torch.equal(y, source.get(order)[1])
    assert shards.captioned and shards.captions(order) == source.captions(order)
    assert "\U0001F600" not in "".join(shards.captions(order))  # a caption is words, not its glyph

    cfg = tiny_unet_config(tmp_path / "run", None, model={"num_classes": 9},
                           train={"images": 16, "checkpoint_every": 16, "sample_every": 0})
    cfg["data"] = {"source": "shards", "path": str(tmp_path / "shards")}
    train(validate(cfg))
    assert latest_checkpoint(tmp_path / "run") is not None


def test_captions_of_data_without_them_are_refused_by_name(tmp_path, image_npz):
    source = build_source("npz", path=str(image_npz))
    with pytest.raises(DataError, match="the npz data has no captions"):
        source.captions([0])
    write_shards(source, tmp_path / "shards", 16, {"source": "npz"})
    shards = build_source("shards", path=str(tmp_path / "shards"))
    assert not shards.captioned
    with pytest.raises(DataError, match="the shards data has no captions"):
        shards.captions([0])
