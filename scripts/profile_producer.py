"""Call one producer arm of the producers benchmark, for Nsight Compute to profile one launch.

    ncu -k regex:_rms_norm_kernel --launch-skip 10 --launch-count 1 --set full --clock-control none \
        python scripts/profile_producer.py --producer q_norm --rows 2048 --arm fp8

The arms are ``benchmark/producers.py``'s (the same shapes, buffers and format): ``bf16`` the
bf16-only launch, ``fp8`` the FP8-emitting one. Each call launches one kernel.
"""

import argparse
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT / "python", _ROOT / "sgl-kernel", _ROOT / "benchmark"):
    sys.path.insert(0, str(_p))

from fp8chain_kernel.formats import ActFormat  # noqa: E402
from producers import PRODUCERS, Case  # noqa: E402  (benchmark/producers.py)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producer", choices=PRODUCERS, default="q_norm")
    parser.add_argument("--rows", type=int, default=2048, help="tokens T")
    parser.add_argument("--arm", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_producer needs a CUDA GPU")
    case = Case(args.producer, args.rows, ActFormat.SM90_G32_FP32_MN, torch.device("cuda"))
    call = case.bf16 if args.arm == "bf16" else case.fp8
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(args.producer, case.shape, f"T={args.rows}", args.arm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
