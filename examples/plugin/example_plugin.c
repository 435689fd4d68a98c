/* An implementation of three SPEC ops written outside the harness, in plain C against the plugin
 * ABI (moe_harness/plugin.h): topk_router (SPEC §1, fp32 arithmetic with the C library's expf
 * and log1pf, so its scores differ from the harness's own by an ulp here and there, as SPEC §1.4
 * allows), moe_aux_loss (§3) and sort_chunks_by_index (§7). float32 and bfloat16 tensors; float16
 * cases are declared unsupported.
 *
 * Built by cmake/plugins.cmake: as is (every check must pass), and with
 * -DMOE_EXAMPLE_PLANT_BUGS, which plants one realistic bug per op (each marked PLANTED below) that
 * `moe-harness check --plugin` must catch. -DMOE_EXAMPLE_ABI_VERSION=N builds a plugin that claims
 * another ABI version, which the harness must refuse. -DMOE_EXAMPLE_FLAKY_CALL=N plants a race
 * that shows now and then: sort_chunks_by_index changes one bit of its output on the N-th call in a
 * row with the same case, which `check` passes with its default two calls a case and fails under
 * `--runs N` or more. -DMOE_EXAMPLE_FAULTS builds one that crashes or hangs on some cases (see
 * planted_fault), which `check` must name. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_harness/plugin.h"

#ifndef MOE_EXAMPLE_ABI_VERSION
#define MOE_EXAMPLE_ABI_VERSION MOE_PLUGIN_ABI_VERSION
#endif

/* ---- tensors ---------------------------------------------------------------------------- */

static const DLTensor* find(const moe_named_tensor* ts, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    if (strcmp(ts[i].name, name) == 0) return &ts[i].tensor;
  return NULL;
}

static int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

static int is_f32(const DLTensor* t) { return t->dtype.code == kDLFloat && t->dtype.bits == 32; }
static int is_bf16(const DLTensor* t) { return t->dtype.code == kDLBfloat && t->dtype.bits == 16; }

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Element i of a float or integer tensor as float (exact for every dtype used here). */
static float get(const DLTensor* t, int64_t i) {
  const char* p = (const char*)t->data + t->byte_offset;
  if (is_f32(t)) return ((const float*)p)[i];
  if (is_bf16(t)) return bf16_to_f32(((const uint16_t*)p)[i]);
  if (t->dtype.code == kDLInt && t->dtype.bits == 32) return (float)((const int32_t*)p)[i];
  if (t->dtype.code == kDLInt && t->dtype.bits == 64) return (float)((const int64_t*)p)[i];
  return NAN;
}

static int64_t get_int(const DLTensor* t, int64_t i) {
  const char* p = (const char*)t->data + t->byte_offset;
  if (t->dtype.bits == 64) return ((const int64_t*)p)[i];
  return ((const int32_t*)p)[i];
}

/* Rounds v to t's dtype (f32 or bf16) and stores it. */
static void put(const DLTensor* t, int64_t i, float v) {
  char* p = (char*)t->data + t->byte_offset;
  if (is_f32(t))
    ((float*)p)[i] = v;
  else
    ((uint16_t*)p)[i] = f32_to_bf16(v);
}

static size_t elem_size(const DLTensor* t) { return (size_t)(t->dtype.bits / 8); }

static int fail(const moe_call* c, int32_t status, const char* msg) {
  snprintf(c->message, c->message_size, "%s", msg);
  return status;
}

/* Every float tensor of the call must be f32 or bf16, else the case is not supported. */
static int supported_dtypes(const moe_call* c) {
  for (int64_t i = 0; i < c->num_inputs; ++i) {
    const DLTensor* t = &c->inputs[i].tensor;
    if ((t->dtype.code == kDLFloat || t->dtype.code == kDLBfloat) && !is_f32(t) && !is_bf16(t))
      return 0;
  }
  for (int64_t i = 0; i < c->num_outputs; ++i) {
    const DLTensor* t = &c->outputs[i].tensor;
    if ((t->dtype.code == kDLFloat || t->dtype.code == kDLBfloat) && !is_f32(t) && !is_bf16(t))
      return 0;
  }
  return 1;
}

/* ---- params JSON: a flat object of numbers, bools, strings and nulls ---------------------- */

