"""The records issue 37 typed last (section 3): each file Islands writes and reads back is a pydantic model with a
version, and a malformed one (a key missing, a value of the wrong type, a version this Islands does not know) is
refused in one line naming the file and the key, never read as a dict that fails later with a KeyError."""

import copy
import json

import pytest

from islands.data.shards import CaptionEmbeddings, LatentsSection, RankShards, ShardManifest
from islands.data.tar_index import Lacking, RankTars
from islands.ddm.records import ConditionRouterReport, EnsembleManifest
from islands.errors import CheckpointError, DataError
from islands.parallel.probe import HostProbe, LinkProbe, NetworkDescription
from islands.report import CommunicationLedger, RouterAccuracy
from islands.rundir import LogLine, read_log

SHA = "a" * 64
SHARD = {"tar": "shard-000000.tar", "index": "shard-000000.idx.npy", "digests": "shard-000000.sha256.npy",
         "examples": 3, "bytes": 10240, "sha256": SHA, "index_sha256": SHA, "digests_sha256": SHA}
TAR = {"i": 0, "tar": "/data/00000.tar", "bytes": 10240, "mtime_ns": 1, "examples": 2,
       "left_out": [{"tar": "/data/00000.tar", "key": "x", "why": "no image"}], "lacking": {"caption": 0, "class": 2},
       "widths": [8, 9], "heights": [8, 9]}
COLLECTIVE = {"call_s": 1e-4, "large_s": 2e-3, "gbit_s": 9.5}
MODEL = {"arch": "mlp", "hidden": 16, "depth": 2}

# model, a valid file, the key a deletion makes missing, and a key given a value of the wrong type
RECORDS = {
    "RankShards (.rank-R.json of islands shard)": (
        RankShards, {"version": 1, "shards": [SHARD]}, ("shards", 0, "bytes"), (("shards", 0, "examples"), "3")),
    "RankTars (.rank-R.json of islands index)": (
        RankTars, {"version": 1, "tars": [TAR]}, ("tars", 0, "mtime_ns"), (("tars", 0, "lacking", "class"), "two")),
    "Lacking (.raw-I.lacking.json of islands index)": (
        Lacking, {"caption": [[0, "x", "no .txt"]], "class": []}, None, (("caption", 0), "row 0")),
    "NetworkDescription (the probe's NETWORK.json)": (
        NetworkDescription, {"model": MODEL, "shape": [2], "classes": 3, "batch": 8}, ("batch",), (("classes",), [3])),
    "LinkProbe (the probe's OUT.json)": (
        LinkProbe, {"ranks": 2, "collectives": {"all_reduce": COLLECTIVE}, "seconds_added_by_ddp": 0.01,
                    "wait_s_a_step": 0.0, "call_s_beside_compute": 2e-4, "copy_gbit_s": 40.0, "latency_us": 50.0,
                    "gbit_s": 9.5, "gbit_s_under_ddp": 4.0},
        ("gbit_s_under_ddp",), (("collectives", "all_reduce", "call_s"), "fast")),
    "HostProbe (the host probe's OUT.json)": (
        HostProbe, {"host_s": {"fsdp": 0.002}}, ("host_s",), (("host_s", "fsdp"), [1])),
    "RouterAccuracy (router_accuracy.json)": (
        RouterAccuracy, {"images": 64, "t": [0.25, 0.75], "accuracy": [0.9, 0.5], "majority_cluster_share": 0.5},
        ("majority_cluster_share",), (("accuracy",), 0.9)),
    "CommunicationLedger (communication.json)": (
        CommunicationLedger, {"steps": 4, "bytes_per_step": {"all_reduce": 10.0}, "total_bytes": {"all_reduce": 40}},
        ("steps",), (("total_bytes", "all_reduce"), "40 bytes")),
    "ConditionRouterReport (condition_router.json)": (
        ConditionRouterReport, {"width": 8, "clusters": 2, "hidden": 16, "calibration": {"accuracy": 0.9}},
        ("hidden",), (("clusters",), "two")),
}


def edited(raw: dict, path: tuple, value=None, delete: bool = False) -> dict:
    raw = copy.deepcopy(raw)
    inner = raw
    for part in path[:-1]:
        inner = inner[part]
    if delete:
        del inner[path[-1]]
    else:
        inner[path[-1]] = value
    return raw


def key_of(path: tuple) -> str:
    """A location as the one-line errors write it: shards[0].bytes."""
    key = ""
    for part in path:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else part)
    return key


def read(model, path):
    """The record in `path`, through the reader its module uses."""
    if model is ConditionRouterReport:
        return model.parse(path.read_bytes(), path)
    return model.read(path)


