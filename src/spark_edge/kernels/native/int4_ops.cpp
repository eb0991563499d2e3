/* torch.ops.spark_edge.int4_linear and friends: the cpu_int4 GEMM as a C++ op, so the compiled graph calls
 * it with no Python between layers. Which kernel runs is decided per call by the activation rows M and the
 * host policy that Python sets once per process (int4_configure), from the buffer layout it detected and the
 * host's ISA (see cpu_int4_op.py for the reasons):
 *   q8       int8 activations against the 4-bit codes, integer dot products (int4_gemm_q8.cpp), for decode,
 *            in the layout's form (vpdpbusd quads with AVX512-VNNI or AVX-VNNI, vpmaddubsw pairs without);
 *   native   spark-edge's GEMM (int4_gemm.cpp), every weight read once whatever M;
 *   tiles    bf16 tiles of the weight (bf16_tiles.h) for the rows above native's (prefill), never a whole bf16
 *            matrix: vdpbf16ps register blocks (int4_gemm_bf16.cpp, AVX512-BF16 builds) or AMX tiles
 *            (int4_gemm_amx.cpp, where the process may use them);
 *   tinygemm ATen's _weight_int4pack_mm_for_cpu, one row per call (never several: AMX tile state);
 *   dequant  the whole weight to bf16 W^T in one pass (int4_dequant.cpp), then ATen's mm (oneDNN).
 * int4_embedding reads a quantized embedding table's rows from its buffer (int4_dequant.cpp), so the token lookup
 * is one C++ call in the compiled graph too. int8_rows_gemm is the 8-bit vocabulary table's head where no
 * integer dot product serves it (int8_rows_gemm.cpp); it needs no policy.
 * That choice is made in one place, choose_kernel; int4_kernel_for reports it for a policy and a shape (what
 * cpu_int4_op.kernel_for, the bench and the tests read), so no mirror of it exists elsewhere.
 * The fake (meta) implementation is registered from Python (native_int4.py).
 */
#include "int4_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

namespace spark_edge {
namespace {

struct Policy {
    int64_t block = 0;  // buffer layout: channels per full block (0 = not configured)
    bool halves = false;
    int64_t q8_max_rows = 0;  // int8-activation GEMM up to this many rows, where the shape allows (0: never)
    int64_t native_max_rows = 0;  // then the native GEMM up to this many rows (-1: every M; 0: never)
    int64_t row_loop_max_rows = 0;  // then tinygemm one row at a time up to this many; dequant + mm above
    int64_t tiles = TILES_NONE;  // above native's rows, a tile GEMM where the build has it (before the row loop)
};

std::atomic<Policy *> policy{nullptr};

const uint16_t *u16(const at::Tensor &t) { return reinterpret_cast<const uint16_t *>(t.data_ptr()); }

void check_buffers(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "cpu_int4 takes bfloat16 activations, got ", x.scalar_type(),
                "; serve the model with dtype=bfloat16");
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && sz.dim() == 3, "int4_linear: x [M, K], weight [N, K/2] and "
                "scales_zeros [G, N, 2] expected");
    TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous(), "int4_linear: the weight buffer must "
                "be contiguous uint8");
    TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous(), "int4_linear: scales_zeros must be "
                "contiguous bf16");
    const int64_t n = weight.size(0), k = x.size(1);
    TORCH_CHECK(group > 0 && k % group == 0 && weight.size(1) * 2 == k, "int4_linear: K=", k, " does not match "
                "the weight [", n, ", ", weight.size(1), "] and group size ", group);
    TORCH_CHECK(sz.size(0) == k / group && sz.size(1) == n && sz.size(2) == 2, "int4_linear: scales_zeros ",
                sz.sizes(), " does not match N=", n, ", K=", k, ", group size ", group);
}

enum class Kernel { Q8, NATIVE, AMX, TILES, TINYGEMM, DEQUANT };
const char *const KERNEL_NAMES[] = {"q8", "native", "amx", "tiles", "tinygemm", "dequant"};

/* The kernel int4_linear runs for M activation rows of an N x K weight under policy `p`: the one dispatch. */
Kernel choose_kernel(const Policy &p, int64_t m, int64_t n, int64_t k, int64_t group) {
    if (m <= p.q8_max_rows && int4_gemm_q8_supported(n, k, group, p.block, p.halves)) return Kernel::Q8;
    if (p.native_max_rows < 0 || m <= p.native_max_rows) return Kernel::NATIVE;
    if (p.tiles == TILES_AMX && k % 32 == 0 && int4_gemm_amx_supported(p.block, p.halves)) return Kernel::AMX;
    if (p.tiles != TILES_NONE && int4_gemm_bf16_supported(p.block, p.halves)) return Kernel::TILES;
    return m <= p.row_loop_max_rows ? Kernel::TINYGEMM : Kernel::DEQUANT;
}

