"""Export and import: Islands' runs and ensembles as folders plain diffusers loads, and such folders read back.

run.py            `islands export RUN OUT/`: one run as its diffusers folder (islands_export.json records it)
ensemble.py       `islands export ENSEMBLE OUT/`: an ensemble in the open DDM layout (ddm.json indexes it)
imported.py       `islands import FOLDER ENSEMBLE/`: that layout read back, as untrusted, into an ensemble directory
diffusers_pipeline.py   copied verbatim into an exported ensemble as pipeline.py; imports nothing of Islands
records.py        islands_export.json and ddm.json as typed records
"""

from pathlib import Path

from islands.ddm.ensemble import MANIFEST
from islands.export.ensemble import export_ensemble
from islands.export.imported import import_ensemble
from islands.export.run import export_run

__all__ = ["export", "export_ensemble", "export_run", "import_ensemble"]


def export(target: Path, out: Path) -> Path:
    """`islands export` as a function: an ensemble directory in the open DDM layout, or a run as its diffusers
    folder."""
    target = Path(target)
    return export_ensemble(target, Path(out)) if (target / MANIFEST).exists() else export_run(target, Path(out))
