"""The commands that take a folder take it as a URL too (islands/data/storage.py): a `file://` URL is the local
folder it names, as fsspec reads one, for `islands shard`, `islands index` and `islands verify` alike. (A URL that
went through `pathlib.Path` loses a slash of its `//`: `file:///tmp/x` would become a folder `file:` here.)"""

from conftest import write_config

from islands.cli import main


def test_shard_index_and_verify_take_a_file_url_as_the_folder_it_names(tmp_path, image_npz, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path / "..")  # where a misread URL would make its folder `file:`
    config = write_config(tmp_path / "npz.yaml", {"run_dir": str(tmp_path / "r"),
                                                  "data": {"source": "npz", "path": str(image_npz)}})
    assert main(["shard", config, f"file://{tmp_path}/shards", "--shard-size", "10", "--quiet"]) == 0
    assert main(["index", f"file://{tmp_path}/shards", f"file://{tmp_path}/index", "--quiet"]) == 0
    assert main(["verify", f"file://{tmp_path}/index", "--quiet"]) == 0
    assert len(list((tmp_path / "shards").glob("*.tar"))) == 7 and (tmp_path / "index" / "manifest.json").is_file()
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"file://{tmp_path}/index: all 64 examples good (every member's sha256 and every image checked)")
    assert not (tmp_path / ".." / "file:").exists()