/* The policy int4_configure set; every op needs it (the layout), so a process that never set it fails clearly. */
const Policy &configured() {
    const Policy *p = policy.load();
    TORCH_CHECK(p != nullptr, "spark_edge::int4_configure was not called in this process");
    return *p;
}

}  // namespace

void int4_configure(int64_t block, bool halves, int64_t q8_max_rows, int64_t native_max_rows,
                    int64_t row_loop_max_rows, int64_t tiles) {
    TORCH_CHECK(tiles == TILES_NONE || tiles == TILES_VDP || tiles == TILES_AMX, "int4_configure: tiles must be 0 "
                "(none), 1 (vdpbf16ps) or 2 (AMX), got ", tiles);
    TORCH_CHECK(block > 0 && block % 16 == 0, "int4_configure: block must be a positive multiple of 16");
    // set once per process, before the first call; a later call replaces it (the old one is kept alive:
    // a concurrent caller may still read it)
    policy.store(new Policy{block, halves, q8_max_rows, native_max_rows, row_loop_max_rows, tiles});
}

std::string int4_kernel_for(int64_t m, int64_t n, int64_t k, int64_t group, int64_t block, bool halves,
                            int64_t q8_max_rows, int64_t native_max_rows, int64_t row_loop_max_rows, int64_t tiles) {
    const Policy p{block, halves, q8_max_rows, native_max_rows, row_loop_max_rows, tiles};
    return KERNEL_NAMES[static_cast<int>(choose_kernel(p, m, n, k, group))];
}

bool int4_q8_supported(int64_t n, int64_t k, int64_t group, int64_t block, bool halves) {
    return int4_gemm_q8_supported(n, k, group, block, halves);
}

bool int4_native_vectorized(int64_t block, bool halves) { return int4_gemm_vectorized(block, halves); }

bool int4_bf16_tiles_supported(int64_t block, bool halves) { return int4_gemm_bf16_supported(block, halves); }

bool int4_amx_tiles_supported(int64_t block, bool halves) { return int4_gemm_amx_supported(block, halves); }

int64_t int4_q8_default_form() { return int4_gemm_q8_default_form(configured().block); }

bool int4_q8_form_supported(int64_t form) { return int4_gemm_q8_form_supported(configured().block, (int)form); }

at::Tensor int4_gemm_op(const at::Tensor &x_in, const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    const Policy *p = &configured();
    check_buffers(x_in, weight, sz, group);
    const at::Tensor x = x_in.contiguous();
    const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
    at::Tensor out = at::empty({m, n}, x.options());
    TORCH_CHECK(int4_gemm(u16(x), m, weight.data_ptr<uint8_t>(), u16(sz), reinterpret_cast<uint16_t *>(out.data_ptr()),
                          n, k, group, p->block, p->halves),
                "int4_gemm: no memory for the fp32 copy of a ", m, " x ", k, " activation");
    return out;
}

at::Tensor int4_gemm_q8_op(const at::Tensor &x_in, const at::Tensor &weight, const at::Tensor &sz, int64_t group,
                           int64_t form) {
    const Policy *p = &configured();
    check_buffers(x_in, weight, sz, group);
    const at::Tensor x = x_in.contiguous();
    const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
    TORCH_CHECK(int4_gemm_q8_supported(n, k, group, p->block, p->halves), "int4_gemm_q8: no int8-activation kernel "
                "for N=", n, ", K=", k, ", group ", group, " on this layout and build");
    TORCH_CHECK(form == Q8_AUTO || form == Q8_PAIRS || form == Q8_QUADS, "int4_gemm_q8: form must be 0 (the layout's), "
                "1 (pairs) or 2 (quads), got ", form);
    TORCH_CHECK(int4_gemm_q8_form_supported(p->block, static_cast<int>(form)), "int4_gemm_q8: no form ", form,
                " for ", p->block, "-channel blocks");
    at::Tensor out = at::empty({m, n}, x.options());
    TORCH_CHECK(int4_gemm_q8(u16(x), m, weight.data_ptr<uint8_t>(), u16(sz), reinterpret_cast<uint16_t *>(out.data_ptr()),
                             n, k, group, p->block, static_cast<int>(form)),
                "int4_gemm_q8: no memory for the int8 copy of a ", m, " x ", k, " activation");
    return out;
}

/* A tile GEMM of bf16_tiles.h as an op: this build and process must have it for the configured layout, and it
 * refuses (false) shapes it does not take or tiles it cannot allocate; `needs` and `takes` say what, for errors. */