@pytest.mark.parametrize("name", RECORDS)
def test_a_record_reads_and_a_malformed_one_is_refused_in_one_line_naming_the_file_and_the_key(name, tmp_path):
    model, raw, missing, (wrong, value) = RECORDS[name]
    path = tmp_path / "record.json"
    path.write_text(json.dumps(raw))
    assert read(model, path).version == 1  # a file written without a version is version 1
    breaks = {"a wrong type": (edited(raw, wrong, value), key_of(wrong)),
              "an unknown version": ({**raw, "version": 2}, "version")}
    if missing is not None:
        breaks["a missing key"] = (edited(raw, missing, delete=True), key_of(missing))
    for what, (broken, key) in breaks.items():
        path.write_text(json.dumps(broken))
        with pytest.raises(CheckpointError) as err:
            read(model, path)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{path}: {key}"), (what, message)


MANIFEST = {"format": "islands-shards/1", "examples": 0, "shape": [4, 2, 2], "num_classes": 0, "flip": False,
            "x": "mean.npy", "members": ["mean.npy", "logvar.npy"], "shard_size": 1, "sha256": SHA, "shards": []}
LATENTS = {"autoencoder_sha256": SHA, "scaling_factor": 0.18, "shift_factor": None, "latent_shape": [2, 2, 2],
           "image_shape": [3, 16, 16], "flipped": False, "dtype": "float32"}
CAPTIONS = {"text_encoder": "minilm", "sha256": SHA, "tokens": 8, "width": 384, "pooled_width": 384,
            "shape": [9, 385], "dtype": "float32"}


@pytest.mark.parametrize("section, body, missing, wrong", [
    ("latents", LATENTS, "flipped", ("image_shape", "3x16x16")),
    ("caption_embeddings", CAPTIONS, "tokens", ("sha256", 1)),
])
def test_the_manifests_latents_and_caption_sections_are_typed_and_refused_by_key(section, body, missing, wrong,
                                                                                 tmp_path):
    path = tmp_path / "manifest.json"
    manifest = ShardManifest.read({**MANIFEST, section: body}, path)
    typed = getattr(manifest, section)
    assert isinstance(typed, LatentsSection if section == "latents" else CaptionEmbeddings)
    assert typed.model_dump() == body
    for broken, key in (({k: v for k, v in body.items() if k != missing}, missing),
                        ({**body, wrong[0]: wrong[1]}, wrong[0])):
        with pytest.raises(DataError) as err:
            ShardManifest.read({**MANIFEST, section: broken}, path)
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"shard manifest {path}: {section}.{key}: "), message
    with pytest.raises(DataError, match=rf"^shard manifest {path}: format: "):  # the manifest's version
        ShardManifest.read({**MANIFEST, "format": "islands-shards/9", section: body}, path)


def test_a_log_line_is_typed_and_a_bad_one_is_named_by_its_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"images": 8, "loss": 0.5, "images_per_s": 100.0}\n\n'
                                            '{"images": 16, "loss": 0.25}\n')
    lines = read_log(tmp_path)
    assert [line.images for line in lines] == [8, 16] and [line.images_per_s for line in lines] == [100.0, None]
    assert lines[1].values == {"images": 16, "loss": 0.25}
    (tmp_path / "metrics.jsonl").write_text('{"images": 8}\n{"loss": 0.5}\n')
    with pytest.raises(CheckpointError) as err:
        read_log(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'metrics.jsonl'}, line 2: images: ")
    with pytest.raises(CheckpointError, match=": images: "):
        LogLine.parse(b'{"images": "many"}', "metrics.jsonl")


def test_an_ensemble_manifest_of_an_unknown_version_is_refused_by_name(tmp_path):
    entry = {"name": "router"}
    raw = {"version": 1, "k": 1, "prior": [1.0], "experts": [{"name": "expert0"}], "router": entry}
    assert EnsembleManifest.read(raw, tmp_path / "ensemble.json").version == 1
    with pytest.raises(CheckpointError, match=r"ensemble.json: version: 2 is not a version this Islands reads"):
        EnsembleManifest.read({**raw, "version": 2}, tmp_path / "ensemble.json")


def test_the_latents_of_a_url_data_path_are_read_from_the_url(monkeypatch):
    """`stored_latents` hands data.path to the manifest's reader as written: `Path` would fold s3:// into s3:/."""
    from types import SimpleNamespace

    from islands.data import latents

    asked = []
    monkeypatch.setattr(latents, "read_manifest", lambda path: asked.append(str(path)) or SimpleNamespace(latents=None))
    cfg = SimpleNamespace(data=SimpleNamespace(source="shards", path="s3://bucket/latents"))
    assert latents.stored_latents(cfg) is None and asked == ["s3://bucket/latents"]
