"""A user's CLIP folder as the prompt judge: loaded offline as untrusted input, its embeddings CLIP's own, and the
CLIP score what prompt following reports."""

import json
import shutil
import socket
import string

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from test_text_encoder import _json, _link_out, folder_digest

from islands.errors import DataError
from islands.eval import clip_judge
from islands.eval.clip_judge import load_clip_judge
from islands.eval.prompt_following import prompt_following
from islands.nets.text_folder import minilm_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.3, 0.25]  # not OpenAI's, so that a judge that ignores the file is caught
CAPTIONS = ["a red apple", "grinning face with big eyes", "a racing car on a wet track at night",
            " ".join(["a very long caption"] * 20)]  # longer than the 32 positions: truncated as CLIP's would be


def tiny_clip(folder, tokenizer: str = "bert", preprocessor: bool = True):
    """A tiny random CLIPModel saved as transformers saves one, with a preprocessor config and a tokenizer: the
    bundled MiniLM's BERT tokenizer, or CLIP's own BPE tokenizer on a vocabulary of letters (which pads with its
    end-of-text token, as OpenAI's does); the text tower's vocabulary size and special ids set to fit it."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bert":
        for name in TOKENIZER_FILES:
            shutil.copy(minilm_folder() / name, folder / name)
        ids = dict(vocab_size=30522, pad_token_id=0, bos_token_id=101, eos_token_id=102)
    else:
        letters = list(string.ascii_lowercase)
        vocab = ["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters)]
        transformers.CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[]).save_pretrained(folder)
        ids = dict(vocab_size=len(vocab), pad_token_id=1, bos_token_id=0, eos_token_id=1)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.CLIPConfig(
        text_config=tower | ids | dict(max_position_embeddings=32),
        vision_config=tower | dict(image_size=16, patch_size=8), projection_dim=16)
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(folder, safe_serialization=True)
    if preprocessor:
        (folder / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "CLIPImageProcessor", "image_mean": MEAN, "image_std": STD, "resample": 3,
             "size": {"shortest_edge": 16}, "crop_size": {"height": 16, "width": 16}}))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip") / "clip")


def reference(folder):
    """transformers' own CLIPModel and tokenizer, loaded from the folder as its documentation loads them."""
    model = transformers.CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def by_hand(images: np.ndarray, mean=MEAN, std=STD, size: int = 16) -> torch.Tensor:
    """CLIP's preprocessing written with PIL, on floats: [-1, 1] to [0, 1], the shorter side bicubic to `size`, the
    centre cropped, then normalised."""
    out = []
    for image in images:
        height, width = image.shape[1:]
        resized_w, resized_h = int(size * width / min(height, width)), int(size * height / min(height, width))
        channels = [np.asarray(Image.fromarray((c + 1) / 2, mode="F").resize((resized_w, resized_h),
                                                                           Image.Resampling.BICUBIC))
                    for c in image]
        top, left = (resized_h - size) // 2, (resized_w - size) // 2
        pixels = np.clip(np.stack(channels), 0, 1)[:, top:top + size, left:left + size]
        out.append((pixels - np.array(mean)[:, None, None]) / np.array(std)[:, None, None])
    return torch.from_numpy(np.stack(out)).float()


def no_network(patch):
    def refuse(*args, **kwargs):
        raise OSError("the CLIP judge tried to reach the network")

    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("TRANSFORMERS_OFFLINE", "1")
    patch.setattr(socket.socket, "connect", refuse)
    patch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("tokenizer", ["bert", "clip"])
