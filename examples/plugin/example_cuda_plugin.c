/* A device-memory plugin (kDLCUDA): sort_chunks_by_index (SPEC §7) on tensors that live on the
 * GPU, as a framework's custom op would see them. The map is computed on the host from the two
 * small index tensors; the rows move with cudaMemcpyAsync on the stream the harness gives. With
 * -DMOE_EXAMPLE_PLANT_BUGS the rows past the valid ones (SPEC R1) are not copied. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_harness/plugin.h"

static const DLTensor* find(const moe_named_tensor* ts, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    if (strcmp(ts[i].name, name) == 0) return &ts[i].tensor;
  return NULL;
}

static int32_t fail(const moe_call* c, int32_t status, const char* msg) {
  snprintf(c->message, c->message_size, "%s", msg);
  return status;
}

/* The int32/int64 index tensor t, copied to the host as int64. */
static int64_t* to_host(const DLTensor* t, int64_t n, cudaStream_t s) {
  const size_t w = (size_t)t->dtype.bits / 8;
  char* raw = malloc(n * w + 1);
  int64_t* out = malloc(sizeof(int64_t) * (n + 1));
  cudaMemcpyAsync(raw, t->data, n * w, cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  for (int64_t i = 0; i < n; ++i)
    out[i] = w == 8 ? ((int64_t*)raw)[i] : ((int32_t*)raw)[i];
  free(raw);
  return out;
}

static int32_t sort_chunks_run(const moe_call* c) {
  cudaStream_t s = (cudaStream_t)c->stream;
  const DLTensor* x = find(c->inputs, c->num_inputs, "input.x");
  const DLTensor* split = find(c->inputs, c->num_inputs, "input.split_sizes");
  const DLTensor* order = find(c->inputs, c->num_inputs, "input.sorted_indices");
  const DLTensor* probs = find(c->inputs, c->num_inputs, "input.probs");
  const DLTensor* ct = find(c->inputs, c->num_inputs, "cotangent.sorted");
  const DLTensor* ctp = find(c->inputs, c->num_inputs, "cotangent.sorted_probs");
  const DLTensor* sorted = find(c->outputs, c->num_outputs, "output.sorted");
  const DLTensor* map = find(c->outputs, c->num_outputs, "output.row_id_map");
  const DLTensor* sprobs = find(c->outputs, c->num_outputs, "output.sorted_probs");
  const DLTensor* gx = find(c->outputs, c->num_outputs, "grad.x");
  const DLTensor* gp = find(c->outputs, c->num_outputs, "grad.probs");
  if (!x || !split || !order || !sorted || !map) return fail(c, MOE_STATUS_ERROR, "missing tensors");
  if (x->device.device_type != kDLCUDA) return fail(c, MOE_STATUS_ERROR, "expected device tensors");
  const int64_t N = x->shape[0], C = split->shape[0];
  size_t row = (size_t)x->dtype.bits / 8;
  for (int i = 1; i < x->ndim; ++i) row *= (size_t)x->shape[i];
  int64_t* sz = to_host(split, C, s);
  int64_t* idx = to_host(order, C, s);
  int64_t *start = calloc(C + 1, sizeof(int64_t)), *dst = calloc(C + 1, sizeof(int64_t));
  int32_t* m = malloc(sizeof(int32_t) * (N + 1));
  int64_t V = 0, acc = 0;
  for (int64_t i = 0; i < C; ++i) start[i] = V, V += sz[i];
  for (int64_t j = 0; j < C; ++j) dst[idx[j]] = acc, acc += sz[idx[j]];
  for (int64_t ch = 0; ch < C; ++ch)
    for (int64_t o = 0; o < sz[ch]; ++o) m[start[ch] + o] = (int32_t)(dst[ch] + o);
#ifdef MOE_EXAMPLE_PLANT_BUGS
  const int64_t rows = V; /* PLANTED (padding, SPEC R1) */
#else
  const int64_t rows = N;
#endif
  for (int64_t i = V; i < rows; ++i) m[i] = (int32_t)i;
  const size_t pw = probs ? (size_t)probs->dtype.bits / 8 : 0;
  for (int64_t i = 0; i < rows; ++i) {
    const size_t d = (size_t)m[i];
    cudaMemcpyAsync((char*)sorted->data + d * row, (const char*)x->data + i * row, row,
                    cudaMemcpyDeviceToDevice, s);
    if (gx && ct)
      cudaMemcpyAsync((char*)gx->data + i * row, (const char*)ct->data + d * row, row,
                      cudaMemcpyDeviceToDevice, s);
    if (probs && sprobs)
      cudaMemcpyAsync((char*)sprobs->data + d * pw, (const char*)probs->data + i * pw, pw,
                      cudaMemcpyDeviceToDevice, s);
    if (gp && ctp)
      cudaMemcpyAsync((char*)gp->data + i * pw, (const char*)ctp->data + d * pw, pw,
                      cudaMemcpyDeviceToDevice, s);
  }
  if (rows > 0)
    cudaMemcpyAsync(map->data, m, sizeof(int32_t) * (size_t)rows, cudaMemcpyHostToDevice, s);
  cudaStreamSynchronize(s); /* m is freed below */
  free(sz), free(idx), free(start), free(dst), free(m);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? MOE_STATUS_OK : fail(c, MOE_STATUS_ERROR, cudaGetErrorString(e));
}

static const moe_plugin_op kOps[] = {{"sort_chunks_by_index", kDLCUDA, NULL, 1, sort_chunks_run}};
static const moe_plugin kPlugin = {"example-cuda", "1.0", 1, kOps};

MOE_PLUGIN_EXPORT uint32_t moe_plugin_abi_version(void) { return MOE_PLUGIN_ABI_VERSION; }
MOE_PLUGIN_EXPORT const moe_plugin* moe_plugin_describe(void) { return &kPlugin; }
