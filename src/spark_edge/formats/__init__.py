"""Weight formats (4-bit, and the 8-bit vocabulary table): the quantization math, the on-disk and kernel layouts,
and the checks a checkpoint's tensors pass against them before vLLM loads a byte.

- `int4_asym`, `int4_sym`: group-wise asymmetric (w4a16) and symmetric (w4a8) 4-bit quantization, nibble packing.
- `int8_rows`: per-row symmetric 8-bit codes, the w4a16 vocabulary table's 8-bit form.
- `tinygemm_layout`: PyTorch's CPU int4 kernel buffer, which spark-edge's kernels read too.
- `gptq_layout`, `rearrange_4bit`: GPTQ's packing, and a published 4-bit tensor rearranged into cpu_int4's form.
- `cpu_int4_config`: a cpu_int4 checkpoint's quantization_config (fields, defaults, validation).
- `checkpoint_headers`, `cpu_int4_tensors`: safetensors headers read without loading, and a cpu_int4 checkpoint's
  tensors checked against its config.

torch and safetensors only; never vLLM.
"""
