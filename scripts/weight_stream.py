#!/usr/bin/env python3
"""How fast int4_linear streams a model's weights from memory, as decode reads them: every layer's matrices
once a pass, more bytes than any cache holds, mapped from a file as `spark-edge serve` maps them (#35) or in
anonymous memory as vLLM's offline engine holds them. Prints GB/s a pass; nothing is written.

    .venv/bin/python scripts/weight_stream.py [--like smollm2-1.7b|default] [--rows 1,4] [--passes 3]

Random codes in the kernels' layout, group 32, 2 threads (a serving host's). For choosing a kernel's memory
behaviour (prefetch distance and target) on a host kind, alternate builds in one sitting: the bandwidth a VM
gives drifts by +-20% within minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

GROUP = 32
# (N, K) of one decoder layer's int4 matrices (qkv, o, gate_up, down) and the layer count
SHAPES = {
    "smollm2-1.7b": ([(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 24),
    "default": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
}


def _random_layers(like: str) -> dict[str, torch.Tensor]:
    from spark_edge.formats import tinygemm_layout as tl

    shapes, layers = SHAPES[like]
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for i, (n, k) in enumerate(shapes):
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
            scales = (torch.rand(n, k // GROUP, generator=gen) * 0.01).to(torch.bfloat16)
            zeros = (torch.randn(n, k // GROUP, generator=gen) * 0.01).to(torch.bfloat16)
            tensors[f"{layer}.{i}.w"] = tl.pack_for_kernel(codes)
            tensors[f"{layer}.{i}.sz"] = tl.scales_and_zeros(scales, zeros)
    return tensors


def _best_pass(matrices: list[tuple[int, torch.Tensor, torch.Tensor]], rows: int, passes: int) -> float:
    ops = torch.ops.spark_edge
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k, _, _ in matrices}

    def one_pass() -> None:
        for k, w, sz in matrices:
            ops.int4_linear(xs[k], w, sz, GROUP)

    one_pass()  # first touch, thread pool
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", choices=sorted(SHAPES), default="smollm2-1.7b")
    parser.add_argument("--rows", default="1,4", help="activation rows per call, comma-separated")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()

    from safetensors import safe_open
    from safetensors.torch import save_file

    from spark_edge.kernels import cpu_int4_op
    from spark_edge.plugin import register

    register()
    if not cpu_int4_op.register_ops():
        print("weight_stream: the native int4 ops are not available on this host", file=sys.stderr)
        return 1
    torch.set_num_threads(2)
    tensors = _random_layers(args.like)
    shapes, layers = SHAPES[args.like]
    names = [(f"{layer}.{i}", k) for layer in range(layers) for i, (_, k) in enumerate(shapes)]
    anonymous = [(k, tensors[f"{n}.w"], tensors[f"{n}.sz"]) for n, k in names]
    nbytes = sum(w.nbytes + sz.nbytes for _, w, sz in anonymous)
    with tempfile.TemporaryDirectory(dir=Path.home()) as folder:  # the home's file system, as a data folder's
        path = Path(folder) / "weights.safetensors"
        save_file(tensors, str(path))
        with safe_open(str(path), framework="pt") as f:
            mapped = [(k, f.get_tensor(f"{n}.w"), f.get_tensor(f"{n}.sz")) for n, k in names]
        print(f"{args.like}: {len(names)} matrices, {nbytes / 2**20:.0f} MiB a pass, group {GROUP}, 2 threads")
        for rows in (int(r) for r in args.rows.split(",")):
            for label, matrices in (("mapped", mapped), ("anonymous", anonymous)):
                seconds = _best_pass(matrices, rows, args.passes)
                print(f"  {rows} row(s), {label}: {seconds * 1e3:.2f} ms a pass, {nbytes / seconds / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
