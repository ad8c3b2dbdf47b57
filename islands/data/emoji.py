"""Captioned colour images: the emoji of Unicode's emoji-test.txt drawn with the Noto Color Emoji font.

Every fully-qualified emoji of emoji-test.txt (Debian: unicode-data) that the font (Debian: fonts-noto-color-emoji,
a bitmap font of one size, 109) draws as one glyph, in the file's order: drawn in colour on a transparent canvas,
cropped to its pixels, centred on a square, composited onto the grey level `background`, resized to `resolution`.
An emoji the font lacks (a newer Unicode's) is left out, and so is a sequence it draws as several glyphs.

Labels are the emoji's group (9: smileys and emotion, people and body, ... flags), so that a class-conditional run
and the feature classifier of `islands eval` work on it as on Fashion-MNIST. Captions join the emoji's name (the
`emoji` package's: ":red_apple:" -> "red apple"), its group and its subgroup: "red apple, food and drink, food fruit".

Debian 12's list is Emoji 15.0's 3,655, all of which its font draws. Skin tones: the 1,785 variants of a person or
hand in the five Fitzpatrick tones are kept, each named with its tone ("waving hand light skin tone, ..."), as a
caption-controlled change of colour, which is what prompt following should show; `skin_tones=False` keeps only the
default yellow one (1,870 images, People & Body 363 of them, not 2,148). Flags: the 269 are kept, a country's
captioned "flag of Japan, flags, country flag": images told apart by their caption only.

Drawing the whole set takes a few seconds; the images are cached (`cache_dir()/emoji`) under everything they are
made of: the font's and the list's sha256, Pillow's version (its FreeType draws the glyphs) and the options.
"""

import hashlib
import os
import re
from dataclasses import dataclass

import numpy as np
import PIL
import torch
from PIL import Image, ImageDraw, ImageFont, features

from islands.data.fingerprint import cache_dir
from islands.data.sources import CAPTION, _ArraySource, _check_resolution
from islands.errors import DataError
from islands.rundir import read_npz
from islands.untrusted import file_sha256

EMOJI_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
EMOJI_TEST = "/usr/share/unicode/emoji/emoji-test.txt"
FONT_SIZE = 109  # the font's one bitmap size: another is refused by FreeType
DRAWING = 1  # bumped whenever the drawing below changes, so that no older cached image is read as this one's
SKIN_TONES = range(0x1F3FB, 0x1F400)  # the five Fitzpatrick modifiers
NAMED_FLAGS = ("country-flag", "subdivision-flag")  # the emoji package names these by their country alone


@dataclass(frozen=True)
class Emoji:
    text: str  # its code points
    name: str  # emoji-test.txt's (CLDR) name
    group: str
    subgroup: str


