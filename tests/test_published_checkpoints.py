"""Published 4-bit checkpoints served as they are: GPTQ (cpu_int4_gptq), AWQ (cpu_int4_awq) and
compressed-tensors (cpu_int4_ct).

GPTQ checkpoints are written here as AutoGPTQ's v1 export lays them out: spark-edge's GPTQ writer (the w4a8
path's, whose layout tests/test_families.py checks against vLLM's own GPTQ loader) on a tiny random Llama 3.2,
its head left in bf16 as GPTQ exports leave it; then rewritten asymmetric with act-order (random zero points,
a shuffled g_idx), the forms vLLM 0.32's own CPU GPTQ method refuses. compressed-tensors checkpoints are written
by the compressed-tensors library's own pack-quantized compressor (asymmetric; symmetric with act-order), and
the reference decodes them with its decompressor. AWQ checkpoints are packed by vLLM's own `awq_pack` and decoded
in the reference with the nibble order of vLLM's AWQ reader. Each is served by vLLM's offline engine through its method
and compared with transformers on the checkpoint's own decoded weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spark_edge.checkpoints import synth
from spark_edge.checkpoints.served import CheckpointKind, ServedCheckpoint, checkpoint_kind
from spark_edge.errors import CheckpointError
from spark_edge.formats import rearrange_4bit
from spark_edge.formats.gptq_layout import pack_along_dim0, pack_along_dim1
from spark_edge.formats.int4_asym import unpack_nibbles
from spark_edge.serving.checkpoint import checkpoint_for_serving
from spark_edge.vllm_methods import published_awq as pawq
from spark_edge.vllm_methods import published_ct as pct
from spark_edge.vllm_methods import published_gptq as pg
from spark_edge.weight_paths.builder import build_checkpoint

from hf_reference import compare_with_transformers
from published_exports import asym_act_order_gptq, publish_gptq, write_awq, write_ct
from spark_reference import _awq_weight, _gptq_weight

FAMILY = "llama-3.2-1b"
MEAN_NAT = 0.15  # w4a16's bound in test_families: the same kernels, int8 activations in decode


def _random_layer(k: int, n: int, group: int, seed: int, act_order: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(2, 14, (k // group, n), generator=gen)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {
        "qweight": pack_along_dim0(codes),
        "qzeros": pack_along_dim1(zeros),
        "scales": (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.float16),
        "g_idx": g_idx,
    }


def _method(variant: str) -> str:
    return pct.METHOD if variant.startswith("ct-") else pawq.METHOD if variant == "awq" else pg.METHOD


def _decode_cpu_int4(parts: rearrange_4bit.CpuInt4Parts, group: int) -> torch.Tensor:
    codes = unpack_nibbles(parts.packed).double()  # [N, K]
    scale = parts.scale.double().repeat_interleave(group, dim=1)
    zero = parts.zero.double().repeat_interleave(group, dim=1)
    return (codes - 8) * scale + zero


@pytest.mark.parametrize("fmt_name", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_a_layer_decodes_to_the_gptq_weights_up_to_bf16_scales(fmt_name: str, act_order: bool, group: int) -> None:
    k, n = 512, 48
    layer = _random_layer(k, n, group, seed=group + act_order, act_order=act_order)
    fmt = pg.GptqFormat.from_hf({"quant_method": "gptq", "bits": 4, "group_size": group, "checkpoint_format": fmt_name})
    parts = pg.to_cpu_int4(**layer, fmt=fmt)
    reference = pg.dequantize_gptq(**layer, fmt=fmt)  # [N, K], columns as the checkpoint orders them
    assert (parts.order is not None) == act_order
    order = parts.order if act_order else torch.arange(k)
    got = _decode_cpu_int4(parts, group)
    want = reference[:, order]
    # the only rounding: scale and zero to bf16, each a relative 2^-9 at most, times |q - 8| and 1
    scale = layer["scales"].double()[layer["g_idx"].long()].t()[:, order]
    bound = scale * (8 * 2.0**-8 + 16 * 2.0**-8)
    assert bool(((got - want).abs() <= bound).all())
    # and GEMM-equivalent: x[:, order] against the rearranged weights is x against the checkpoint's
    x = torch.randn(3, k, dtype=torch.float64)
    torch.testing.assert_close(x[:, order] @ got.t(), x @ reference.t(), rtol=0.02, atol=0.02)
    # the independent decoder of the reference model reads the same weights from the same tensors
    offset = pg.FORMATS[fmt_name]
    torch.testing.assert_close(_gptq_weight({f"p.{s}": v for s, v in layer.items()}, "p", group, offset), reference)


def test_g_idx_that_cannot_form_whole_groups_is_refused() -> None:
    g_idx = torch.arange(256, dtype=torch.int32) // 32
    g_idx[0] = 1  # group 0 gets 31 columns, group 1 gets 33
    with pytest.raises(ValueError, match="every group 32 columns"):
        rearrange_4bit.input_order(g_idx, 32, "model.layers.0.mlp.down_proj")


# -- a tiny published checkpoint ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("published-gptq")
    source = synth.write_synthetic(FAMILY, root / "source", seed=3, small=True)
    build = build_checkpoint(source, "w4a8", root / "w4a8").out
    sym = publish_gptq(build, root / "gptq-sym")
    return {
        "w4a8-build": build,
        "sym": sym,
        "asym-act-order": asym_act_order_gptq(sym, root / "gptq-asym-act-order"),
        "ct-asym": write_ct(source, root / "ct-asym", symmetric=False, act_order=False),
        "ct-sym-act-order": write_ct(source, root / "ct-sym-act-order", symmetric=True, act_order=True),
        "awq": write_awq(source, root / "awq"),
    }


def test_a_ct_layer_decodes_as_the_library_decodes_it(published: dict[str, Path]) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    for variant in ("ct-asym", "ct-sym-act-order"):
        folder = published[variant]
        config = json.loads((folder / "config.json").read_text())
        fmt = pct.CtFormat.from_hf(config["quantization_config"])
        tensors = load_file(folder / "model.safetensors")
        p = "model.layers.1.mlp.down_proj"
        parts = pct.to_cpu_int4(
            tensors[f"{p}.weight_packed"], tensors[f"{p}.weight_scale"], tensors.get(f"{p}.weight_zero_point"),
            tensors.get(f"{p}.weight_g_idx"), fmt,
        )  # fmt: skip
        local = {k.removeprefix(p + "."): v for k, v in tensors.items() if k.startswith(p + ".weight_")}
        (scheme,) = QuantizationConfig.model_validate(config["quantization_config"]).config_groups.values()
        want = PackedQuantizationCompressor.decompress(local, scheme)["weight"].double()
        order = parts.order if parts.order is not None else torch.arange(want.shape[1])
        assert (parts.order is not None) == fmt.act_order
        got = _decode_cpu_int4(parts, fmt.group_size)
        scale = tensors[f"{p}.weight_scale"].double().abs().max()
        assert float((got - want[:, order]).abs().max()) <= float(scale) * 24 * 2.0**-8


def test_spark_edges_own_w4a8_build_is_not_read_as_a_published_checkpoint(published: dict[str, Path]) -> None:
    """A w4a8 build is GPTQ with a 4-bit head, for vLLM's own method: not ours, and not refused as one of ours."""
    build = published["w4a8-build"]
    assert checkpoint_kind(build) == CheckpointKind("build", "w4a8")
    config = json.loads((build / "config.json").read_text())
    ServedCheckpoint(build, build.name, config, checkpoint_kind(build)).check_published_tensors()  # does not raise


