"""w4a8: the symmetric quantizer, the AutoGPTQ layout, the checkpoint writer, and the
written tensors run through vLLM's own GPTQ linear method and CPU kernels.

The kernel tests load exported tensors with vLLM's real weight loaders and let vLLM's
CPUWNA16 kernel repack them (its process_weights_after_loading), so what is checked is
exactly what a served model computes:
  - AMX W4A8 (`int4_scaled_mm_cpu`): needs AMX tiles; skipped with the reason elsewhere.
  - W4A16 `cpu_gemm_wna16` with VLLM_CPU_INT4_W4A8=0 (isa "amx" on an AMX host).
  - W4A16 `cpu_gemm_wna16` "vec": what an x86 host without AMX (e.g. AMD Zen 4) runs;
    forced here by reporting no AMX to vLLM while it processes and runs the layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spark_edge.checkpoints.hf_source import HFSource
from spark_edge.errors import CheckpointError
from spark_edge.formats import gptq_layout as gl
from spark_edge.formats import int4_sym as s4
from spark_edge.weight_paths import NAMES, writers
from spark_edge.weight_paths.w4a8 import REPORT_NAME, quantization_config, write_w4a8

from conftest import single_process_tp_group

AMX = torch.cpu._is_amx_tile_supported()
NO_AMX_REASON = (
    "this CPU has no usable AMX tiles (torch.cpu._is_amx_tile_supported() is False): "
    "vLLM runs GPTQ as W4A16 (cpu_gemm_wna16) here, never the AMX W4A8 kernel"
)

# A tiny Llama shaped like the default model where it matters: hidden 192 is not a
# multiple of 128, so the default group size falls back to 64 (SmolLM: 576 -> 64).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 192, 6, 2, 32, 384, 256, 2


# ----------------------------------------------------------------------------- helpers


def _weights(n: int, k: int, seed: int, heavy: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if heavy:  # heavy tails (Student t, 3 degrees of freedom): where clipping outliers pays
        chi2 = torch.randn(3, n, k, generator=g).square().sum(0)
        return torch.randn(n, k, generator=g) / (chi2 / 3).sqrt() * 0.02
    return torch.randn(n, k, generator=g) * 0.02


def _grid_error(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Squared error per group of the symmetric grid `scale` (fp32 [N, G]), written out plainly."""
    n, groups = scale.shape
    grouped = w.view(n, groups, -1)
    s = scale.unsqueeze(-1)
    q = torch.clamp(torch.round(grouped / s) + 8, 0, 15)
    return ((q - 8) * s - grouped).square().sum(-1)


