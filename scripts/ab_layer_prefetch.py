"""The layer benchmark's decode step with and without L2 weight prefetch (``layers.prefetch``).

For each shape set and M, both arms (chained, unchained) with each set of prefetch points, all
graphs of one case replayed in turn (``harness.replay_times_us``). Diagnostic: prints a table,
writes JSON.

    python scripts/ab_layer_prefetch.py --shapes tp1 tp4 --rows 1 2 4 8 16 64 --json-out $OUT/x.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT / "python", _ROOT / "sgl-kernel", _ROOT / "benchmark"):
    sys.path.insert(0, str(_p))

from fp8chain.bench import harness  # noqa: E402
from layer import ARMS, LayerUnit, build_layers, layer_config, weight_bytes  # noqa: E402  (benchmark/layer.py)

PLANS = {
    "none": (),
    "boundary": ("boundary",),
    "boundary_wo_a": ("boundary", "wo_a"),
    "boundary_wo_a_wq_b": ("boundary", "wo_a", "wq_b"),
    "all": ("boundary", "wo_a", "wq_b", "down"),
}


def apply(layers, points):
    for layer in layers:
        layer.set_prefetch_points(points)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tp1", "tp4"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    bandwidth = harness.copy_bandwidth()
    records = []
    torch.manual_seed(0)
    for shapes in args.shapes:
        config = layer_config(shapes)
        layers = build_layers(config, "cuda")
        floor = weight_bytes(layers[0]) / bandwidth * 1e6
        for rows in args.rows:
            unit = LayerUnit(layers, config, rows, 1024, "cuda")
            graphs = {}
            with torch.no_grad():
                for plan in args.plans.split(","):
                    apply(layers, PLANS[plan])
                    for arm, on in ARMS:
                        unit.set_chain(on)
                        graphs[f"{arm}_{plan}"] = harness.capture_graph(unit.step, args.iters)
                apply(layers, PLANS["none"])
            times = harness.replay_times_us(graphs, args.iters, rounds=9)
            rec = {"shapes": shapes, "M": rows, "floor_us": floor, **{f"{k}_us": v for k, v in times.items()}}
            records.append(rec)
            print(shapes, rows, " ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
            del unit
        del layers
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"copy_bandwidth_TBps": bandwidth / 1e12, "records": records},
                                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