def test_an_awq_layer_decodes_as_vllms_awq_order_reads_it(published: dict[str, Path]) -> None:
    folder = published["awq"]
    config = json.loads((folder / "config.json").read_text())
    fmt = pawq.AwqFormat.from_hf(config["quantization_config"])
    assert pawq.check_awq_tensors(folder, config) == fmt
    tensors = load_file(folder / "model.safetensors")
    p = "model.layers.1.self_attn.q_proj"
    parts = pawq.to_cpu_int4(tensors[f"{p}.qweight"], tensors[f"{p}.qzeros"], tensors[f"{p}.scales"], fmt)
    want = _awq_weight(tensors, p, fmt.group_size)
    scale = float(tensors[f"{p}.scales"].double().abs().max())
    assert parts.order is None
    assert float((_decode_cpu_int4(parts, fmt.group_size) - want).abs().max()) <= scale * 24 * 2.0**-8
    bad = {**config["quantization_config"], "version": "gemv"}
    with pytest.raises(ValueError, match="GEMM layout"):
        pawq.AwqFormat.from_hf(bad)


@pytest.mark.parametrize("variant", ["asym-act-order", "ct-asym", "awq"])
def test_serve_takes_a_published_folder_as_it_is(variant: str, published: dict[str, Path]) -> None:
    folder = published[variant]
    before = sorted(p.name for p in folder.iterdir())
    logged: list[str] = []
    served = checkpoint_for_serving(folder, "w4a8", logged.append)
    assert (served.folder, served.served_name) == (folder.absolute(), folder.name)
    assert logged and "as it is" in logged[0]
    method = _method(variant)
    assert served.kind == checkpoint_kind(folder) == CheckpointKind("published", "w4a16", method)
    config = json.loads((folder / "config.json").read_text())
    if method == pawq.METHOD:
        assert pg.check_gptq_tensors(folder, config) is None and pct.check_ct_tensors(folder, config) is None
    elif method == pg.METHOD:
        assert pct.check_ct_tensors(folder, config) is None
        fmt = pg.check_gptq_tensors(folder, config)
        assert fmt == pg.GptqFormat(group_size=config["quantization_config"]["group_size"], zero_offset=1,
                                    sym=False, desc_act=True)  # fmt: skip
    else:
        assert pg.check_gptq_tensors(folder, config) is None
        assert pct.check_ct_tensors(folder, config) == pct.CtFormat(32, symmetric=False, act_order=False,
                                                                    ignore=("lm_head",))  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written into the user's folder


