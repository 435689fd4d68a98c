/* The moe-harness plugin ABI: implementations of SPEC ops built outside the harness (another
 * repository, another compiler) as a shared library, loaded by `moe-harness check --plugin
 * path/libmine.so`. C only: no C++ types and no exceptions cross it (a C++ plugin must catch
 * everything); errors are status codes plus a message written into the call's buffer.
 *
 * Tensors are DLPack DLTensors (dlpack/dlpack.h, Debian's libdlpack-dev; PyTorch, JAX, CuPy and
 * TransformerEngine speak it), compact row-major (strides NULL), in host memory for a kDLCPU op
 * and in the current CUDA device's memory for a kDLCUDA op. Bool tensors (routing maps) use
 * code 6 (kDLBool of DLPack >= 0.8), 8 bits, one byte per element. Parameters are the SPEC §14
 * `params` JSON of the case; `case_line` carries every parameter of the harness's Case
 * (shapes included) as `key=value` words.
 *
 * A plugin exports two functions:
 *
 *   uint32_t moe_plugin_abi_version(void);     // returns MOE_PLUGIN_ABI_VERSION it was built with
 *   const moe_plugin* moe_plugin_describe(void);
 *
 * The harness calls moe_plugin_abi_version first and refuses a plugin of another version before
 * it reads anything else. Every pointer the plugin returns must stay valid until it is unloaded.
 */
#ifndef MOE_HARNESS_PLUGIN_H
#define MOE_HARNESS_PLUGIN_H

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_PLUGIN_ABI_VERSION 1u

#if defined(_WIN32)
#define MOE_PLUGIN_EXPORT __declspec(dllexport)
#else
#define MOE_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

/* Status codes of moe_plugin_op.run. */
#define MOE_STATUS_OK 0
#define MOE_STATUS_NOT_SUPPORTED 1 /* the case is outside what the op supports (message: why) */
#define MOE_STATUS_ERROR 2         /* anything else (message: what went wrong) */

#define MOE_DLBOOL 6 /* DLDataTypeCode of bool tensors (kDLBool in DLPack >= 0.8) */

typedef struct moe_named_tensor {
  const char* name; /* SPEC §14 name: "input.logits", "output.probs", "grad.logits", ... */
  DLTensor tensor;
} moe_named_tensor;

typedef struct moe_call {
  uint32_t abi_version;    /* MOE_PLUGIN_ABI_VERSION of the harness */
  const char* op;          /* SPEC op name */
  const char* case_line;   /* the harness Case, e.g. "op=topk_router dtype=bfloat16 ... E=32" */
  const char* params_json; /* SPEC §14 params, e.g. {"topk":4,"score_function":"sigmoid",...} */
  const char* dtype;       /* activation dtype: "float32", "bfloat16" or "float16" */
  int64_t num_inputs;
  const moe_named_tensor* inputs; /* input.* and cotangent.*: read only */
  int64_t num_outputs;
  const moe_named_tensor* outputs; /* output.* and grad.*: poisoned; write every one you provide */
  void* stream;                    /* kDLCUDA ops: the cudaStream_t to launch on; NULL otherwise */
  char* message;                   /* NUL-terminated reason or error, at most message_size bytes */
  size_t message_size;
} moe_call;

typedef struct moe_plugin_op {
  const char* op;      /* SPEC op name, e.g. "topk_router" */
  int32_t device_type; /* kDLCPU or kDLCUDA: where the op wants its tensors */
  /* Comma-separated output.* / grad.* names the op writes (the others are not compared), or
   * NULL for all of them. */
  const char* provides;
  int32_t deterministic; /* nonzero: two calls give bitwise-equal outputs (checked) */
  /* Runs forward and backward of one case; returns a MOE_STATUS_* code. Must return (within the
   * stream's work, for kDLCUDA) with every provided output written. */
  int32_t (*run)(const moe_call* call);
} moe_plugin_op;

typedef struct moe_plugin {
  const char* name;    /* implementation name shown by the harness, e.g. "te" (no spaces) */
  const char* version; /* free text */
  int32_t num_ops;
  const moe_plugin_op* ops;
} moe_plugin;

typedef uint32_t (*moe_plugin_abi_version_fn)(void);
typedef const moe_plugin* (*moe_plugin_describe_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* MOE_HARNESS_PLUGIN_H */