def read_emoji_test(path: str = EMOJI_TEST) -> list[Emoji]:
    """The fully-qualified emoji of an emoji-test.txt, in its order, with their group and subgroup."""
    emoji, group, subgroup = [], None, None
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.startswith("# group:"):
                    group = line.split(":", 1)[1].strip()
                elif line.startswith("# subgroup:"):
                    subgroup = line.split(":", 1)[1].strip()
                elif "; fully-qualified" in line:
                    points, comment = line.partition(";")[0], line.partition("#")[2]
                    try:
                        text = "".join(chr(int(p, 16)) for p in points.split())
                    except ValueError:
                        raise DataError(f"emoji list {path}: line {n} has no code points: {line.strip()}") from None
                    if group is None or subgroup is None:
                        raise DataError(f"emoji list {path}: line {n} comes before any '# group:' or '# subgroup:'")
                    name = re.sub(r"^\S+\s+E\d+\.\d+\s+", "", comment.strip())  # "🍎 E0.6 red apple" -> "red apple"
                    emoji.append(Emoji(text, name, group, subgroup))
    except FileNotFoundError:
        raise DataError(f"emoji list {path} not found; Debian's unicode-data package installs it "
                        f"at {EMOJI_TEST}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"emoji list {path}: cannot read: {e}") from None
    if not emoji:
        raise DataError(f"emoji list {path} lists no fully-qualified emoji; is it Unicode's emoji-test.txt?")
    return emoji


def has_skin_tone(e: Emoji) -> bool:
    return any(ord(c) in SKIN_TONES for c in e.text)


def _words(text: str) -> str:
    return text.lower().replace("&", "and").replace("-", " ")


def caption(e: Emoji, names: dict) -> str:
    """The emoji's name, group and subgroup: "red apple, food and drink, food fruit". `names`: the emoji package's
    EMOJI_DATA, whose name is CLDR's with its spaces, colons and commas made underscores (emoji-test.txt's when the
    package does not know it)."""
    known = names.get(e.text, {}).get("en")
    name = known.strip(":").replace("_", " ") if known else e.name.replace(":", "").replace(",", "")
    if e.subgroup in NAMED_FLAGS:
        name = f"flag of {name}"
    return f"{name}, {_words(e.group)}, {_words(e.subgroup)}"


def emoji_names() -> dict:
    try:
        import emoji
    except ImportError:
        raise DataError("data.source emoji names its images with the emoji package, which is not installed: "
                        "pip install 'islands[text]'") from None
    return emoji.EMOJI_DATA


def open_font(path: str) -> ImageFont.FreeTypeFont:
    if not features.check("raqm"):  # without it a sequence (a flag, a skin tone) is drawn as its parts
        raise DataError("data.source emoji needs Pillow with libraqm, to draw an emoji sequence as one glyph")
    if not os.path.isfile(path):
        raise DataError(f"emoji font {path} not found; Debian's fonts-noto-color-emoji package installs it "
                        f"at {EMOJI_FONT}")
    try:
        return ImageFont.truetype(path, FONT_SIZE, layout_engine=ImageFont.Layout.RAQM)
    except OSError as e:
        raise DataError(f"emoji font {path}: cannot load at size {FONT_SIZE} (a colour bitmap font of that one "
                        f"size, such as Noto Color Emoji, is needed): {e}") from None


def draw(text: str, font: ImageFont.FreeTypeFont, resolution: int, background: int) -> np.ndarray | None:
    """One emoji -> uint8 (3, R, R): its glyph's pixels centred on a square of `background`; None when the font
    does not draw it as one glyph (it lacks it, or draws a sequence as its parts)."""
    if font.getlength(text) > font.getlength("\U0001F600"):  # every glyph of the font is as wide as 😀
        return None
    _, _, right, bottom = font.getbbox(text)
    canvas = Image.new("RGBA", (right, bottom), (0, 0, 0, 0))
    ImageDraw.Draw(canvas).text((0, 0), text, font=font, embedded_color=True)
    box = canvas.getbbox()  # of the pixels with any opacity
    if box is None:  # a glyph the font does not have is drawn as nothing
        return None
    glyph = canvas.crop(box)
    side = max(glyph.size)
    square = Image.new("RGBA", (side, side), (background, background, background, 255))
    # composited before resizing: the same as resizing the premultiplied colours, without their dark fringe
    square.alpha_composite(glyph, ((side - glyph.width) // 2, (side - glyph.height) // 2))
    image = square.convert("RGB")
    if side != resolution:
        image = image.resize((resolution, resolution), Image.Resampling.LANCZOS)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


class EmojiSource(_ArraySource):
    """The emoji of `emoji_test` that `font` draws (see the module's docstring), (3, R, R) in [-1, 1], labelled by
    group, with captions. `limit`: only the first emoji of the list (after `skin_tones`), for a quick look."""

    def __init__(self, resolution=32, background=255, skin_tones=True, limit=None, font=None, emoji_test=None):
        resolution = _check_resolution(resolution, required=True)
        if isinstance(background, bool) or not isinstance(background, int) or not 0 <= background <= 255:
            raise ValueError(f"background must be a grey level 0..255, got {background!r}")
        font, emoji_test = font or EMOJI_FONT, emoji_test or EMOJI_TEST
        every = read_emoji_test(emoji_test)
        listed = [e for e in every if skin_tones or not has_skin_tone(e)][:limit]
        font_face = open_font(font)
        names = emoji_names()
        key = repr((DRAWING, file_sha256(font), file_sha256(emoji_test), PIL.__version__, resolution, background,
                    [e.text for e in listed]))
        images, drawn = _cached(hashlib.sha256(key.encode()).hexdigest(),
                                lambda: _draw_all(listed, font_face, resolution, background))
        self.emoji = [listed[i] for i in drawn]
        self.classes = list(dict.fromkeys(e.group for e in every))  # in the list's order, whatever `limit` keeps
        labels = torch.tensor([self.classes.index(e.group) for e in self.emoji], dtype=torch.int64)
        super().__init__(torch.from_numpy(images), labels, len(self.classes))
        self.texts = [caption(e, names) for e in self.emoji]
        self.read_from = (font, emoji_test)
        self.holds = self.holds | {CAPTION}

    def read(self, indices, fields) -> dict:
        got = super().read(indices, fields)
        if CAPTION in fields:
            got[CAPTION] = [self.texts[i] for i in np.asarray(indices, dtype=np.int64).reshape(-1)]
        return got


def _draw_all(listed: list[Emoji], font, resolution: int, background: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (uint8 (n, 3, R, R), the positions in `listed` of the n emoji the font draws)."""
    images, drawn = [], []
    for i, e in enumerate(listed):
        image = draw(e.text, font, resolution, background)
        if image is not None:
            images.append(image)
            drawn.append(i)
    if not images:
        raise DataError("the emoji font draws none of the listed emoji; is it a colour emoji font?")
    return np.stack(images), np.asarray(drawn, dtype=np.int64)


def _cached(key: str, make) -> tuple[np.ndarray, np.ndarray]:
    """make() -> (images, drawn), or what it gave under `key` before. A cache that cannot be read or written costs
    time, not correctness: the images are drawn again."""
    path = cache_dir() / "emoji" / f"{key}.npz"
    try:
        arrays = read_npz(path, ("images", "drawn"), required=("images", "drawn"))
        return arrays["images"], arrays["drawn"]
    except ValueError:
        pass
    images, drawn = make()
    try:  # whole or not at all: a temporary name of its own, renamed
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, images=images, drawn=drawn)
        os.replace(tmp, path)
    except OSError:
        pass
    return images, drawn


__all__ = ["EMOJI_FONT", "EMOJI_TEST", "Emoji", "EmojiSource", "caption", "draw", "has_skin_tone", "read_emoji_test"]