def _damaged(published: Path, tmp_path: Path, edit_tensors=None, edit_quant=None) -> Path:
    out = tmp_path / "damaged"
    shutil.copytree(published, out)
    if edit_tensors:
        tensors = load_file(out / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, out / "model.safetensors")
    if edit_quant:
        config = json.loads((out / "config.json").read_text())
        edit_quant(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    return out


LAYER = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (dict(edit_tensors=lambda t: t.pop(f"{LAYER}.g_idx")), f"{LAYER}.g_idx is missing"),
        (dict(edit_tensors=lambda t: t.update({f"{LAYER}.scales": t[f"{LAYER}.scales"][:-1].clone()})),
         f"{LAYER}.scales is"),
        (dict(edit_tensors=lambda t: t.update({f"{LAYER}.qzeros": t[f"{LAYER}.qzeros"].to(torch.int16)})),
         f"{LAYER}.qzeros is I16"),
        (dict(edit_quant=lambda q: q.update(bits=8)), "bits=8"),
        (dict(edit_quant=lambda q: q.update(group_size=-1)), "group_size=-1"),
        (dict(edit_quant=lambda q: q.update(lm_head=True)), "lm_head"),
    ],
    ids=["missing-g_idx", "truncated-scales", "wrong-dtype", "8-bit", "per-channel", "quantized-head"],
)  # fmt: skip
def test_a_damaged_or_unsupported_checkpoint_is_refused_naming_what(
    published: dict[str, Path], tmp_path: Path, damage: dict, message: str
) -> None:
    folder = _damaged(published["sym"], tmp_path, **damage)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.").replace("[", r"\[")) as info:
        pg.check_gptq_tensors(folder, json.loads((folder / "config.json").read_text()))
    assert info.value.exit_code == 3
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


CT_LAYER = "model.layers.0.self_attn.o_proj"


def _cut(tensors: dict[str, torch.Tensor], name: str) -> None:
    tensors[name] = tensors[name][:, :1].clone()


def _ct_group(edit):  # noqa: ANN001, ANN202
    return lambda q: edit(q["config_groups"]["group_0"])


def test_act_order_parts_of_a_merged_layer_with_different_orders_are_refused(
    published: dict[str, Path], tmp_path: Path
) -> None:
    k_name = "model.layers.0.self_attn.k_proj.weight_g_idx"
    folder = _damaged(
        published["ct-sym-act-order"], tmp_path, edit_tensors=lambda t: t.update({k_name: t[k_name].flip(0)})
    )
    with pytest.raises(CheckpointError, match="q_proj.weight_g_idx and .*k_proj.weight_g_idx differ"):
        pct.check_ct_tensors(folder, json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (dict(edit_tensors=lambda t: t.pop(f"{CT_LAYER}.weight_scale")), f"{CT_LAYER}.weight_scale is missing"),
        (dict(edit_tensors=lambda t: _cut(t, f"{CT_LAYER}.weight_zero_point")), f"{CT_LAYER}.weight_zero_point is I32"),
        (dict(edit_quant=_ct_group(lambda g: g["weights"].update(num_bits=8))), "8-bit"),
        (dict(edit_quant=lambda q: q.update(format="int-quantized")), "int-quantized"),
        (dict(edit_quant=_ct_group(lambda g: g.update(input_activations={"num_bits": 8, "type": "int"}))),
         "not weight-only"),
    ],
    ids=["missing-scale", "truncated-zero-point", "8-bit", "naive-format", "w4a8"],
)  # fmt: skip
def test_a_damaged_or_unsupported_ct_checkpoint_is_refused_naming_what(
    published: dict[str, Path], tmp_path: Path, damage: dict, message: str
) -> None:
    folder = _damaged(published["ct-asym"], tmp_path, **damage)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")) as info:
        pct.check_ct_tensors(folder, json.loads((folder / "config.json").read_text()))
    assert info.value.exit_code == 3
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.engine
@pytest.mark.parametrize("variant", ["sym", "asym-act-order", "ct-asym", "ct-sym-act-order", "awq"])
def test_a_published_checkpoint_on_cpu_int4_matches_transformers(
    variant: str, published: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = published[variant]
    method = _method(variant)
    # eager: the subject is the reader's weights; cpu_int4's op in a compiled Llama graph is tests/test_families.py's
    c = compare_with_transformers(checkpoint, tmp_path / "vllm-cache", monkeypatch, quantization=method, eager=True)
    prefill, decode, rounding = c.prefill, c.decode, c.rounding
    print(
        f"\n{FAMILY} published {variant} on {method}: mean/max |delta log-prob| prefill "
        f"{prefill[0]:.4f}/{prefill[1]:.3f}, decode {decode[0]:.4f}/{decode[1]:.3f} nat (bf16 rounding costs the "
        f"reference {rounding:.4f})"
    )
    assert prefill[0] < MEAN_NAT + rounding and decode[0] < MEAN_NAT + rounding