static const char* json_value(const char* json, const char* key) {
  char pat[96];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char* p = strstr(json, pat);
  return p ? p + strlen(pat) : NULL;
}

static double json_number(const char* json, const char* key, double dflt) {
  const char* v = json_value(json, key);
  if (!v || strncmp(v, "null", 4) == 0) return dflt;
  if (strncmp(v, "true", 4) == 0) return 1;
  if (strncmp(v, "false", 5) == 0) return 0;
  return strtod(v, NULL);
}

static int json_string_is(const char* json, const char* key, const char* want) {
  const char* v = json_value(json, key);
  size_t n = strlen(want);
  return v && v[0] == '"' && strncmp(v + 1, want, n) == 0 && v[1 + n] == '"';
}

/* ---- topk_router (SPEC §1) ------------------------------------------------------------------ */

enum { SOFTMAX, SIGMOID, SQRTSOFTPLUS };

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
static float sqrtsoftplusf(float x) { return sqrtf(x > 20.0f ? x : log1pf(expf(x))); }

/* Index of the largest z[e] among e with !taken[e] && allowed[e]; ties to the lower index. */
static int64_t argmax(const float* z, const char* taken, const char* allowed, int64_t n) {
  int64_t best = -1;
  for (int64_t e = 0; e < n; ++e) {
    if (taken[e] || (allowed && !allowed[e])) continue;
    if (best < 0 || z[e] > z[best]) best = e;
  }
  return best;
}

