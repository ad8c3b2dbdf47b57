"""Captions are encoded once each, and a caption table that would not fit in memory is refused for the shards' own
embeddings (islands/data/captions.py)."""

import pytest
import torch

from islands.data.captions import CaptionWriter, caption_table, encode_captions
from islands.data.shards import ExampleWriter
from islands.data.sources import _ArraySource
from islands.errors import DataError
from islands.nets.text_folder import bundled_text_encoder

CAPTIONS = ["a red fox", "a blue car", "a red fox", "the sea", "a blue car", "a red fox"]


@pytest.fixture(scope="module")
def counted():
    """The bundled encoder, counting the captions it is asked to encode."""
    encoder = bundled_text_encoder()
    encode, seen = encoder.encode, []

    def counting(captions, **kwargs):
        seen.extend(captions)
        return encode(captions, **kwargs)

    encoder.encode = counting
    return encoder, seen


def test_each_distinct_caption_is_encoded_once_and_gets_the_embedding_it_gets_alone(counted):
    encoder, seen = counted
    seen.clear()
    table = encode_captions(encoder, CAPTIONS, 8)
    assert seen == ["a red fox", "a blue car", "the sea"]
    for i, caption in enumerate(CAPTIONS):  # the known answer: the caption encoded by itself
        torch.testing.assert_close(table[i], encode_captions(encoder, [caption], 8)[0], rtol=1e-5, atol=1e-5)


def test_a_writer_encodes_a_caption_it_met_in_an_earlier_batch_never_again(counted):
    encoder, seen = counted
    images = torch.zeros(len(CAPTIONS), 1, 4, 4, dtype=torch.uint8)
    writer = CaptionWriter(ExampleWriter(_ArraySource(images, torch.zeros(len(CAPTIONS), dtype=torch.long), 1)),
                           encoder, "minilm", 8)
    seen.clear()
    first = writer(images[:3].float() / 127.5 - 1, CAPTIONS[:3])
    second = writer(images[3:].float() / 127.5 - 1, CAPTIONS[3:])
    assert seen == ["a red fox", "a blue car", "the sea"]
    assert second[2]["caption.npy"] == first[0]["caption.npy"]  # "a red fox", from the first batch


def test_a_caption_table_larger_than_half_the_memory_is_refused_naming_the_way_out(counted, monkeypatch):
    encoder, _ = counted
    source = _ArraySource(torch.zeros(1000, 1, 4, 4, dtype=torch.uint8), torch.zeros(1000, dtype=torch.long), 1)
    source.captions = lambda indices: [CAPTIONS[i % len(CAPTIONS)] for i in indices]
    row = 9 * (max(encoder.width, encoder.pooled_width) + 1) * 4  # 8 tokens and the pooled vector, float32
    monkeypatch.setattr("islands.data.captions.os.sysconf",
                        lambda name: 1 if name == "SC_PAGE_SIZE" else 2 * 1000 * row - 1)
    with pytest.raises(DataError, match=r"1,000 captions .*islands encode CONFIG OUT --text-encoder"):
        caption_table(source, encoder, 8)