def _search_errors(w: torch.Tensor, group_size: int, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    chunks = list(s4.quantize_rows(w, group_size, search))
    codes = torch.cat([c.groups.codes for c in chunks])
    scale = torch.cat([c.groups.scale for c in chunks])
    err = (s4.dequantize(codes, scale, group_size) - w).square().view(n, k // group_size, -1).sum(-1)
    return err, scale


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


# ----------------------------------------------------------------------------- quantizer


@pytest.mark.parametrize("search", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_codes_in_range_on_a_symmetric_grid(group_size: int, search: bool) -> None:
    w = _weights(96, 256, seed=1)
    w[3, :group_size] = 0.0  # an all-zero group
    chunks = list(s4.quantize_rows(w, group_size, search, chunk_elements=4096))
    codes = torch.cat([c.groups.codes for c in chunks])
    scale = torch.cat([c.groups.scale for c in chunks])
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scale.dtype == torch.bfloat16 and scale.shape == (96, 256 // group_size)
    deq = s4.dequantize(codes, scale, group_size)
    # every value is an integer step of its group's scale in [-8, 7]: the zero point is 8
    steps = deq.view(96, -1, group_size) / scale.float().unsqueeze(-1).where(scale.float().unsqueeze(-1) != 0, 1.0)
    assert torch.equal(steps, steps.round()) and steps.min() >= -8 and steps.max() <= 7
    assert torch.all(codes[3, :group_size] == 8) and torch.all(deq[3, :group_size] == 0)
    assert s4.snr_db(w, deq) > 17.0  # 4-bit on Gaussian weights is ~20 dB


def test_plain_grid_puts_each_groups_extreme_exactly_on_code_0() -> None:
    w = _weights(64, 256, seed=2)
    (chunk,) = s4.quantize_rows(w, 64, search=False)
    grouped = w.view(64, 4, 64)
    idx = grouped.abs().argmax(-1, keepdim=True)
    codes_at_extreme = chunk.groups.codes.view(64, 4, 64).gather(-1, idx)
    assert torch.all(codes_at_extreme == 0)
    # the scale's sign follows the extreme's: the 8-level side always holds it
    assert torch.equal(torch.sign(chunk.groups.scale.float()), -torch.sign(grouped.gather(-1, idx).squeeze(-1)))


@pytest.mark.parametrize("heavy", [False, True], ids=["gaussian", "heavy-tailed"])
def test_search_is_never_worse_than_plain_amax_grids(heavy: bool) -> None:
    w = _weights(128, 512, seed=3, heavy=heavy)
    g = 64
    amax = w.view(128, -1, g).abs().amax(-1)
    err_search, _ = _search_errors(w, g, search=True)
    err_plain, _ = _search_errors(w, g, search=False)
    for divisor in (7.0, 8.0):  # the classic positive grids
        err_base = _grid_error(w, (amax / divisor).to(torch.bfloat16).float())
        assert torch.all(err_search <= err_base * (1 + 1e-6)), f"worse than amax/{divisor} on some group"
    assert torch.all(err_search <= err_plain * (1 + 1e-6))
    # and it is a real gain overall, not only a tie
    assert err_search.sum() < 0.97 * err_plain.sum()


def test_search_snr_on_gaussian_weights() -> None:
    w = _weights(256, 512, seed=4)
    plain = gl.quantize(w, 64, search=False)
    best = gl.quantize(w, 64, search=True)
    assert 19.5 < plain.snr_db < best.snr_db < 22.0
    # the reported SNR is the SNR of what is stored
    assert best.snr_db == pytest.approx(s4.snr_db(w, gl.dequantize_weight(best)), abs=1e-3)


def test_codes_are_chosen_against_the_stored_bf16_scale() -> None:
    w = _weights(32, 128, seed=5)
    (chunk,) = s4.quantize_rows(w, 32, search=True)
    scale = chunk.groups.scale.float()
    nearest = torch.clamp(torch.round(w.view(32, 4, 32) / scale.unsqueeze(-1)) + 8, 0, 15).to(torch.uint8)
    assert torch.equal(chunk.groups.codes, nearest.view(32, 128))


def test_chunking_does_not_change_the_result() -> None:
    w = _weights(304, 128, seed=6)  # 7-row chunks: the last one is ragged
    whole = gl.quantize(w, 32, chunk_elements=1 << 30)
    chunked = gl.quantize(w, 32, chunk_elements=7 * 128)
    for name, t in whole.tensors().items():
        assert torch.equal(t, chunked.tensors()[name]), name


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the group size"):
        gl.quantize(_weights(32, 96, seed=7), 64)
    with pytest.raises(ValueError, match="N=36 is not a multiple of 8"):
        gl.quantize(_weights(36, 128, seed=7), 32)
    w = _weights(32, 128, seed=7)
    w[5, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gl.quantize(w, 32)


# ----------------------------------------------------------------------------- layout


def test_pack_unpack_round_trip_both_axes() -> None:
    values = torch.randint(0, 16, (64, 48), generator=torch.Generator().manual_seed(8), dtype=torch.uint8)
    values[:8, 0] = 15  # top nibble set: the int32 word is negative
    assert torch.equal(gl.unpack_along_dim0(gl.pack_along_dim0(values)), values)
    assert torch.equal(gl.unpack_along_dim1(gl.pack_along_dim1(values)), values)
    assert int(gl.pack_along_dim0(values)[0, 0]) == _int32(
        0xFFFFFFFF & sum(int(values[i, 0]) << 4 * i for i in range(8))
    )


def test_gptq_tensors_layout() -> None:
    n, k, g = 64, 256, 64
    w = _weights(n, k, seed=9)
    q = gl.quantize(w, g)
    (chunk,) = s4.quantize_rows(w, g)
    codes = chunk.groups.codes  # [N, K]
    assert q.qweight.dtype == torch.int32 and q.qweight.shape == (k // 8, n)
    assert q.qzeros.dtype == torch.int32 and q.qzeros.shape == (k // g, n // 8)
    assert q.scales.dtype == torch.bfloat16 and q.scales.shape == (k // g, n)
    assert q.g_idx.dtype == torch.int32 and torch.equal(q.g_idx, torch.arange(k, dtype=torch.int32) // g)
    # word [j, col] holds input rows 8j..8j+7 of output column col, nibble i at bits 4i
    for j, col in ((0, 0), (5, 17), (31, 63)):
        expected = sum(int(codes[col, 8 * j + i]) << (4 * i) for i in range(8))
        assert int(q.qweight[j, col]) == _int32(expected)
    assert torch.equal(q.scales, chunk.groups.scale.t())
    assert gl.tensor_shapes(n, k, g) == {name: (t.dtype, tuple(t.shape)) for name, t in q.tensors().items()}


def test_qzeros_follow_the_gptq_v1_convention() -> None:
    """v1 ("gptq") stores zero point - 1: symmetric 4-bit is 7 in every nibble."""
    q = gl.quantize(_weights(64, 128, seed=10), 32)
    assert torch.all(q.qzeros == 0x77777777)
    assert torch.all(gl.stored_zero_points(q) == 8)
    # a v1 reader (zero = stored + 1) decodes exactly the symmetric grid that was scored
    (chunk,) = s4.quantize_rows(_weights(64, 128, seed=10), 32)
    assert torch.equal(gl.dequantize_weight(q), s4.dequantize(chunk.groups.codes, chunk.groups.scale, 32))


def test_bits_per_weight() -> None:
    # codes 4 + bf16 scale 16/g + qzeros 4/g + g_idx 32/N
    assert gl.bits_per_weight(576, 576, 64) == pytest.approx(4 + 20 / 64 + 32 / 576)


# ----------------------------------------------------------------------------- tiny model


def _tiny_tensors(seed: int, tied: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16) + rnd(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = rnd(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rnd(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rnd(HIDDEN, HEADS * HEAD_DIM)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16) + rnd(HIDDEN)
        t[p + "mlp.gate_proj.weight"] = rnd(INTER, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rnd(INTER, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rnd(HIDDEN, INTER)
    t["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    if not tied:
        t["lm_head.weight"] = rnd(VOCAB, HIDDEN)
    return t


def _tiny_config(tied: bool) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tied,
    }


def _make_hf(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same model with qkv and gate/up stored fused (Phi-3 style names)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [t, tensors[name.replace(".q_proj.", ".k_proj.")], tensors[name.replace(".q_proj.", ".v_proj.")]]
            )
        elif ".gate_proj." in name:
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [t, tensors[name.replace(".gate_proj.", ".up_proj.")]]
            )
        else:
            out[name] = t
    return out


def _read(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("w4a8")
    source = _tiny_tensors(seed=11, tied=True)
    src = _make_hf(base / "src", source, _tiny_config(tied=True))
    out = base / "out"
    out.mkdir()
    extra = write_w4a8(HFSource(src), out, {})
    return {"source": source, "out": out, "extra": extra, "tensors": _read(out)}


def test_registered_as_a_weight_path() -> None:
    assert "w4a8" in NAMES and writers()["w4a8"] is write_w4a8


def test_config_and_default_group_size(tiny_tied: dict[str, Any]) -> None:
    extra = tiny_tied["extra"]
    assert extra["tie_word_embeddings"] is False
    assert extra["quantization_config"] == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 64,  # K = 192 and 384: 128 does not divide 192
        "desc_act": False,
        "sym": True,
        "lm_head": True,
        "checkpoint_format": "gptq",
        "static_groups": False,
    }
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.scalar_type import scalar_types

    cfg = AutoGPTQConfig.from_config(extra["quantization_config"])
    assert AutoGPTQConfig.override_quantization_method(extra["quantization_config"], None) == "auto_gptq"
    assert cfg.quant_type == scalar_types.uint4b8 and cfg.lm_head_quantized and not cfg.desc_act


def test_every_linear_and_the_head_quantized_rest_bf16(tiny_tied: dict[str, Any]) -> None:
    tensors, source = tiny_tied["tensors"], tiny_tied["source"]
    linears = [n[: -len(".weight")] for n in source if n.endswith("_proj.weight")] + ["lm_head"]
    assert len(linears) == 7 * LAYERS + 1
    expected = {f"{m}.{s}" for m in linears for s in ("qweight", "qzeros", "scales", "g_idx")}
    expected |= {n for n, t in source.items() if t.ndim == 1} | {"model.embed_tokens.weight"}
    assert set(tensors) == expected
    # the lookup table stays bf16, bit for bit
    assert torch.equal(tensors["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    for name in expected - {"model.embed_tokens.weight"}:
        if name.endswith((".qweight", ".qzeros", ".g_idx")):
            assert tensors[name].dtype == torch.int32, name
        else:
            assert tensors[name].dtype == torch.bfloat16, name


def test_untied_head_is_quantized_from_the_tied_table(tiny_tied: dict[str, Any]) -> None:
    t = tiny_tied["tensors"]
    head = gl.GPTQWeight(
        t["lm_head.qweight"], t["lm_head.qzeros"], t["lm_head.scales"], t["lm_head.g_idx"], 64, math.nan
    )
    assert head.shape == (VOCAB, HIDDEN)
    table = tiny_tied["source"]["model.embed_tokens.weight"].float()
    assert s4.snr_db(table, gl.dequantize_weight(head)) > 17.0


def test_untied_source_keeps_its_own_head(tmp_path: Path) -> None:
    source = _tiny_tensors(seed=12, tied=False)
    src = _make_hf(tmp_path / "src", source, _tiny_config(tied=False))
    out = tmp_path / "out"
    out.mkdir()
    write_w4a8(HFSource(src), out, {"group_size": 32, "search": True})
    t = _read(out)
    head = gl.GPTQWeight(
        t["lm_head.qweight"], t["lm_head.qzeros"], t["lm_head.scales"], t["lm_head.g_idx"], 32, math.nan
    )
    deq = gl.dequantize_weight(head)
    assert s4.snr_db(source["lm_head.weight"].float(), deq) > 17.0
    assert s4.snr_db(source["model.embed_tokens.weight"].float(), deq) < 1.0  # not the table
    assert t["lm_head.scales"].shape == (HIDDEN // 32, VOCAB)
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["search"] is True and report["group_size"] == 32
    # the searched grid is at least as close to the weights as the plain one
    plain = gl.quantize(source["lm_head.weight"].float(), 32, search=False)
    assert report["tensors"]["lm_head"]["snr_db"] >= round(plain.snr_db, 3)


def test_report(tiny_tied: dict[str, Any]) -> None:
    report = json.loads((tiny_tied["out"] / REPORT_NAME).read_text())
    assert report["group_size"] == 64 and report["search"] is False and report["scale_dtype"] == "bfloat16"
    assert report["lm_head_from"] == "model.embed_tokens.weight"
    assert report["quantization_config"] == quantization_config(64)
    assert len(report["tensors"]) == 7 * LAYERS + 1
    for name, entry in report["tensors"].items():
        assert 17.0 < entry["snr_db"] < 25.0, name
        n, k = entry["shape"]
        assert entry["bits_per_weight"] == pytest.approx(gl.bits_per_weight(n, k, 64), abs=1e-4)
    assert 4.3 < report["bits_per_weight"] < 4.5
    assert report["snr_db_min"] == min(e["snr_db"] for e in report["tensors"].values())


def test_fused_source_is_written_fused_where_vllm_loads_it_fused(tmp_path: Path, tiny_tied: dict[str, Any]) -> None:
    """Phi-3 stores the Llama block with qkv and gate/up fused, and vLLM's Phi-3 loads only the fused names: the
    GPTQ tensors stay fused, and are the unfused source's concatenated along N (dim 1; qzeros packs 8 channels a
    word and every part holds whole words), so vLLM's loader splits them back into the same weights."""
    phi3 = {**_tiny_config(tied=True), "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "pad_token_id": 0}
    src = _make_hf(tmp_path / "src", _fuse(tiny_tied["source"]), phi3)
    out = tmp_path / "out"
    out.mkdir()
    write_w4a8(HFSource(src), out, {})
    fused, plain = _read(out), tiny_tied["tensors"]
    parts = {
        ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
        ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj."),
    }
    unfused = {name for name in plain if any(p in name for group in parts.values() for p in group)}
    assert set(plain) - unfused == {n for n in fused if not any(f in n for f in parts)}
    for name, t in fused.items():
        whole = next((f for f in parts if f in name), None)
        if whole is None:
            assert torch.equal(t, plain[name]), name
            continue
        pieces = [plain[name.replace(whole, part)] for part in parts[whole]]
        want = pieces[0] if name.endswith(".g_idx") else torch.cat(pieces, dim=1)
        assert torch.equal(t, want), name


def test_group_size_params(tmp_path: Path) -> None:
    src = _make_hf(tmp_path / "src", _tiny_tensors(seed=13, tied=True), _tiny_config(tied=True))
    for params, match in (
        ({"group_size": 128}, "does not divide K=192"),
        ({"group_size": 48}, "not one vLLM's GPTQ method accepts"),
        ({"group_size": True}, "must be int"),
        ({"search": "yes"}, "must be bool"),
        ({"bits": 3}, "unknown params"),
    ):
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        with pytest.raises(CheckpointError, match=match):
            write_w4a8(HFSource(src), out, params)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda t, c: t.__setitem__(
                "model.layers.0.self_attn.k_proj.weight", t["model.layers.0.self_attn.k_proj.weight"][:48]
            ),
            "multiples of 32",
        ),
        (
            lambda t, c: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(64, 64)),
            "model.layers.0.mlp.extra.weight .* is not a Linear weight of a decoder block",
        ),
        (
            lambda t, c: (
                t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"][:224]),
                c.__setitem__("vocab_size", 224),
            ),
            "not a multiple of 64",
        ),
        (lambda t, c: c.__setitem__("architectures", ["MadeUpForCausalLM"]), "does not serve the architecture MadeUp"),
        # served by vLLM, but through its generic Transformers backend
        (
            lambda t, c: (
                c.__setitem__("architectures", ["SmolLM3ForCausalLM"]) or c.__setitem__("model_type", "smollm3")
            ),
            "only through its generic Transformers backend",
        ),
        # served by vLLM, but GPT-2's blocks hold Conv1D modules, not Linear ones
        (
            lambda t, c: c.__setitem__("architectures", ["GPT2LMHeadModel"]) or c.__setitem__("model_type", "gpt2"),
            "GPT2LMHeadModel: found no Linear modules",
        ),
    ],
    ids=["kernel-shape", "unknown-tensor", "vocab-padding", "architecture", "transformers-backend", "no-linears"],
)
def test_unsupported_sources_are_refused(tmp_path: Path, change: Any, match: str) -> None:
    tensors, config = _tiny_tensors(seed=14, tied=True), _tiny_config(tied=True)
    change(tensors, config)
    src = _make_hf(tmp_path / "src", tensors, config)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match=match):
        write_w4a8(HFSource(src), out, {})


# ----------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm_tp1() -> Iterator[None]:
    """A single-process tensor-parallel group: what vLLM's layers ask for at construction."""
    yield from single_process_tp_group()


def _gptq_config(group_size: int) -> Any:
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    return AutoGPTQConfig.from_config(quantization_config(group_size))


def _vllm_layers(group_size: int) -> dict[str, torch.nn.Module]:
    """The layers vLLM's Llama builds for one decoder layer and the head, quantized by "gptq"."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = _gptq_config(group_size)
    bf16 = torch.bfloat16
    return {
        "qkv_proj": QKVParallelLinear(
            HIDDEN,
            HEAD_DIM,
            HEADS,
            KV_HEADS,
            bias=False,
            quant_config=cfg,
            params_dtype=bf16,
            prefix="model.layers.0.self_attn.qkv_proj",
        ),
        "o_proj": RowParallelLinear(
            HEADS * HEAD_DIM,
            HIDDEN,
            bias=False,
            quant_config=cfg,
            params_dtype=bf16,
            prefix="model.layers.0.self_attn.o_proj",
        ),
        "gate_up_proj": MergedColumnParallelLinear(
            HIDDEN,
            [INTER, INTER],
            bias=False,
            quant_config=cfg,
            params_dtype=bf16,
            prefix="model.layers.0.mlp.gate_up_proj",
        ),
        "down_proj": RowParallelLinear(
            INTER, HIDDEN, bias=False, quant_config=cfg, params_dtype=bf16, prefix="model.layers.0.mlp.down_proj"
        ),
        "lm_head": ParallelLMHead(VOCAB, HIDDEN, quant_config=cfg, params_dtype=bf16, prefix="lm_head"),
    }


# checkpoint module -> (vLLM layer, shard id for its loader)
_SHARDS = {
    "model.layers.0.self_attn.q_proj": ("qkv_proj", "q"),
    "model.layers.0.self_attn.k_proj": ("qkv_proj", "k"),
    "model.layers.0.self_attn.v_proj": ("qkv_proj", "v"),
    "model.layers.0.self_attn.o_proj": ("o_proj", None),
    "model.layers.0.mlp.gate_proj": ("gate_up_proj", 0),
    "model.layers.0.mlp.up_proj": ("gate_up_proj", 1),
    "model.layers.0.mlp.down_proj": ("down_proj", None),
    "lm_head": ("lm_head", None),
}


def _load_into_vllm(tensors: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.nn.Module]:
    """Load written tensors with vLLM's own loaders (which assert every shape)."""
    layers = _vllm_layers(group_size)
    for module, (layer_name, shard) in _SHARDS.items():
        layer = layers[layer_name]
        for suffix in ("qweight", "qzeros", "scales"):  # vLLM's loader drops g_idx by name
            param = getattr(layer, suffix)
            loaded = tensors[f"{module}.{suffix}"]
            assert loaded.dtype == param.dtype, f"{module}.{suffix}"
            if shard is None:
                param.weight_loader(param, loaded)
            else:
                param.weight_loader(param, loaded, shard)
    return layers


def _reference(tensors: dict[str, torch.Tensor], modules: list[str], group_size: int) -> torch.Tensor:
    """fp32 [N, K] of the written checkpoint, decoded as a GPTQ v1 reader does, modules stacked along N."""
    parts = []
    for m in modules:
        q = gl.GPTQWeight(
            tensors[f"{m}.qweight"],
            tensors[f"{m}.qzeros"],
            tensors[f"{m}.scales"],
            tensors[f"{m}.g_idx"],
            group_size,
            math.nan,
        )
        parts.append(gl.dequantize_weight(q))
    return torch.cat(parts)


def test_written_tensors_match_vllm_gptq_parameters(vllm_tp1: None, tiny_tied: dict[str, Any]) -> None:
    tensors = tiny_tied["tensors"]
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    layers = _vllm_layers(64)
    for module, (layer_name, _) in _SHARDS.items():
        layer = layers[layer_name]
        assert isinstance(layer.quant_method, AutoGPTQLinearMethod), layer_name  # the head too (lm_head: true)
        assert not hasattr(layer, "g_idx")
        members = [m for m, (ln, _) in _SHARDS.items() if ln == layer_name]
        for suffix in ("qweight", "qzeros", "scales"):
            param = getattr(layer, suffix)
            written = [tensors[f"{m}.{suffix}"] for m in members]
            assert all(t.dtype == param.dtype for t in written), f"{module}.{suffix}"
            # the fused parameter is its shards side by side along N (dim 1), K-side dim equal
            assert all(t.shape[0] == param.shape[0] for t in written), f"{module}.{suffix}"
            assert sum(t.shape[1] for t in written) == param.shape[1], f"{module}.{suffix}"
    # and vLLM's loaders accept every tensor (they assert shapes)
    _load_into_vllm(tensors, 64)


def _run_vllm(
    tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, w4a8: bool, amx: bool, group_size: int = 64
) -> dict[str, tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """Load, let vLLM's kernel repack, run one bf16 batch; layer name -> (layer, input, output)."""
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "1" if w4a8 else "0")
    if not amx:  # what vLLM sees on an x86 host without AMX
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    layers = _load_into_vllm(tensors, group_size)
    x = torch.randn(7, INTER, generator=torch.Generator().manual_seed(15)).to(torch.bfloat16)
    results = {}
    for name, layer in layers.items():
        layer.quant_method.process_weights_after_loading(layer)
        k = INTER if name == "down_proj" else HIDDEN
        inp = x[:, :k].contiguous()
        out = layer.quant_method.apply(layer, inp)
        results[name] = (layer, inp, out[0] if isinstance(out, tuple) else out)
    return results


_MODULES = {
    "qkv_proj": [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ],
    "o_proj": ["model.layers.0.self_attn.o_proj"],
    "gate_up_proj": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
    "down_proj": ["model.layers.0.mlp.down_proj"],
    "lm_head": ["lm_head"],
}


def _source_weight(source: dict[str, torch.Tensor], modules: list[str]) -> torch.Tensor:
    """The unquantized weights of `modules` stacked along N (the tied head is the table)."""
    names = ["model.embed_tokens.weight" if m == "lm_head" else f"{m}.weight" for m in modules]
    return torch.cat([source[n].float() for n in names])


def _check_against_reference(tiny: dict[str, Any], results: dict[str, Any], min_db: float) -> None:
    tensors = tiny["tensors"]
    for name, (_layer, inp, out) in results.items():
        ref = inp.float() @ _reference(tensors, _MODULES[name], 64).t()
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape, name
        assert s4.snr_db(ref, out.float()) > min_db, name
        # against the original weights: only the 4-bit grid's ~20 dB is lost; any mismatch
        # between how the file was packed and how vLLM reads it would show here too
        unquantized = inp.float() @ _source_weight(tiny["source"], _MODULES[name]).t()
        assert s4.snr_db(unquantized, out.float()) > 15.0, name


@pytest.mark.skipif(not AMX, reason=NO_AMX_REASON)
def test_amx_w4a8_kernel_runs_the_export(
    vllm_tp1: None, tiny_tied: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = tiny_tied["tensors"]
    assert any(bool((tensors[f"{m}.scales"] < 0).any()) for m in _SHARDS)  # negative scales are exercised
    results = _run_vllm(tensors, monkeypatch, w4a8=True, amx=True)
    assert all(layer.use_w4a8 for layer, _, _ in results.values())  # int4_scaled_mm_cpu, not the fallback
    # int8 activations bound this near 40 dB
    _check_against_reference(tiny_tied, results, min_db=30.0)
    # and it can tell a zero point one step off (what 0x88888888 means to a v1 reader): ~10 dB
    layer, inp, out = results["down_proj"]
    off = _reference(tensors, _MODULES["down_proj"], 64)
    scales = tensors["model.layers.0.mlp.down_proj.scales"].float().t().repeat_interleave(64, dim=1)
    assert s4.snr_db(inp.float() @ (off - scales).t(), out.float()) < 15.0


@pytest.mark.parametrize(
    "amx",
    [pytest.param(True, marks=pytest.mark.skipif(not AMX, reason=NO_AMX_REASON)), False],
    ids=["isa-amx", "isa-vec"],
)
def test_w4a16_fallback_kernel_runs_the_export(
    vllm_gptq_kernel: None, vllm_tp1: None, tiny_tied: dict[str, Any], monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    tensors = tiny_tied["tensors"]
    results = _run_vllm(tensors, monkeypatch, w4a8=False, amx=amx)
    for layer, _, _ in results.values():
        assert not layer.use_w4a8 and layer.isa_hint == ("amx" if amx else "vec")
        assert layer.qzeros is None  # vLLM 0.32 ignores qzeros of a sym checkpoint (uint4b8 bias 8)
    _check_against_reference(tiny_tied, results, min_db=40.0)  # bf16 activations: only output rounding


def test_without_amx_vllm_never_picks_w4a8(
    vllm_gptq_kernel: None, vllm_tp1: None, tiny_tied: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _run_vllm(tiny_tied["tensors"], monkeypatch, w4a8=True, amx=False)
    assert not any(layer.use_w4a8 for layer, _, _ in results.values())
