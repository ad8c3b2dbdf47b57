"""Prompt following (islands/eval/prompt_following.py) and Islands' contrastive judge (islands/eval/contrastive.py)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import emoji_or_skip, write_config

from islands.cli import main
from islands.config import validate
from islands.data.sources import _ArraySource
from islands.eval.prompt_following import HELD_OUT, PromptJudge, held_out, is_held_out, prompt_following


class TableJudge(PromptJudge):
    """Captions embedded by a fixed table: what the ranks are can be worked out by hand."""

    name, clip_score = "table", True

    def __init__(self, table: dict):
        self.table = table

    def images(self, x):
        return F.normalize(x.float(), dim=-1)

    def texts(self, captions):
        return F.normalize(torch.tensor([self.table[c] for c in captions], dtype=torch.float32), dim=-1)


def test_each_sample_is_ranked_by_its_own_prompt_among_the_distinct_prompts():
    judge = TableJudge({"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [-1.0, 0.0]})
    images = F.normalize(torch.tensor([[1.0, 0.1], [1.0, 0.1], [0.0, 1.0], [1.0, 1.0]]), dim=-1)
    # cosines: image 0 and 1 (0.995 to a, 0.0995 to b, -0.995 to c); image 2 (0, 1, 0); image 3 (0.707, 0.707, -0.707)
    prompts = ["a", "b", "b", "c"]
    out = prompt_following(images, prompts, judge)
    ranks = [1, 2, 1, 3]  # image 0: a first; image 1: b after a; image 2: b first; image 3: c last of three
    assert out["prompt_choices"] == 3
    assert out["prompt_rank"] == pytest.approx(np.mean(ranks))
    assert out["prompt_top1"] == pytest.approx(0.5) and out["prompt_top5"] == 1.0
    cosines = [0.995037, 0.0995037, 1.0, -0.707107]
    assert out["clip_score"] == pytest.approx(100 * np.mean(np.maximum(cosines, 0)), rel=1e-5)


def test_a_tie_counts_against_the_image():
    judge = TableJudge({"a": [1.0, 0.0], "b": [1.0, 0.0]})  # two prompts the judge cannot tell apart
    out = prompt_following(F.normalize(torch.ones(2, 2), dim=-1), ["a", "b"], judge)
    assert out["prompt_top1"] == 0.0 and out["prompt_rank"] == 2.0


def test_the_held_out_fifth_is_chosen_by_the_caption_alone():
    captions = [f"caption number {i}" for i in range(2000)]
    chosen = held_out(captions)
    assert abs(len(chosen) / len(captions) - 1 / HELD_OUT) < 0.03
    # the same caption falls on the same side wherever it is
    reversed_ = captions[::-1]
    assert [reversed_[i] for i in held_out(reversed_)] == [captions[i] for i in chosen][::-1]
    assert all(is_held_out(captions[i]) for i in chosen)


class Coloured(_ArraySource):
    """Squares of one colour each, captioned by it: a judge can only rank a colour it never saw by its words."""

    def __init__(self, names: list[str], rgb: list[tuple]):
        x = torch.tensor(rgb, dtype=torch.float32)[:, :, None, None].expand(-1, -1, 8, 8).clone() * 2 - 1
        super().__init__(x, None, 0)
        self.names, self.holds = names, self.holds | {"caption"}

    def read(self, indices, fields):
        return {**super().read(indices, fields), **({"caption": [self.names[i] for i in indices]}
                                                     if "caption" in fields else {})}


def test_the_contrastive_judge_learns_which_caption_goes_with_which_image():
    emoji_or_skip()  # the bundled text encoder comes with the text extra, as the emoji do
    from islands.eval.contrastive import load_judge

    gen = torch.Generator().manual_seed(0)
    rgb = torch.rand(96, 3, generator=gen)
    words = [("dark", "red"), ("dim", "green"), ("flat", "blue")]
    names = [f"colour {i}: " + " ".join(pair[int(v > 0.5)] for pair, v in zip(words, c, strict=True))
             for i, c in enumerate(rgb.tolist())]
    source = Coloured(names, rgb.tolist())
    judge = load_judge(source, seed=0, epochs=40)
    kept = [i for i in range(len(source)) if not is_held_out(names[i])]
    trained = prompt_following(judge.images(source.get(kept)[0]), [names[i] for i in kept], judge)
    shuffled = prompt_following(judge.images(source.get(kept[::-1])[0]), [names[i] for i in kept], judge)
    assert trained["prompt_top5"] > 0.5 > 0.2 > shuffled["prompt_top5"]  # chance: 5 of 77
    # cached under the data, the encoder, the seed and the epochs: loaded again, not trained again
    again = load_judge(source, seed=0, epochs=40)
    assert again.name == judge.name
    torch.testing.assert_close(again.images(source.get([0])[0]), judge.images(source.get([0])[0]))


def test_islands_eval_of_a_text_run_samples_the_held_out_prompts_and_scores_their_following(tmp_path, capsys):
    emoji_or_skip()
    from test_text_conditioning import emoji_run

    raw = emoji_run(tmp_path / "run", images=32)
    raw["eval"] = {"num": 8, "judge_epochs": 2}
    assert main(["train", write_config(tmp_path / "c.yaml", raw), "--quiet"]) == 0
    assert main(["eval", str(tmp_path / "run"), "--metrics", "fd", "prompt_following", "--quiet"]) == 0
    found = json.loads((tmp_path / "run" / "metrics.json").read_text())
    (key, result), = found.items()
    assert "features=contrastive-" in key  # the captioned set's default features: the judge's image tower
    cfg = validate(raw)
    from islands.data import build_data
    from islands.eval.evaluate import Evaluator

    evaluator = Evaluator(build_data(cfg.data, cfg.seed), cfg.eval, cfg.seed)
    prompts = evaluator.prompts(8)
    assert all(is_held_out(p) for p in prompts)
    assert result["prompt_choices"] == len(set(prompts)) and 1 <= result["prompt_rank"] <= len(set(prompts))
    assert result["prompt_judge"].startswith("contrastive-")
