#include "golden/schema.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <set>
#include <sstream>

namespace moe::golden {

namespace {

using json = nlohmann::json;

// "logits expert_bias?:F32|BF16" -> specs; '?' marks an optional tensor, ':' lists its dtypes.
std::vector<TensorSpec> specs(const std::string& list) {
  std::vector<TensorSpec> out;
  std::istringstream in(list);
  std::string tok;
  while (in >> tok) {
    TensorSpec s;
    const auto colon = tok.find(':');
    std::string name = tok.substr(0, colon);
    if (!name.empty() && name.back() == '?') {
      s.optional = true;
      name.pop_back();
    }
    s.name = name;
    if (colon != std::string::npos) {
      std::string codes = tok.substr(colon + 1);
      size_t pos = 0;
      while (pos <= codes.size()) {
        const size_t bar = std::min(codes.find('|', pos), codes.size());
        s.dtypes.push_back(*parse_dtype_code(codes.substr(pos, bar - pos)));
        pos = bar + 1;
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::string> words(const std::string& list) {
  std::vector<std::string> out;
  std::istringstream in(list);
  std::string w;
  while (in >> w) out.push_back(w);
  std::sort(out.begin(), out.end());
  return out;
}

OpSchema row(const char* op, const char* in, const char* out, const char* ct, const char* grad,
             const char* params) {
  return {op, specs(in), specs(out), specs(ct), specs(grad), words(params)};
}

const std::map<std::string, ParamKind>& kinds() {
  static const std::map<std::string, ParamKind> k = [] {
    std::map<std::string, ParamKind> m;
    for (auto& w : words("topk num_groups group_topk num_experts total_num_tokens num_out_tokens "
                         "align_size num_tokens num_real_tokens padding_size roll_to_expert_id "
                         "num_ep ep_size dp_size")) {
      m[w] = ParamKind::integer;
    }
    for (auto& w : words("scaling_factor coeff aux_loss_coeff")) m[w] = ParamKind::number;
    for (auto& w : words("use_pre_softmax drop_overflow")) m[w] = ParamKind::boolean;
    for (auto& w : words("score_function routing_map_format direction activation backend "
                         "probs_dtype router_logits_dtype")) {
      m[w] = ParamKind::string;
    }
    return m;
  }();
  return k;
}

bool kind_matches(ParamKind k, const json& v) {
  if (v.is_null()) return true;  // an absent optional parameter
  switch (k) {
    case ParamKind::integer:
      return v.is_number_integer();
    case ParamKind::number:
      return v.is_number_float();
    case ParamKind::boolean:
      return v.is_boolean();
    case ParamKind::string:
      return v.is_string();
  }
  return false;
}

std::string_view kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::integer:
      return "an integer";
    case ParamKind::number:
      return "a float written with '.' or an exponent";
    case ParamKind::boolean:
      return "a bool";
    case ParamKind::string:
      return "a string";
  }
  return "?";
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "(none)" : s;
}

const TensorSpec* find_spec(const std::vector<TensorSpec>& v, const std::string& name) {
  for (auto& s : v)
    if (s.name == name) return &s;
  return nullptr;
}

}  // namespace

const std::vector<OpSchema>& op_schemas() {
  // SPEC §14 table, row by row. [DEVIATION] saved_scores is optional here (a file may omit
  // it): TE's public router and aux-score APIs return (probs, routing_map) / (scores,
  // routing_map) only, and `golden verify` compares what a file holds.
  static const std::vector<OpSchema> table = {
      row("topk_router", "logits expert_bias?", "probs routing_map:BOOL|U8 saved_scores?:F32",
          "probs", "logits",
          "topk score_function use_pre_softmax num_groups group_topk scaling_factor "
          "routing_map_format"),
      row("aux_loss_scores", "logits", "scores:F32 routing_map:BOOL|U8 saved_scores?:F32", "scores",
          "logits", "topk score_function routing_map_format"),
      row("moe_aux_loss", "probs tokens_per_expert:I32|I64", "aux_loss const_buf:F32", "aux_loss",
          "probs", "topk coeff num_experts total_num_tokens"),
      row("token_dispatch", "x routing_map:BOOL probs?",
          "permuted permuted_probs? row_id_map:I32 pad_offsets?:I32 tokens_per_expert:I32",
          "permuted permuted_probs?", "x probs?", "num_out_tokens align_size drop_overflow"),
      row("token_combine", "permuted row_id_map merging_probs? pad_offsets?", "combined",
          "combined", "permuted merging_probs?", ""),
      row("permute_index_map", "x indices:I32", "permuted row_id_map:I32", "permuted", "x",
          "num_out_tokens"),
      row("unpermute_index_map", "permuted row_id_map probs?:F32", "combined", "combined",
          "permuted probs?", "num_tokens topk"),
      row("sort_chunks_by_index", "x split_sizes sorted_indices probs?",
          "sorted row_id_map sorted_probs?", "sorted sorted_probs?", "x probs?", ""),
      row("routing_map_to_selected_experts", "sparse_probs routing_map",
          "selected_experts:I32 weights", "weights", "sparse_probs", "topk"),
      row("argsort_token_dispatch", "x selected_experts",
          "sorted_x sorted_indices:I32 group_sizes:I32", "sorted_x", "x",
          "num_experts topk align_size roll_to_expert_id"),
      row("argsort_token_combine", "expert_outputs sorted_indices weights", "combined", "combined",
          "expert_outputs weights", "topk num_real_tokens padding_size"),
      row("ragged_a2a_params", "all_shards_tokens_per_expert",
          "input_offsets send_sizes output_offsets recv_sizes", "", "", "num_ep direction"),
      row("ragged_all_to_all",
          "operand output_init input_offsets send_sizes output_offsets recv_sizes", "result",
          "result", "operand", "num_ep"),
      row("local_permute_after_a2a", "x_recv all_shards_tokens_per_expert",
          "sorted_x local_group_sizes row_id_map", "sorted_x", "x_recv", "num_ep"),
      row("local_unpermute_before_a2a", "expert_outputs row_id_map", "out", "out", "expert_outputs",
          "num_ep"),
      row("grouped_gemm", "x w group_sizes:I32 bias?", "out", "out", "x w bias?", ""),
      row("swiglu_expert_ffn", "x group_sizes wi_0 wi_1 wo wi_0_bias? wi_1_bias? wo_bias?",
          "out gate_proj up_proj intermediate", "out",
          "x wi_0 wi_1 wo wi_0_bias? wi_1_bias? wo_bias?", "activation"),
      row("moe_block", "x gate_kernel wi_0 wi_1 wo wi_0_bias? wi_1_bias? wo_bias? expert_bias?",
          "y aux_loss? routing_map?:BOOL probs? group_sizes?:I32", "y aux_loss?",
          "x gate_kernel wi_0 wi_1 wo wi_0_bias? wi_1_bias? wo_bias?",
          "num_experts topk activation score_function use_pre_softmax num_groups group_topk "
          "scaling_factor aux_loss_coeff backend align_size ep_size dp_size probs_dtype "
          "router_logits_dtype"),
  };
  return table;
}

const OpSchema* find_schema(std::string_view op) {
  for (auto& s : op_schemas())
    if (s.op == op) return &s;
  return nullptr;
}

ParamKind param_kind(const std::string& key) {
  return kinds().at(key);
}

std::string format_params(const json& params) {
  return params.dump();
}

Metadata make_metadata(const std::string& op, DType dtype, uint64_t seed, const json& params,
                       const Metadata& extra) {
  Metadata m = extra;
  m["format"] = std::string(kFormat);
  m["op"] = op;
  m["params"] = format_params(params);
  m["dtype"] = std::string(dtype_name(dtype));
  m["seed"] = std::to_string(seed);
  return m;
}

Header check_schema(const File& file, const std::string& source) {
  auto fail = [&](const std::string& d) { return FormatError(source, Fault::schema, d); };
  auto meta = [&](const std::string& key) -> const std::string& {
    auto it = file.metadata.find(key);
    if (it == file.metadata.end()) throw fail("__metadata__ has no '" + key + "'");
    return it->second;
  };
  Header h;
  if (meta("format") != kFormat) {
    throw fail("format is '" + meta("format") + "', expected '" + std::string(kFormat) + "'");
  }
  h.op = meta("op");
  h.schema = find_schema(h.op);
  if (!h.schema) throw fail("op '" + h.op + "' is not in the SPEC §14 table");
  const OpSchema& s = *h.schema;

  const std::string& dt = meta("dtype");
  if (dt != "float32" && dt != "bfloat16" && dt != "float16") {
    throw fail("dtype '" + dt + "' is not float32, bfloat16 or float16");
  }
  h.dtype = parse_dtype(dt);

  const std::string& seed = meta("seed");
  auto r = std::from_chars(seed.data(), seed.data() + seed.size(), h.seed);
  if (seed.empty() || r.ec != std::errc() || r.ptr != seed.data() + seed.size() ||
      (seed.size() > 1 && seed[0] == '0')) {
    throw fail("seed '" + seed + "' is not a decimal u64");
  }

  h.params_text = meta("params");
  try {
    h.params = parse_json_strict(h.params_text, source, "params", 1, 0);
  } catch (const FormatError& e) {
    throw fail(e.detail());
  }
  if (!h.params.is_object()) throw fail("params '" + h.params_text + "' is not a JSON object");
  std::vector<std::string> keys;
  for (auto& [k, v] : h.params.items()) keys.push_back(k);
  if (keys != s.params) {
    throw fail("params of " + h.op + " have keys {" + join(keys) + "}, SPEC §14 says {" +
               join(s.params) + "}");
  }
  for (auto& [k, v] : h.params.items()) {
    const ParamKind kind = param_kind(k);
    if (!kind_matches(kind, v)) {
      throw fail("params: " + k + " = " + v.dump() + " is not " + std::string(kind_name(kind)) +
                 " or null");
    }
  }
  if (format_params(h.params) != h.params_text) {
    throw fail("params '" + h.params_text +
               "' is not canonical (compact, sorted keys): expected '" + format_params(h.params) +
               "'");
  }

  // Tensor names: every tensor known to the op, required ones present, dtypes as the table says.
  const std::pair<const char*, const std::vector<TensorSpec>*> groups[] = {
      {"input.", &s.inputs},
      {"output.", &s.outputs},
      {"cotangent.", &s.cotangents},
      {"grad.", &s.grads},
  };
  bool backward = false;
  for (auto& [name, t] : file.tensors) {
    const TensorSpec* spec = nullptr;
    std::string n;
    for (auto& [prefix, list] : groups) {
      if (name.rfind(prefix, 0) == 0) {
        n = name.substr(std::string_view(prefix).size());
        spec = find_spec(*list, n);
        if (std::string_view(prefix) == "cotangent.") backward = true;
        break;
      }
    }
    if (!spec) throw fail("tensor '" + name + "' is not a tensor of " + h.op + " (SPEC §14)");
    if (!spec->dtypes.empty() &&
        std::find(spec->dtypes.begin(), spec->dtypes.end(), t.dtype()) == spec->dtypes.end()) {
      std::vector<std::string> allowed;
      for (DType d : spec->dtypes) allowed.emplace_back(dtype_code(d));
      throw fail("tensor '" + name + "' is " + std::string(dtype_code(t.dtype())) +
                 ", SPEC §14 allows " + join(allowed));
    }
    if (name.rfind("cotangent.", 0) == 0 && !file.tensors.count("output." + n)) {
      throw fail("tensor '" + name + "' has no output." + n);
    }
    if (name.rfind("grad.", 0) == 0 && !file.tensors.count("input." + n)) {
      throw fail("tensor '" + name + "' has no input." + n);
    }
  }
  auto require = [&](const char* prefix, const std::vector<TensorSpec>& list, const char* why) {
    for (auto& spec : list) {
      const std::string key = prefix + spec.name;
      if (!spec.optional && !file.tensors.count(key)) {
        throw fail("tensor '" + key + "' is missing (" + why + ")");
      }
    }
  };
  // An optional cotangent or grad is required exactly when its output or input is present.
  auto require_with = [&](const char* prefix, const std::vector<TensorSpec>& list,
                          const char* partner) {
    for (auto& spec : list) {
      const std::string key = prefix + spec.name, other = partner + spec.name;
      if (spec.optional && file.tensors.count(other) && !file.tensors.count(key)) {
        throw fail("tensor '" + key + "' is missing (" + other + " is present in a backward case)");
      }
    }
  };
  require("input.", s.inputs, "required input");
  require("output.", s.outputs, "required output");
  if (backward) {
    require("cotangent.", s.cotangents, "a backward case has every cotangent");
    require("grad.", s.grads, "a backward case has every grad");
    require_with("cotangent.", s.cotangents, "output.");
    require_with("grad.", s.grads, "input.");
  } else {
    for (auto& [name, t] : file.tensors) {
      if (name.rfind("grad.", 0) == 0) {
        throw fail("tensor '" + name + "' in a forward-only case (no cotangent.*)");
      }
    }
  }
  return h;
}

}  // namespace moe::golden