at::Tensor tile_gemm_op(const char *name, bool (*supported)(int64_t, int64_t),
                        bool (*gemm)(const uint16_t *, int64_t, const uint8_t *, const uint16_t *, uint16_t *, int64_t,
                                     int64_t, int64_t),
                        const char *needs, const char *takes, const at::Tensor &x_in, const at::Tensor &weight,
                        const at::Tensor &sz, int64_t group) {
    const Policy *p = &configured();
    check_buffers(x_in, weight, sz, group);
    TORCH_CHECK(supported(p->block, p->halves), name, ": no such kernel for ", p->block, "-channel blocks in this "
                "build and process (it needs ", needs, ")");
    const at::Tensor x = x_in.contiguous();
    const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
    at::Tensor out = at::empty({m, n}, x.options());
    TORCH_CHECK(gemm(u16(x), m, weight.data_ptr<uint8_t>(), u16(sz), reinterpret_cast<uint16_t *>(out.data_ptr()), n, k,
                     group),
                name, ": N=", n, ", K=", k, ", group ", group, ": ", takes, ", and its tiles per thread must be "
                "allocatable");
    return out;
}

at::Tensor int4_gemm_bf16_op(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    return tile_gemm_op("int4_gemm_bf16", int4_gemm_bf16_supported, int4_gemm_bf16,
                        "AVX512-BF16 and ATen's AVX-512 layout", "N, K and the group must be even", x, weight, sz, group);
}

at::Tensor int4_gemm_amx_op(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    return tile_gemm_op("int4_gemm_amx", int4_gemm_amx_supported, int4_gemm_amx,
                        "AMX-BF16, ATen's AVX-512 layout and the kernel's permission to use AMX tiles",
                        "K must be a multiple of 32, N and the group even", x, weight, sz, group);
}

at::Tensor int4_dequant_t_op(const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    const Policy *p = &configured();
    const int64_t n = weight.size(0), k = weight.size(1) * 2;
    check_buffers(at::empty({0, k}, sz.options()), weight, sz, group);
    at::Tensor out = at::empty({k, n}, sz.options());
    int4_dequant_t(weight.data_ptr<uint8_t>(), u16(sz), reinterpret_cast<uint16_t *>(out.data_ptr()), n, k, group,
                   p->block, p->halves);
    return out;
}

/* Token ids [T] (int32 or int64) -> bf16 rows [T, K] of the table in the buffer; an id outside [0, N) is an error
 * naming it, never a read outside the buffer. */
at::Tensor int4_embedding_op(const at::Tensor &ids_in, const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    const Policy *p = &configured();
    const int64_t n = weight.size(0), k = weight.size(1) * 2;
    check_buffers(at::empty({0, k}, sz.options()), weight, sz, group);
    TORCH_CHECK(ids_in.dim() == 1 && (ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt),
                "int4_embedding: token ids must be a 1-D int32 or int64 tensor, got ", ids_in.scalar_type(), " ",
                ids_in.sizes());
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    const int64_t m = ids.size(0), *id = ids.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; r++)
        TORCH_CHECK(id[r] >= 0 && id[r] < n, "int4_embedding: token id ", id[r], " is outside the table's ", n, " rows");
    at::Tensor out = at::empty({m, k}, sz.options());
    int4_gather_rows(weight.data_ptr<uint8_t>(), u16(sz), id, m, reinterpret_cast<uint16_t *>(out.data_ptr()), n, k,
                     group, p->block, p->halves);
    return out;
}

/* x bf16 [M, K] @ (codes int8 [N, K] * scale fp32 [N])^T -> bf16 [M, N]. */
at::Tensor int8_rows_gemm_op(const at::Tensor &x_in, const at::Tensor &codes, const at::Tensor &scale) {
    TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2, "int8_rows_gemm: x must be 2-D bfloat16, got ",
                x_in.scalar_type(), " ", x_in.sizes());
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(), "int8_rows_gemm: codes "
                "must be contiguous int8 [N, K]");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(), "int8_rows_gemm: "
                "scale must be contiguous float32 [N]");
    const int64_t m = x_in.size(0), k = x_in.size(1), n = codes.size(0);
    TORCH_CHECK(codes.size(1) == k && scale.size(0) == n && k % 32 == 0, "int8_rows_gemm: x ", x_in.sizes(),
                ", codes ", codes.sizes(), ", scale ", scale.sizes(), ": K must match and be a multiple of 32");
    const at::Tensor x = x_in.contiguous();
    at::Tensor out = at::empty({m, n}, x.options());
    if (m == 0) return out;
    TORCH_CHECK(int8_rows_gemm(u16(x), m, codes.data_ptr<int8_t>(), scale.data_ptr<float>(),
                               reinterpret_cast<uint16_t *>(out.data_ptr()), n, k),
                "int8_rows_gemm: no memory for the int8 copy of a ", m, " x ", k, " activation");
    return out;
}

