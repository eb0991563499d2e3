#!/usr/bin/env python3
"""How fast int4_linear streams a model's weights from memory, as decode reads them: every layer's matrices
once a pass, more bytes than any cache holds, mapped from a file as `spark-edge serve` maps them (#35) or in
anonymous memory as vLLM's offline engine holds them. Prints GB/s a pass; nothing is written.

    .venv/bin/python scripts/weight_stream.py [--like smollm2-1.7b | --config CHECKPOINT/config.json]
                                              [--rows 1,4] [--passes 3]

The geometry is a `spark-edge synth` preset's or a checkpoint's config.json (the default model: its built
folder's); the decoder layers' four int4 matrices of bench --kernels' shapes, with random codes in the kernels'
layout, group 32, 2 threads (a serving host's). For choosing a kernel's memory
behaviour (prefetch distance and target) on a host kind, alternate builds in one sitting: the bandwidth a VM
gives drifts by +-20% within minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from spark_edge.checkpoints.synth import PRESETS, hf_config  # noqa: E402

GROUP = 32


def _config(like: str, config_path: Path | None) -> dict:
    if config_path is not None:
        return json.loads(config_path.read_text())
    return hf_config(like, PRESETS[like], seed=0, bos=0, eos=0)


def _int4_matrices(config: dict) -> list[tuple[str, int, int]]:
    """(tensor name, N, K) of every decoder layer's int4 matrices: the head and embedding are not int4_linear's."""
    from spark_edge.bench.kernels import model_shapes

    shapes = [(n, k) for name, n, k in model_shapes(config) if name != "lm_head"]
    return [(f"{layer}.{i}", n, k) for layer in range(config["num_hidden_layers"]) for i, (n, k) in enumerate(shapes)]


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
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--like", choices=sorted(PRESETS), default="smollm2-1.7b", help="a synth preset's geometry")
    source.add_argument("--config", type=Path, help="a checkpoint's config.json")
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
    from spark_edge.bench.kernels import random_kernel_weight

    layers = _int4_matrices(_config(args.like, args.config))
    gen = torch.Generator().manual_seed(0)
    tensors, anonymous = {}, []
    for name, n, k in layers:
        w, sz = random_kernel_weight(n, k, GROUP, gen)
        tensors[f"{name}.w"], tensors[f"{name}.sz"] = w, sz
        anonymous.append((k, w, sz))
    nbytes = sum(w.nbytes + sz.nbytes for _, w, sz in anonymous)
    with tempfile.TemporaryDirectory(dir=Path.home()) as folder:  # the home's file system, as a data folder's
        path = Path(folder) / "weights.safetensors"
        save_file(tensors, str(path))
        with safe_open(str(path), framework="pt") as f:
            mapped = [(k, f.get_tensor(f"{name}.w"), f.get_tensor(f"{name}.sz")) for name, _, k in layers]
        what = args.config or args.like
        print(f"{what}: {len(layers)} matrices, {nbytes / 2**20:.0f} MiB a pass, group {GROUP}, 2 threads")
        for rows in (int(r) for r in args.rows.split(",")):
            for label, matrices in (("mapped", mapped), ("anonymous", anonymous)):
                seconds = _best_pass(matrices, rows, args.passes)
                print(f"  {rows} row(s), {label}: {seconds * 1e3:.2f} ms a pass, {nbytes / seconds / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
