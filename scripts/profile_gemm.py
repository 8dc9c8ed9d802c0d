"""Call one DSv4.1 decode GEMM with its table config, for Nsight Compute to profile one launch.

    ncu -k regex:_block_scaled --launch-skip 20 --launch-count 1 --set full \
        python scripts/profile_gemm.py --shape wqkv_a --m 1

The weights rotate through four copies (each call streams its weights from HBM, as in a decode
step); the activation pair is quantized once up front. Prints the config the table picked.
"""

import argparse
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT / "python", _ROOT / "sgl-kernel", _ROOT / "benchmark"):
    sys.path.insert(0, str(_p))

from fp8chain_kernel import gemm, quant, reference  # noqa: E402
from fp8chain_kernel.formats import ActFormat  # noqa: E402
from gemm import SHAPES  # noqa: E402  (benchmark/gemm.py)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="wqkv_a")
    parser.add_argument("--m", type=int, default=1, help="tokens")
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_gemm needs a CUDA GPU")
    n, k = SHAPES[args.shape]
    weights = [reference.random_fp8_weight(n, k, 32, "cuda") for _ in range(4)]
    pair = quant.quantize(torch.randn(args.m, k, device="cuda").bfloat16(), ActFormat.SM90_G32_FP32_MN)
    print(args.shape, f"M={args.m}", gemm.select_config(args.m, n, k, 32, torch.device("cuda")))
    for i in range(args.calls):
        w, s = weights[i % len(weights)]
        gemm.fp8_gemm(pair, w, s, weight_block=32)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
