"""A run whose config was written by an older Islands, which lacked keys this one has, resumes: a missing key is
read as this Islands reads that config (islands/config.py, trajectory_changes)."""

from pathlib import Path

import pytest
import yaml

from islands.config import flatten, to_dict, validate
from islands.errors import ConfigError
from islands.rundir import CONFIG, prepare_run_dir

NEW_KEYS = {"data": ("order", "block", "window"),  # issue 38
            "parallel": ("warm_start_images", "sync_every_start", "sync_every_ramp_images", "overlap_steps",
                         "mixing", "inner_state", "outer_ema")}  # issue 40


def written_before(cfg) -> dict:
    """The config as an Islands without NEW_KEYS wrote it."""
    raw = to_dict(cfg)
    for section, keys in NEW_KEYS.items():
        for key in keys:
            del raw[section][key]
    return raw


@pytest.fixture
def diloco(tmp_path):
    return validate({"run_dir": str(tmp_path / "run"), "parallel": {"strategy": "diloco", "sync_every": 10}})


def test_a_run_written_before_keys_existed_resumes_with_their_defaults(diloco):
    old = written_before(diloco)
    assert set(flatten(to_dict(diloco))) - set(flatten(old))  # the keys really are missing
    (Path(diloco.run_dir) / CONFIG).parent.mkdir(parents=True)
    (Path(diloco.run_dir) / CONFIG).write_text(yaml.safe_dump(old))
    prepare_run_dir(diloco, write=False, bound=True)  # no ConfigError


@pytest.mark.parametrize("changed", [{"parallel": {"inner_state": "reset"}}, {"data": {"order": "blocks"}}])
def test_a_key_it_lacked_set_away_from_its_default_is_still_a_change(diloco, changed):
    (Path(diloco.run_dir) / CONFIG).parent.mkdir(parents=True)
    (Path(diloco.run_dir) / CONFIG).write_text(yaml.safe_dump(written_before(diloco)))
    raw = to_dict(diloco)
    for section, values in changed.items():
        raw[section].update(values)
    key = next(iter(next(iter(changed.values()))))
    with pytest.raises(ConfigError, match=rf"another config \(\w+\.{key}: "):
        prepare_run_dir(validate(raw), write=False, bound=True)
