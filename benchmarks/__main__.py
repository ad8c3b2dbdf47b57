"""Run the benchmarks: `python -m benchmarks` runs them all, `python -m benchmarks precision` one of them.

A single benchmark takes its own options after its name (`python -m benchmarks data_scale 100000 --skip-partition`):
it reads them from sys.argv itself.

Each prints its table, writes benchmarks/results/<name>.json and any figure to docs/figures/.
"""

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS

BENCHMARKS = ["trainer_overhead", "precision", "activation_checkpointing", "networks", "parallel", "fd_scale",
              "mode_weights", "samplers", "ddm_routing", "routed_sampling", "ddm_gmm", "ddm_fashion", "pipeline",
              "range_experts", "distributed_sampling", "plan", "error_vs_dimension", "local_updates", "gpu",
              "sampling_e2e", "loader", "low_res_first", "autoencoder", "latent_vs_pixel", "text_encoder",
              "condition_router", "ddm_text", "ddm_export", "data_startup", "cascade", "object_storage", "data_scale",
              "collectives", "ddm_budget", "diloco_candidates"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="name",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.parse_known_args()  # --help
    given = sys.argv[1:]
    names = [a for a in given if a in BENCHMARKS] or BENCHMARKS
    options = [a for a in given if a not in BENCHMARKS]
    for before, option in zip(["", *given], given, strict=False):
        if option not in BENCHMARKS and not (option.startswith("-") or before.startswith("-")
                                             or option.replace(".", "").isdigit()):
            parser.error(f"unknown benchmark {option!r}; choose from {', '.join(BENCHMARKS)}")
    if options and len(names) != 1:
        parser.error(f"options {' '.join(options)} go with one benchmark, not {len(names)}")
    suite_start = time.perf_counter()
    verdicts = []
    for name in names:
        print(f"\n== {name} ==", flush=True)
        start = time.perf_counter()
        result = importlib.import_module(f"benchmarks.{name}").run()
        seconds = time.perf_counter() - start
        if result.get("skipped"):  # nothing to measure on this machine (gpu without a GPU): nothing written
            verdicts.append((name, None, seconds))
            continue
        # the run's duration goes with its figures, in the file it saved them to (a part of a benchmark: its own)
        path = Path(result.get("saved", RESULTS / f"{name}.json"))
        path.write_text(json.dumps({**json.loads(path.read_text()), "seconds": round(seconds)}, indent=2) + "\n")
        verdicts.append((name, result["met"], seconds))
        print(f"({seconds:.0f} s; {path.relative_to(RESULTS.parent.parent)})", flush=True)
    print("\n== summary ==")
    for name, met, seconds in verdicts:
        verdict = "skipped" if met is None else f"target {'met' if met else 'NOT met'}"
        print(f"{name:26s} {verdict:15s} {seconds:5.0f} s")
    print(f"{'total':26s} {'':15s} {time.perf_counter() - suite_start:5.0f} s")


if __name__ == "__main__":
    main()
