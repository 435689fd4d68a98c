// sm_90a warpgroup MMA (wgmma) helpers shared by the Hopper kernels: gpu/grouped_gemm_sm90.cu
// and gpu/joint_probe.cu. CUDA-only header, for translation units compiled for sm_90a alone
// (wgmma exists on no other target).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace moe::gpu::wgmma {

// wgmma shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "Matrix Descriptor Format"):
// start address, leading and stride byte offsets, all in 16-byte units.
//   K-major (rows of 64 k-values = 128 bytes): LBO unused (1), SBO = 8 rows = 1024 bytes.
//   MN-major (rows of 64 n-values per k, boxes of 64 columns kBK rows deep): LBO = the stride
//   between 64-column boxes, SBO = 8 k-rows = 1024 bytes.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#define MOE_WGMMA_REGS                                                                           \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define MOE_WGMMA_OUTS                                                                            \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),  \
      "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),  \
      "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),  \
      "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),  \
      "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]),  \
      "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),          \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),         \
      "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),         \
      "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]),         \
      "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d[64 x 256] += A[64 x 16] . B[16 x 256], 16-bit operands (bf16 or f16), fp32 accumulators;
// with add = 0, d = A . B (the instruction's scale-d: d's old values are not read, so a tile's
// first product needs no zeroed accumulators). kTransA / kTransB = 1 for an MN-major A / B (the
// transpose flags of the instruction).
template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db,
                                                 int add = 1) {
  static_assert(kTransA == 0 || kTransA == 1, "kTransA");
  static_assert(kTransB == 0 || kTransB == 1, "kTransB");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" MOE_WGMMA_REGS
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : MOE_WGMMA_OUTS
        : "l"(da), "l"(db), "r"(add), "n"(kTransA), "n"(kTransB));
  } else {
    static_assert(std::is_same_v<T, __half>, "wgmma_m64n256k16: bf16 or f16 operands");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" MOE_WGMMA_REGS
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : MOE_WGMMA_OUTS
        : "l"(da), "l"(db), "r"(add), "n"(kTransA), "n"(kTransB));
  }
}

// d[64 x 64] += A[64 x 16] . B[16 x 64]: wgmma_m64n256k16 for a quarter of the columns (the
// forward's folded tail of 33-64 rows, transposed: gpu/grouped_gemm_sm90.cu, consume_tile).
#define MOE_WGMMA_REGS32                                                   \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MOE_WGMMA_OUTS32                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t da, uint64_t db) {
  static_assert(kTransA == 0 || kTransA == 1, "kTransA");
  static_assert(kTransB == 0 || kTransB == 1, "kTransB");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" MOE_WGMMA_REGS32
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : MOE_WGMMA_OUTS32
        : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
  } else {
    static_assert(std::is_same_v<T, __half>, "wgmma_m64n64k16: bf16 or f16 operands");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" MOE_WGMMA_REGS32
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : MOE_WGMMA_OUTS32
        : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
  }
}

// d[64 x N] += A[64 x 16] . B[16 x N] for N = 16 or 32: the forward's folded tail multiplied
// transposed (gpu/grouped_gemm_sm90.cu, consume_tile): the weight's 64 columns as A, the tail's
// N rows as B, so a tail of 1-16 rows costs a quarter of the m64n64k16 product of 64 rows.
template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[8], uint64_t da, uint64_t db) {
  static_assert(kTransA == 0 || kTransA == 1, "kTransA");
  static_assert(kTransB == 0 || kTransB == 1, "kTransB");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "wgmma_m64n16k16: bf16 or f16 operands");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
  }
}

#define MOE_WGMMA_OUTS16                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15])

template <class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t da, uint64_t db) {
  static_assert(kTransA == 0 || kTransA == 1, "kTransA");
  static_assert(kTransB == 0 || kTransB == 1, "kTransB");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "wgmma_m64n32k16: bf16 or f16 operands");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
        "1, %19, %20;\n}\n"
        : MOE_WGMMA_OUTS16
        : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, "
        "1, %19, %20;\n}\n"
        : MOE_WGMMA_OUTS16
        : "l"(da), "l"(db), "r"(1), "n"(kTransA), "n"(kTransB));
  }
}

// d[64 x N] for N in {16, 32, 64}: the one of the three above.
template <int kN, class T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64nk16(float (&d)[kN / 2], uint64_t da, uint64_t db) {
  static_assert(kN == 16 || kN == 32 || kN == 64, "wgmma_m64nk16: N of 16, 32 or 64");
  if constexpr (kN == 16) {
    wgmma_m64n16k16<T, kTransA, kTransB>(d, da, db);
  } else if constexpr (kN == 32) {
    wgmma_m64n32k16<T, kTransA, kTransB>(d, da, db);
  } else {
    wgmma_m64n64k16<T, kTransA, kTransB>(d, da, db);
  }
}

}  // namespace moe::gpu::wgmma
