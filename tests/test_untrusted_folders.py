"""The autoencoder, text encoder and pretrained diffusers folders read as a hostile island or a careless colleague
hands them over (issue 35): what a run records covers every file the loader reads, not the weights alone; values and
sizes from a folder's config are checked before they are used or built; no file is read through a link out of the
folder; and a tokenizer that is not its model's is refused when it is loaded, not mid-encode."""

import contextlib
import json
import signal

import diffusers
import pytest
from conftest import tiny_unet_config, write_config
from hostile import edit_json, link_out
from test_diffusers_nets import CONFIGS, saved_folder
from test_latents import latent_run, saved_vae
from test_text_encoder import tiny_folder

from islands.cli import main
from islands.config import DIFFUSERS_CLASSES, validate
from islands.data.latents import open_data_space, record_data_space
from islands.errors import DataError
from islands.nets.diffusers_net import ADAPTERS
from islands.nets.text_folder import load_text_encoder
from islands.nets.vae_folder import WEIGHTS, load_autoencoder, read_config


@contextlib.contextmanager
def within(seconds: int):
    """A config that builds a billion layers must be refused at once: a regression fails the test here instead of
    running until killed."""
    def expired(*_):
        raise TimeoutError(f"not refused within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(call, match: str) -> str:
    """The one-line DataError `call()` raises, checked against `match`."""
    with within(60), pytest.raises(DataError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


# 2. what a run records of a folder covers every file read from it


@pytest.mark.parametrize("change", [{"scaling_factor": 1.8}, {"shift_factor": 0.2}, {"act_fn": "gelu"}])
def test_a_latent_run_refuses_its_autoencoder_once_the_config_changed(tmp_path, image_npz, change):
    vae = saved_vae(tmp_path / "vae")
    run = tmp_path / "run"
    run.mkdir()
    cfg = latent_run(run, image_npz, vae)
    record_data_space(cfg, run, open_data_space(cfg, run, starting=True))
    assert open_data_space(cfg, run).autoencoder.scaling_factor == 1.7  # as recorded, it opens (sample, eval, resume)
    edit_json(vae / "config.json", lambda config: config.update(change))  # the weights' bytes untouched
    refused(lambda: open_data_space(cfg, run), f"^autoencoder folder {vae} changed since the run recorded it: its "
                                               "config.json and")


def test_stored_latents_refuse_the_autoencoder_once_its_config_changed(tmp_path, image_npz):
    vae = saved_vae(tmp_path / "vae")
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"),
                                                "data": {"source": "npz", "path": str(image_npz)}})
    assert main(["encode", config, str(tmp_path / "latents"), "--autoencoder", str(vae), "--quiet"]) == 0
    cfg = validate(tiny_unet_config(tmp_path / "run", tmp_path / "latents", data={
        "source": "shards", "path": str(tmp_path / "latents"), "autoencoder": str(vae), "flip": False}))
    open_data_space(cfg, tmp_path / "run", starting=True)  # the autoencoder they were encoded with
    edit_json(vae / "config.json", lambda c: c.update(scaling_factor=0.5))  # the latents' scale, not the weights
    refused(lambda: open_data_space(cfg, tmp_path / "run", starting=True),
            "is not the autoencoder the latents in .* were encoded with")


def _swap_vocabulary_lines(folder):
    lines = (folder / "vocab.txt").read_text().splitlines()
    lines[2000], lines[2001] = lines[2001], lines[2000]
    (folder / "vocab.txt").write_text("\n".join(lines) + "\n")


TEXT_CHANGES = {
    "vocab.txt lines swapped": _swap_vocabulary_lines,
    "tokenizer.json deleted": lambda f: (f / "tokenizer.json").unlink(),
    "hidden_act changed": lambda f: edit_json(f / "config.json", lambda c: c.update(hidden_act="relu")),
    "pooling changed": lambda f: edit_json(f / "1_Pooling/config.json", lambda c: c.update(
        pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)),
    "lowercasing changed": lambda f: edit_json(f / "sentence_bert_config.json", lambda c: c.update(do_lower_case=True)),
    "a tokenizer file added": lambda f: (f / "added_tokens.json").write_text(json.dumps({"[NEW]": 30522})),
}


@pytest.mark.parametrize("change", TEXT_CHANGES)
def test_a_text_encoder_changed_in_any_file_it_is_read_from_is_refused(tmp_path, change):
    tiny_folder(tmp_path)
    recorded = load_text_encoder(tmp_path).sha256  # what RUN/text_encoder.json and an ensemble's manifest hold
    assert load_text_encoder(tmp_path, sha256=recorded).sha256 == recorded
    TEXT_CHANGES[change](tmp_path)  # model.safetensors untouched
    refused(lambda: load_text_encoder(tmp_path, sha256=recorded),
            f"^text encoder folder {tmp_path} changed since the run recorded it: its files .*config.json")


# 4. values from the autoencoder's config


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("scaling_factor", float("nan"), "nan"), ("scaling_factor", 0, "0"), ("scaling_factor", float("inf"), "inf"),
    ("scaling_factor", "1.5", "'1.5'"), ("scaling_factor", None, "None"), ("shift_factor", float("nan"), "nan"),
    ("shift_factor", float("-inf"), "-inf")])
