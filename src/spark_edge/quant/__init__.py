"""Weight quantization for spark-edge's CPU weight paths.

- `int4_asym`: group-wise asymmetric 4-bit quantization (the math, nibble packing, SNR).
- `tinygemm_layout`: PyTorch's CPU int4 kernel buffer: building it, reading it back.
- `cpu_int4_config`: the checkpoint's quantization_config fields (no vLLM import).
- `cpu_int4_op`: the opaque custom ops the model calls, and which int4 kernel serves this host.
- `native_int4`: spark-edge's C++ int4 ops (native/*.cpp), built once per host and checked.
- `cpu_int4_method`: the vLLM quantization config "cpu_int4" (W4A16), registered on import.
- `cpu_int4_layers`: its linear and embedding methods (loaded only where a model is built).

Importing this package is cheap and does not import vLLM.
"""