def test_the_judge_loads_offline_and_embeds_as_clip_does(folder, tmp_path, monkeypatch, tokenizer):
    if tokenizer == "clip":
        folder = tiny_clip(tmp_path / "clip", tokenizer="clip")
    model, tokenizer = reference(folder)
    eos = model.config.text_config.eos_token_id
    # CLIP pools at the first end-of-text token: each caption keeps its own, the long one's truncated in
    assert all(tokenizer(c, truncation=True, max_length=32)["input_ids"][-1] == eos for c in CAPTIONS)
    no_network(monkeypatch)
    assert type(transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)) is type(tokenizer)
    monkeypatch.setattr(clip_judge, "BATCH", 2)  # several batches, captions padded to different lengths
    judge = load_clip_judge(folder)
    sha256 = folder_digest(folder, [p.name for p in folder.iterdir()])  # every file it holds is read
    assert judge.sha256 == sha256 and sha256[:16] in judge.name and judge.clip_score

    rng = np.random.default_rng(0)
    for shape in ((5, 3, 8, 8), (3, 3, 8, 12), (2, 3, 41, 23)):  # up; up, not square (centre crop); down
        images = rng.uniform(-1, 1, shape).astype(np.float32)
        with torch.no_grad():
            expected = model.get_image_features(pixel_values=by_hand(images)).pooler_output
        got = judge.images(torch.from_numpy(images))
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.allclose(got, expected / expected.norm(dim=1, keepdim=True), atol=1e-5)

    got = judge.texts(CAPTIONS)
    for i, caption in enumerate(CAPTIONS):
        ids = tokenizer(caption, truncation=True, max_length=32, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = model.get_text_features(input_ids=ids).pooler_output[0]
        assert torch.allclose(got[i], expected / expected.norm(), atol=1e-5)

    grey = torch.from_numpy(rng.uniform(-1, 1, (2, 1, 8, 8)).astype(np.float32))
    assert torch.equal(judge.images(grey), judge.images(grey.expand(-1, 3, -1, -1)))


def test_pixels_are_what_transformers_clip_image_processor_makes(folder, tmp_path):
    """Against transformers' own (PIL) CLIP processor, on images whose pixels are whole bytes: PIL resizes bytes in
    two passes, each rounded to a byte, so the two agree to a byte and a half over the smallest std."""
    rng = np.random.default_rng(1)
    without = tiny_clip(tmp_path / "no-preprocessor", preprocessor=False)
    for path, mean, std in ((folder, MEAN, STD), (without, None, None)):
        judge = load_clip_judge(path)
        settings = {} if mean is None else dict(image_mean=mean, image_std=std)  # else OpenAI's defaults
        processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 16},
                                                       crop_size={"height": 16, "width": 16}, **settings)
        for height, width in ((8, 8), (8, 12), (41, 23)):  # up, up and cropped, down and cropped
            images = rng.integers(64, 193, (3, height, width, 3), dtype=np.uint8)  # PIL's passes never clip
            expected = processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")["pixel_values"]
            x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
            assert torch.allclose(judge.pixels(x), expected, atol=1.5 / 255 / min(std or processor.image_std))


def test_the_clip_score_is_a_hundred_times_the_mean_clipped_cosine_of_each_image_with_its_prompt(folder):
    judge = load_clip_judge(folder)
    model, tokenizer = reference(folder)
    rng = np.random.default_rng(2)
    images = rng.uniform(-1, 1, (6, 3, 8, 8)).astype(np.float32)
    prompts = [CAPTIONS[i % 2] for i in range(6)]
    with torch.no_grad():
        image_features = model.get_image_features(pixel_values=by_hand(images)).pooler_output
        ids = tokenizer(prompts, padding=True, return_tensors="pt")
        text_features = model.get_text_features(input_ids=ids["input_ids"],
                                                attention_mask=ids["attention_mask"]).pooler_output
    cosines = [float(image_features[i] @ text_features[i] / image_features[i].norm() / text_features[i].norm())
               for i in range(6)]
    assert any(c < 0 for c in cosines) and any(c > 0 for c in cosines)  # the clipping at 0 is exercised
    score = prompt_following(judge.images(torch.from_numpy(images)), prompts, judge)["clip_score"]
    assert score == pytest.approx(100 * sum(max(c, 0) for c in cosines) / 6, abs=1e-4)


BROKEN = {
    "a text model": (lambda f: _json(f / "config.json", lambda c: c | {"model_type": "bert",
                                                                           "architectures": ["BertModel"]}),
                     r"config.json describes model_type 'bert' \['BertModel'\], not a CLIP model"),
    "a text tower only": (lambda f: _json(f / "config.json", lambda c: c | {"architectures": ["CLIPTextModel"]}),
                          r"config.json describes model_type 'clip' \['CLIPTextModel'\], not a CLIP model"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
    "pickled weights": (lambda f: [(f / "model.safetensors").unlink(), (f / "pytorch_model.bin").write_bytes(b"\x80")],
                        r"holds pickled weights only \(pytorch_model.bin\); Islands reads safetensors only"),
    "weights linked out": (lambda f: _link_out(f, "model.safetensors"), "model.safetensors leads out of the folder"),
    "no tokenizer": (lambda f: [(f / n).unlink() for n in ("tokenizer.json", "vocab.txt")], "has no tokenizer"),
    "preprocessor linked out": (lambda f: _link_out(f, "preprocessor_config.json"),
                                "preprocessor_config.json leads out of the folder"),
    "a zero std": (lambda f: _json(f / "preprocessor_config.json", lambda c: c | {"image_std": [0.2, 0, 0.2]}),
                   r"preprocessor_config.json's image_std \[0.2, 0, 0.2\] is not three positive numbers"),
    "weights of another size": (lambda f: _json(f / "config.json", lambda c: c | {"projection_dim": 8}),
                                "model.safetensors does not fit its config.json .mismatched keys: text_projection"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_folders_that_are_not_a_safe_clip_model_are_refused_in_one_line(folder, tmp_path, case):
    broken = tmp_path / "clip"
    shutil.copytree(folder, broken)
    breaking, message = BROKEN[case]
    breaking(broken)
    with pytest.raises(DataError, match=f"^CLIP folder {broken}.*{message}") as refused:
        load_clip_judge(broken)
    assert "\n" not in str(refused.value)