static int32_t topk_router_run(const moe_call* c) {
  if (!supported_dtypes(c)) return fail(c, MOE_STATUS_NOT_SUPPORTED, "float16 is not implemented");
  const DLTensor* logits = find(c->inputs, c->num_inputs, "input.logits");
  const DLTensor* bias = find(c->inputs, c->num_inputs, "input.expert_bias");
  const DLTensor* ct = find(c->inputs, c->num_inputs, "cotangent.probs");
  const DLTensor* probs = find(c->outputs, c->num_outputs, "output.probs");
  const DLTensor* map = find(c->outputs, c->num_outputs, "output.routing_map");
  const DLTensor* saved = find(c->outputs, c->num_outputs, "output.saved_scores");
  const DLTensor* grad = find(c->outputs, c->num_outputs, "grad.logits");
  if (!logits || !probs || !map || !saved) return fail(c, MOE_STATUS_ERROR, "missing tensors");
  const char* js = c->params_json;
  const int64_t T = logits->shape[0], E = logits->shape[1];
  if (logits->ndim != 2 || T < 0 || E <= 0) return fail(c, MOE_STATUS_ERROR, "bad logits shape");
  const int64_t K = (int64_t)json_number(js, "topk", 1);
  const int64_t gk = (int64_t)json_number(js, "group_topk", 0);
  const int64_t G = gk > 0 ? (int64_t)json_number(js, "num_groups", 1) : 1;
  const float scale = (float)json_number(js, "scaling_factor", 1.0);
  const int pre = json_number(js, "use_pre_softmax", 0) != 0;
  const int bitmap = json_string_is(js, "routing_map_format", "bitmap_u8");
  const int f = json_string_is(js, "score_function", "softmax")   ? SOFTMAX
                : json_string_is(js, "score_function", "sigmoid") ? SIGMOID
                                                                  : SQRTSOFTPLUS;
  const float eps = 1e-20f;
  float *s = malloc(sizeof(float) * (E + 1)), *z = malloc(sizeof(float) * (E + 1));
  float* gsc = malloc(sizeof(float) * (G + 1));
  char *sel = malloc(E + 1), *taken = malloc(E + 1), *allowed = malloc(E + 1);
  char* gtaken = malloc(G + 1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = t * E;
    /* 1. scores and saved scores */
    float m = -INFINITY, sum = 0;
    for (int64_t e = 0; e < E; ++e) m = fmaxf(m, get(logits, row + e));
    for (int64_t e = 0; e < E; ++e) {
      const float x = get(logits, row + e);
      if (f == SOFTMAX && pre) {
        s[e] = expf(x - m);
        sum += s[e];
      } else if (f == SOFTMAX) {
        s[e] = x;
      } else {
        s[e] = f == SIGMOID ? sigmoidf(x) : sqrtsoftplusf(x);
      }
    }
    if (f == SOFTMAX && pre) {
      const float inv = 1.0f / sum;
      for (int64_t e = 0; e < E; ++e) s[e] *= inv;
    }
    /* 2. selection scores */
    for (int64_t e = 0; e < E; ++e) z[e] = s[e] + (bias && f != SOFTMAX ? get(bias, e) : 0.0f);
    /* 3. selection (grouped: the g_k best groups by the sum of their k' best, then top-K) */
    memset(sel, 0, E);
    memset(allowed, 1, E);
    if (gk > 0) {
      const int64_t per = E / G, kp = K / gk;
      for (int64_t g = 0; g < G; ++g) {
        memset(taken, 0, E);
        gsc[g] = 0;
        for (int64_t i = 0; i < kp; ++i) {
          int64_t b = argmax(z + g * per, taken + g * per, NULL, per);
          taken[g * per + b] = 1;
          gsc[g] += z[g * per + b];
        }
      }
      memset(gtaken, 0, G);
      for (int64_t i = 0; i < gk; ++i) gtaken[argmax(gsc, gtaken, NULL, G)] = 1;
      for (int64_t e = 0; e < E; ++e) allowed[e] = gtaken[e / per];
    }
    memset(taken, 0, E);
    for (int64_t i = 0; i < K; ++i) taken[argmax(z, taken, allowed, E)] = 1;
    memcpy(sel, taken, E);
    /* 4.-6. unbias, post-process, scale */
    float A = 0, mx = -INFINITY, den = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (!sel[e]) continue;
      const float v = bias && f != SOFTMAX ? (z[e] - get(bias, e)) : s[e];
      s[e] = f == SOFTMAX && !pre ? s[e] : v; /* v_e */
      A += s[e];
      mx = fmaxf(mx, get(logits, row + e));
    }
    for (int64_t e = 0; e < E; ++e) {
      float saved_v = f == SQRTSOFTPLUS ? get(logits, row + e) : s[e];
      if (f == SOFTMAX && !pre) saved_v = -INFINITY;
      if (f == SIGMOID) saved_v = sigmoidf(get(logits, row + e)); /* unbiased */
      ((float*)saved->data)[row + e] = saved_v;
    }
    if (f == SOFTMAX && !pre)
      for (int64_t e = 0; e < E; ++e)
        if (sel[e]) den += expf(get(logits, row + e) - mx);
    for (int64_t e = 0; e < E; ++e) {
      float p = 0;
      if (sel[e]) {
        if (f == SOFTMAX && !pre) {
          p = expf(get(logits, row + e) - mx) / den;
          ((float*)saved->data)[row + e] = p;
        } else if (f == SOFTMAX || K == 1) {
          p = s[e];
        } else {
          p = s[e] / (A + eps);
        }
      }
      put(probs, row + e, sel[e] ? scale * p : 0.0f);
    }
    /* routing map: bool bytes, or bits LSB first */
    uint8_t* mp = (uint8_t*)map->data;
    if (bitmap) {
      const int64_t nb = (E + 7) / 8;
      memset(mp + t * nb, 0, nb);
      for (int64_t e = 0; e < E; ++e)
        if (sel[e]) mp[t * nb + e / 8] |= (uint8_t)(1u << (e % 8));
    } else {
      for (int64_t e = 0; e < E; ++e) mp[row + e] = sel[e];
    }
    /* backward (SPEC §1.3), from the saved scores this call wrote */
    if (!grad || !ct) continue;
    const float* a = (const float*)saved->data + row;
    float Ag = 0, B = 0, dot = 0;
    for (int64_t e = 0; e < E; ++e) {
      const float g = get(ct, row + e) * scale;
      if (f == SQRTSOFTPLUS) {
        if (sel[e]) {
          const float y = sqrtsoftplusf(a[e]);
          Ag += y;
          B += g * y;
        }
      } else if (f == SIGMOID) {
        if (sel[e]) {
          Ag += a[e];
          B += g * a[e];
        }
      } else if (sel[e]) {
        dot += g * a[e];
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      float g = get(ct, row + e) * scale, out = 0;
      if (f == SOFTMAX) {
        if (pre)
          out = a[e] * ((sel[e] ? g : 0.0f) - dot);
        else
          out = sel[e] ? a[e] * (g - dot) : 0.0f;
      } else if (sel[e]) {
#ifdef MOE_EXAMPLE_PLANT_BUGS
        /* PLANTED (missing gradient term): the normaliser's -B/(A+eps)^2 term is left out. */
        if (K > 1) g = g / (Ag + eps);
#else
        if (K > 1) g = g / (Ag + eps) - B / ((Ag + eps) * (Ag + eps));
#endif
        if (f == SIGMOID) {
          out = g * a[e] * (1.0f - a[e]);
        } else {
          const float y = sqrtsoftplusf(a[e]);
          out = g * ((a[e] > 20.0f ? 1.0f : sigmoidf(a[e])) / (2.0f * y + eps));
        }
      }
      put(grad, row + e, out);
    }
  }
  free(s);
  free(z);
  free(gsc);
  free(sel);
  free(taken);
  free(allowed);
  free(gtaken);
  return MOE_STATUS_OK;
}