bool int8_rows_vectorized() { return int8_rows_gemm_vectorized(); }

at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &sz, int64_t group) {
    const Policy *p = &configured();
    check_buffers(x, weight, sz, group);
    const int64_t m = x.size(0);
    if (m == 0) return at::empty({0, weight.size(0)}, x.options());
    switch (choose_kernel(*p, m, weight.size(0), x.size(1), group)) {
        case Kernel::Q8: return int4_gemm_q8_op(x, weight, sz, group, Q8_AUTO);
        case Kernel::NATIVE: return int4_gemm_op(x, weight, sz, group);
        case Kernel::AMX: return int4_gemm_amx_op(x, weight, sz, group);
        case Kernel::TILES: return int4_gemm_bf16_op(x, weight, sz, group);
        case Kernel::TINYGEMM: {
            std::vector<at::Tensor> rows;
            rows.reserve(m);
            for (int64_t i = 0; i < m; i++)
                rows.push_back(at::_weight_int4pack_mm_for_cpu(x.narrow(0, i, 1).contiguous(), weight, group, sz));
            return at::cat(rows);
        }
        case Kernel::DEQUANT: break;
    }
    return at::mm(x, int4_dequant_t_op(weight, sz, group));
}

TORCH_LIBRARY_FRAGMENT(spark_edge, m) {
    m.def("int4_configure(int block, bool halves, int q8_max_rows, int native_max_rows, int row_loop_max_rows, "
          "int tiles=0) -> ()");
    m.def("int4_native_vectorized(int block, bool halves) -> bool");
    m.def("int4_bf16_tiles_supported(int block, bool halves) -> bool");
    m.def("int4_gemm_bf16(Tensor x, Tensor weight, Tensor scales_zeros, int group_size) -> Tensor");
    m.def("int4_amx_tiles_supported(int block, bool halves) -> bool");
    m.def("int4_gemm_amx(Tensor x, Tensor weight, Tensor scales_zeros, int group_size) -> Tensor");
    m.def("int4_q8_supported(int n, int k, int group_size, int block, bool halves) -> bool");
    m.def("int4_kernel_for(int m, int n, int k, int group_size, int block, bool halves, int q8_max_rows, "
          "int native_max_rows, int row_loop_max_rows, int tiles) -> str");
    m.def("int4_gemm(Tensor x, Tensor weight, Tensor scales_zeros, int group_size) -> Tensor");
    m.def("int4_q8_default_form() -> int");  // for the configured layout
    m.def("int4_q8_form_supported(int form) -> bool");  // on the configured layout
    m.def("int4_gemm_q8(Tensor x, Tensor weight, Tensor scales_zeros, int group_size, int form=0) -> Tensor");
    m.def("int4_dequant_t(Tensor weight, Tensor scales_zeros, int group_size) -> Tensor");
    m.def("int4_embedding(Tensor ids, Tensor weight, Tensor scales_zeros, int group_size) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor weight, Tensor scales_zeros, int group_size) -> Tensor");
    m.def("int8_rows_gemm(Tensor x, Tensor codes, Tensor scale) -> Tensor");
    m.def("int8_rows_vectorized() -> bool");
}

TORCH_LIBRARY_IMPL(spark_edge, CPU, m) {
    m.impl("int4_gemm", &int4_gemm_op);
    m.impl("int4_gemm_q8", &int4_gemm_q8_op);
    m.impl("int4_gemm_bf16", &int4_gemm_bf16_op);
    m.impl("int4_gemm_amx", &int4_gemm_amx_op);
    m.impl("int4_dequant_t", &int4_dequant_t_op);
    m.impl("int4_embedding", &int4_embedding_op);
    m.impl("int4_linear", &int4_linear);
    m.impl("int8_rows_gemm", &int8_rows_gemm_op);
}

TORCH_LIBRARY_IMPL(spark_edge, CompositeExplicitAutograd, m) {
    m.impl("int4_configure", &int4_configure);
    m.impl("int4_native_vectorized", &int4_native_vectorized);
    m.impl("int4_bf16_tiles_supported", &int4_bf16_tiles_supported);
    m.impl("int4_amx_tiles_supported", &int4_amx_tiles_supported);
    m.impl("int4_q8_supported", &int4_q8_supported);
    m.impl("int4_kernel_for", &int4_kernel_for);
    m.impl("int4_q8_default_form", &int4_q8_default_form);
    m.impl("int4_q8_form_supported", &int4_q8_form_supported);
    m.impl("int8_rows_vectorized", &int8_rows_vectorized);
}

}  // namespace spark_edge
