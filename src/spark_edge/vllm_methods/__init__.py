"""vLLM integration of the 4-bit weights: the `cpu_int4` quantization method and its linear and embedding
methods (cpu_int4_method, cpu_int4_layers), and the readers that serve published GPTQ, AWQ and
compressed-tensors checkpoints on the same kernels (published_*). spark_edge.plugin imports the methods in every
vLLM process; the layers are loaded only where a model is built.
"""