/* ---- moe_aux_loss (SPEC §3) ----------------------------------------------------------------- */

static int32_t moe_aux_loss_run(const moe_call* c) {
  if (!supported_dtypes(c)) return fail(c, MOE_STATUS_NOT_SUPPORTED, "float16 is not implemented");
  const DLTensor* probs = find(c->inputs, c->num_inputs, "input.probs");
  const DLTensor* tpe = find(c->inputs, c->num_inputs, "input.tokens_per_expert");
  const DLTensor* ct = find(c->inputs, c->num_inputs, "cotangent.aux_loss");
  const DLTensor* loss = find(c->outputs, c->num_outputs, "output.aux_loss");
  const DLTensor* cbuf = find(c->outputs, c->num_outputs, "output.const_buf");
  const DLTensor* grad = find(c->outputs, c->num_outputs, "grad.probs");
  if (!probs || !tpe || !loss || !cbuf) return fail(c, MOE_STATUS_ERROR, "missing tensors");
  const int64_t R = probs->shape[0], C = probs->shape[1];
  const float E = (float)json_number(c->params_json, "num_experts", (double)C);
  const float K = (float)json_number(c->params_json, "topk", 1);
  const float coeff = (float)json_number(c->params_json, "coeff", 0);
  const float Tt = (float)json_number(c->params_json, "total_num_tokens", (double)R);
  const float kappa = ((E * coeff) / K / Tt) / Tt; /* every step fp32, in SPEC's order */
  float total = 0;
#ifdef MOE_EXAMPLE_PLANT_BUGS
  const int64_t cols = C > 1 ? C - 1 : C; /* PLANTED (edge): the last expert column is skipped */
#else
  const int64_t cols = C;
#endif
  for (int64_t col = 0; col < cols; ++col) {
    float colsum = 0;
    for (int64_t r = 0; r < R; ++r) colsum += get(probs, r * C + col);
    total += get(tpe, col) * colsum;
  }
  put(loss, 0, kappa * total);
  ((float*)cbuf->data)[0] = kappa;
  ((float*)cbuf->data)[1] = kappa * total;
  if (grad && ct) {
    const float g = get(ct, 0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t col = 0; col < C; ++col) put(grad, r * C + col, (kappa * get(tpe, col)) * g);
  }
  return MOE_STATUS_OK;
}

/* ---- sort_chunks_by_index (SPEC §7) --------------------------------------------------------- */

#ifdef MOE_EXAMPLE_FAULTS
/* PLANTED (crash, hang): with MOE_EXAMPLE_FAULT=crash or hang in the environment, the cases whose
 * line hashes to 1 mod 4 dereference a null pointer (SIGSEGV) or spin for ever, the same on every
 * replay of the case. `check` must name the case (and stop a hang under --case-timeout). */
static void planted_fault(const moe_call* c) {
  const char* mode = getenv("MOE_EXAMPLE_FAULT");
  if (!mode) return;
  unsigned long h = 5381;
  for (const char* p = c->case_line; *p; ++p) h = h * 33u + (unsigned char)*p;
  if (h % 4 != 1) return;
  if (strcmp(mode, "crash") == 0) {
    volatile int* null = (volatile int*)(uintptr_t)strtoul("0", NULL, 10); /* opaque: a real fault */
    *null = 1;
  } else if (strcmp(mode, "hang") == 0) {
    volatile unsigned long spin = 0;
    for (;;) ++spin;
  }
}
#endif

