"""spark-edge's int4 kernels: the C++ sources (native/), their build and self-check (native_int4), whether they
are wanted here (native_switch), and the torch custom ops the model calls with the one dispatch between kernels
(cpu_int4_op; the choice itself is made in C++, int4_ops.cpp's choose_kernel).

Importing this package is cheap and does not import vLLM.
"""