def test_a_latent_scale_that_is_not_a_finite_number_is_refused_by_key(tmp_path, key, value, shown):
    vae = saved_vae(tmp_path / "vae")
    edit_json(vae / "config.json", lambda c: c.update({key: value}))  # NaN and Infinity: JSON readers take them
    refused(lambda: load_autoencoder(vae), f"^autoencoder folder {vae}: config.json's {key} {shown} is not a finite")


def test_islands_encode_writes_no_manifest_of_a_zero_scale(tmp_path, image_npz, capsys):
    vae = saved_vae(tmp_path / "vae")
    edit_json(vae / "config.json", lambda c: c.update(scaling_factor=0))
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"),
                                                "data": {"source": "npz", "path": str(image_npz)}})
    assert main(["encode", config, str(tmp_path / "latents"), "--autoencoder", str(vae), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json's scaling_factor 0 is not a finite, non-zero number" in err[0]
    assert not (tmp_path / "latents" / "manifest.json").exists()


# 5. sizes from a folder's config, checked against its weights before anything is built


@pytest.mark.parametrize("layers", [10**9, 1e9])
def test_an_autoencoder_config_of_a_billion_layers_is_refused_before_it_is_built(tmp_path, layers):
    vae = saved_vae(tmp_path / "vae")
    edit_json(vae / "config.json", lambda c: c.update(layers_per_block=layers))
    message = refused(lambda: load_autoencoder(vae), f"^autoencoder folder {vae}: config.json ")
    assert ("implies more than the" if isinstance(layers, int) else "cannot be built") in message


@pytest.mark.parametrize("layers", [10**8, 1e8])
def test_a_text_encoder_config_of_a_hundred_million_layers_is_refused_before_it_is_built(tmp_path, layers):
    tiny_folder(tmp_path)
    edit_json(tmp_path / "config.json", lambda c: c.update(num_hidden_layers=layers))
    message = refused(lambda: load_text_encoder(tmp_path), f"^text encoder folder {tmp_path}: config.json ")
    assert ("implies more than the" if isinstance(layers, int) else "cannot be built") in message


def test_a_pretrained_folder_of_a_hundred_million_layers_is_refused_in_one_line(tmp_path, image_npz, capsys):
    folder = tmp_path / "pretrained"
    saved_folder(folder)
    edit_json(folder / "config.json", lambda c: c.update(layers_per_block=10**8))
    cfg = tiny_unet_config(tmp_path / "run", image_npz)
    cfg["model"] = {"arch": "diffusers", "pretrained": str(folder), "num_classes": 4}
    with within(60):
        assert main(["train", write_config(tmp_path / "run.yaml", cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.pretrained: diffusers folder {folder}: config.json implies more than" in err[0]


@pytest.mark.parametrize("class_name", ADAPTERS)
def test_every_class_a_pretrained_folder_may_hold_fits_its_own_weights(tmp_path, class_name):
    """The budget is the weights' own count: a folder as diffusers saves it is never refused by it."""
    getattr(diffusers, class_name)(**CONFIGS[class_name]).save_pretrained(tmp_path)
    assert read_config(tmp_path, "diffusers folder", DIFFUSERS_CLASSES)["_class_name"] == class_name


# 7. no file read through a link out of the folder


@pytest.mark.parametrize("name", ["config.json", WEIGHTS])
def test_an_autoencoder_file_linked_out_of_its_folder_is_refused(tmp_path, name):
    vae = saved_vae(tmp_path / "vae")
    link_out(vae, name, tmp_path / "outside" / name)
    refused(lambda: load_autoencoder(vae), f"^autoencoder folder {vae}: {name} leads out of the folder")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                  "modules.json", "1_Pooling/config.json", "sentence_bert_config.json"])
def test_a_text_encoder_file_linked_out_of_its_folder_is_refused(tmp_path, name):
    folder = tmp_path / "encoder"
    folder.mkdir()
    tiny_folder(folder)
    link_out(folder, name, tmp_path / "outside" / name)
    refused(lambda: load_text_encoder(folder), f"^text encoder folder {folder}: {name} leads out of the folder")


# 8. a tokenizer that is not its model's, refused at load


def test_a_tokenizer_of_another_class_than_its_model_is_refused_at_load(tmp_path):
    tiny_folder(tmp_path)
    edit_json(tmp_path / "tokenizer_config.json", lambda c: c.update(tokenizer_class="CLIPTokenizer"))
    refused(lambda: load_text_encoder(tmp_path), r"its tokenizer \(CLIPTokenizer\) has 30524 tokens, more than the "
                                                 "30522 its BertModel embeds")


def test_a_vocabulary_without_its_unknown_token_is_refused_at_load(tmp_path):
    tiny_folder(tmp_path)
    (tmp_path / "tokenizer.json").unlink()  # the tokenizer made from vocab.txt
    lines = [t for t in (tmp_path / "vocab.txt").read_text().splitlines() if t != "[UNK]"]
    (tmp_path / "vocab.txt").write_text("\n".join(lines) + "\n")
    refused(lambda: load_text_encoder(tmp_path), r"its tokenizer \(BertTokenizer\) cannot encode a caption: .*UNK")