static int32_t sort_chunks_run(const moe_call* c) {
#ifdef MOE_EXAMPLE_FAULTS
  planted_fault(c);
#endif
  if (!supported_dtypes(c)) return fail(c, MOE_STATUS_NOT_SUPPORTED, "float16 is not implemented");
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
  const int64_t N = x->shape[0], C = numel(split);
  const int64_t H = x->ndim > 1 ? numel(x) / (N > 0 ? N : 1) : 1;
  int64_t* start = calloc((size_t)C + 1, sizeof(int64_t));
  int64_t* dst_start = calloc((size_t)C + 1, sizeof(int64_t));
  int64_t V = 0, acc = 0;
  for (int64_t i = 0; i < C; ++i) {
    start[i] = V;
    V += get_int(split, i);
  }
  for (int64_t j = 0; j < C; ++j) { /* where chunk sorted_indices[j] lands */
    const int64_t chunk = get_int(order, j);
    if (chunk < 0 || chunk >= C) {
      free(start);
      free(dst_start);
      return fail(c, MOE_STATUS_ERROR, "sorted_indices is not a permutation");
    }
    dst_start[chunk] = acc;
    acc += get_int(split, chunk);
  }
  int32_t* m = (int32_t*)map->data;
  for (int64_t chunk = 0; chunk < C; ++chunk)
    for (int64_t o = 0; o < get_int(split, chunk); ++o)
      m[start[chunk] + o] = (int32_t)(dst_start[chunk] + o);
#ifdef MOE_EXAMPLE_PLANT_BUGS
  /* PLANTED (padding, SPEC R1): rows past the valid ones are left unmapped and unwritten. */
  const int64_t rows = V;
#else
  const int64_t rows = N;
#endif
  for (int64_t i = V; i < rows; ++i) m[i] = (int32_t)i;
  const size_t row_bytes = (size_t)H * elem_size(x);
  for (int64_t i = 0; i < rows; ++i) {
    memcpy((char*)sorted->data + (size_t)m[i] * row_bytes, (const char*)x->data + i * row_bytes,
           row_bytes);
    if (probs && sprobs) put(sprobs, m[i], get(probs, i));
    if (gx && ct)
      memcpy((char*)gx->data + i * row_bytes, (const char*)ct->data + (size_t)m[i] * row_bytes,
             row_bytes);
    if (gp && ctp) put(gp, i, get(ctp, m[i]));
  }
  free(start);
  free(dst_start);
#ifdef MOE_EXAMPLE_FLAKY_CALL
  { /* PLANTED (race): the N-th call in a row of one case flips the low bit of output.sorted's
     * first byte. The harness calls a plugin's ops one at a time, so plain statics will do. */
    static unsigned long last_hash;
    static int repeat;
    unsigned long h = 5381;
    for (const char* p = c->case_line; *p; ++p) h = h * 33u + (unsigned char)*p;
    repeat = h == last_hash ? repeat + 1 : 1;
    last_hash = h;
    if (repeat == MOE_EXAMPLE_FLAKY_CALL && N > 0 && H > 0) ((unsigned char*)sorted->data)[0] ^= 1u;
  }
#endif
  return MOE_STATUS_OK;
}

/* ---- the descriptor ------------------------------------------------------------------------- */

static const moe_plugin_op kOps[] = {
    {"topk_router", kDLCPU, NULL, 1, topk_router_run},
    {"moe_aux_loss", kDLCPU, NULL, 1, moe_aux_loss_run},
    {"sort_chunks_by_index", kDLCPU, NULL, 1, sort_chunks_run},
};

static const moe_plugin kPlugin = {"example", "1.0", 3, kOps};

MOE_PLUGIN_EXPORT uint32_t moe_plugin_abi_version(void) { return MOE_EXAMPLE_ABI_VERSION; }
MOE_PLUGIN_EXPORT const moe_plugin* moe_plugin_describe(void) { return &kPlugin; }
