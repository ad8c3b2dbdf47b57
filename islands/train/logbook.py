"""Metrics to a JSONL file (one object per line, for scripts) and to TensorBoard (for people)."""

import json
from pathlib import Path


class Logbook:
    def __init__(self, run_dir: Path, name: str = "metrics", tensorboard: bool = True):
        self.path = Path(run_dir) / f"{name}.jsonl"
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when used

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), filename_suffix=f".{name}")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "images" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, global_step=record["images"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path, name: str = "metrics") -> list[dict]:
    """The training log (metrics.jsonl) or, with name="eval", the evaluations made during training."""
    path = Path(run_dir) / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
