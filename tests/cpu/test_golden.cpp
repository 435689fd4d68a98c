// Golden files (SPEC §14): safetensors writer/reader round trip, one test per rejection the
// reader must make, moe-golden/1 schema rejections, the fuzz corpus replayed as unit tests, and
// record -> verify -> diff -> show over the registry.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <unistd.h>

#include "golden/golden.h"
#include "golden/safetensors.h"
#include "golden/schema.h"
#include "harness/ops/check.h"
#include "harness/ops/registry.h"

namespace {

namespace fs = std::filesystem;
using moe::DType;
using moe::Tensor;
using moe::TensorMap;
using moe::golden::Fault;
using moe::golden::File;
using moe::golden::FormatError;
using ::testing::HasSubstr;

std::string le64(uint64_t n) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  return s;
}

// A file image from header text and data bytes, without the writer's padding.
std::string image(const std::string& header, const std::string& data = "") {
  return le64(header.size()) + header + data;
}

// Fresh directory per test, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() / ("moe_golden_" + std::string(info ? info->name() : "rc") +
                                        "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

TensorMap every_dtype() {
  TensorMap m;
  m.emplace("a.f64", Tensor::from(DType::f64, {2}, {1.0 / 3.0, -0.0}));
  m.emplace("b.f32", Tensor::from(DType::f32, {2, 2}, {1.5, -2.25, INFINITY, 1e-40}));
  m.emplace("c.bf16", Tensor::from(DType::bf16, {3}, {1.0, -3.140625, 65280.0}));
  m.emplace("d.f16", Tensor::from(DType::f16, {1, 3}, {0.5, -65504.0, 6e-8}));
  m.emplace("e.i64", Tensor::from(DType::i64, {2}, {-5, 1LL << 40}));
  m.emplace("f.i32", Tensor::from(DType::i32, {3}, {-1, 0, 2147483647}));
  m.emplace("g.u8", Tensor::from(DType::u8, {2}, {0, 255}));
  m.emplace("h.bool", Tensor::from(DType::boolean, {2, 1}, {1, 0}));
  m.emplace("i.scalar", Tensor::from(DType::f32, {}, {7.0}));
  m.emplace("j.empty", Tensor(DType::bf16, {0, 3}));
  return m;
}

void expect_same(const TensorMap& a, const TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (auto& [k, t] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(b.at(k).bitwise_equal(t))
        << k << ": " << t.describe() << " vs " << b.at(k).describe();
  }
}

// ------------------------------------------------------------------ writer / reader

TEST(GoldenFormat, RoundTripEveryDtypeScalarAndEmpty) {
  const TensorMap m = every_dtype();
  const moe::golden::Metadata meta = {{"format", "moe-golden/1"}, {"note", "unicode \xc3\xa9 ok"}};
  const std::string bytes = moe::golden::serialize(m, meta);
  const File f = moe::golden::parse(bytes, "mem");
  expect_same(m, f.tensors);
  EXPECT_EQ(f.metadata, meta);
  EXPECT_EQ(f.header_len % 8, 0u) << "header padded to a multiple of 8 (SPEC §14)";
  EXPECT_EQ(bytes.at(8), '{');
  // Padding is spaces, and tensors sit in ascending name order from offset 0 without holes.
  const std::string header = bytes.substr(8, f.header_len);
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));
  const auto j = nlohmann::json::parse(header);
  uint64_t off = 0;
  for (auto& [name, t] : m) {
    const auto& e = j.at(name);
    EXPECT_EQ(e.at("data_offsets")[0].get<uint64_t>(), off) << name;
    off += t.nbytes();
    EXPECT_EQ(e.at("data_offsets")[1].get<uint64_t>(), off) << name;
  }
  EXPECT_EQ(bytes.size(), 8 + f.header_len + off);
  EXPECT_EQ(j.at("i.scalar").at("shape"), nlohmann::json::array());
}

TEST(GoldenFormat, FileRoundTripAndMissingFile) {
  TempDir dir;
  const TensorMap m = every_dtype();
  moe::golden::write_file(dir.file("x.safetensors"), m, {{"k", "v"}});
  expect_same(m, moe::golden::read_file(dir.file("x.safetensors")).tensors);
  try {
    moe::golden::read_file(dir.file("missing.safetensors"));
    FAIL() << "no error for a missing file";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.fault(), Fault::io);
    EXPECT_THAT(e.what(), HasSubstr("missing.safetensors"));
  }
}

TEST(GoldenFormat, AcceptsTensorsListedOutOfOffsetOrder) {
  // The safetensors crate accepts any listing order as long as the offsets tile the buffer.
  const File f = moe::golden::parse(image(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                          R"("a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                                          "\x01\x02\x03"),
                                    "mem");
  EXPECT_EQ(f.tensors.at("b").at(0), 1.0);
  EXPECT_EQ(f.tensors.at("a").at(1), 3.0);
}

TEST(GoldenFormat, WriterRejectsWhatItCannotStore) {
  TensorMap m;
  m.emplace("__metadata__", Tensor(DType::f32, {1}));
  EXPECT_THROW(moe::golden::serialize(m, {}), std::invalid_argument);
  TensorMap b;
  Tensor t(DType::boolean, {1});
  t.fill_bytes(2);
  b.emplace("x", std::move(t));
  EXPECT_THROW(moe::golden::serialize(b, {}), std::invalid_argument);
}

RC_GTEST_PROP(GoldenFormat, RandomTensorsRoundTrip, ()) {
  const auto n = *rc::gen::inRange(0, 6);
  TensorMap m;
  for (int i = 0; i < n; ++i) {
    const DType dt = *rc::gen::element(DType::f64, DType::f32, DType::bf16, DType::f16, DType::i64,
                                       DType::i32, DType::u8, DType::boolean);
    const auto shape = *rc::gen::container<std::vector<int64_t>>(*rc::gen::inRange<size_t>(0, 4),
                                                                 rc::gen::inRange<int64_t>(0, 5));
    Tensor t(dt, shape);
    const auto raw =
        *rc::gen::container<std::vector<uint8_t>>(t.nbytes(), rc::gen::arbitrary<uint8_t>());
    for (size_t k = 0; k < t.nbytes(); ++k) {
      t.bytes()[k] = std::byte{dt == DType::boolean ? static_cast<uint8_t>(raw[k] & 1) : raw[k]};
    }
    m.emplace("t" + std::to_string(i) + "." + std::string(moe::dtype_name(dt)), std::move(t));
  }
  const std::string bytes = moe::golden::serialize(m, {{"seed", "1"}});
  const File f = moe::golden::parse(bytes, "mem");
  RC_ASSERT(f.tensors.size() == m.size());
  for (auto& [k, t] : m) RC_ASSERT(f.tensors.at(k).bitwise_equal(t));
}

// Any prefix and any one-byte change of a valid file is either accepted or a FormatError.
RC_GTEST_PROP(GoldenFormat, TruncatedOrFlippedFilesNeverCrash, ()) {
  static const std::string good =
      moe::golden::serialize(every_dtype(), {{"format", "moe-golden/1"}});
  const auto cut = *rc::gen::inRange<size_t>(0, good.size() + 1);
  std::string bad = good.substr(0, cut);
  if (!bad.empty() && *rc::gen::arbitrary<bool>()) {
    const auto at = *rc::gen::inRange<size_t>(0, bad.size());
    bad[at] = static_cast<char>(*rc::gen::arbitrary<uint8_t>());
  }
  try {
    moe::golden::parse(bad, "mem");
    RC_CLASSIFY(true, "accepted");
  } catch (const FormatError& e) {
    RC_ASSERT(std::string(e.what()).rfind("mem: ", 0) == 0);
  }
}

// ------------------------------------------------------------------ every rejection

struct Rejection {
  const char* name;
  std::function<std::string()> bytes;
  Fault fault;
  const char* detail;  // substring of the message
};

const std::string kU8 = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";

std::string one(const std::string& entry, const std::string& data = "\x01") {
  return image(R"({"a":)" + entry + "}", data);
}

const Rejection kRejections[] = {
    {"HeaderTooSmall", [] { return std::string("abc"); }, Fault::header_too_small, "3 bytes"},
    {"HeaderLengthOnly7Bytes", [] { return le64(0).substr(0, 7); }, Fault::header_too_small, "7"},
    {"HeaderTooLarge", [] { return le64(100'000'001) + "{}"; }, Fault::header_too_large,
     "100000001"},
    {"HeaderLengthNearU64Max", [] { return le64(~0ull) + "{}"; }, Fault::header_too_large, ""},
    {"TruncatedHeader", [] { return le64(100) + "{}"; }, Fault::truncated_header, "100"},
    {"NotUtf8", [] { return image("{\"a\xff\":1}"); }, Fault::not_utf8, "UTF-8"},
    {"OverlongUtf8", [] { return image("{\"\xc0\xaf\":1}"); }, Fault::not_utf8, "UTF-8"},
    {"SurrogateUtf8", [] { return image("{\"\xed\xa0\x80\":1}"); }, Fault::not_utf8, "UTF-8"},
    {"TruncatedUtf8", [] { return image("{\"\xe2\x82"); }, Fault::not_utf8, "UTF-8"},
    {"EmptyHeader", [] { return image(""); }, Fault::header_start, "empty"},
    {"NotStartingWithBrace", [] { return image(" {}"); }, Fault::header_start, "32"},
    {"ArrayHeader", [] { return image("[]"); }, Fault::header_start, ""},
    {"InvalidJson", [] { return image(R"({"a":})"); }, Fault::bad_json, "header"},
    {"TrailingGarbage", [] { return image("{}x"); }, Fault::bad_json, ""},
    {"NulPadding", [] { return image(std::string("{}\0\0", 4)); }, Fault::bad_json, "NUL"},
    {"UnterminatedObject", [] { return image(R"({"a":{"dtype":"U8")"); }, Fault::bad_json, ""},
    {"LoneSurrogateEscape", [] { return image(R"({"__metadata__":{"k":"\ud800"}})"); },
     Fault::bad_json, ""},
    {"DuplicateTensorKey", [] { return image(R"({"a":)" + kU8 + R"(,"a":)" + kU8 + "}", "\x01"); },
     Fault::duplicate_key, "'a'"},
    {"DuplicateMetadataKey", [] { return image(R"({"__metadata__":{"k":"1","k":"2"}})"); },
     Fault::duplicate_key, "'k'"},
    {"DuplicateMetadataObject", [] { return image(R"({"__metadata__":{},"__metadata__":{}})"); },
     Fault::duplicate_key, "__metadata__"},
    {"DuplicateEntryField",
     [] { return one(R"({"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]})"); },
     Fault::duplicate_key, "dtype"},
    {"NestingTooDeep", [] { return image(R"({"a":{"b":{"c":{"d":1}}}})"); }, Fault::too_deep,
     "deeper"},
    {"ShapeTooLong",
     [] {
       std::string dims = "1";
       for (int i = 0; i < 64; ++i) dims += ",1";
       return one(R"({"dtype":"U8","shape":[)" + dims + R"(],"data_offsets":[0,1]})");
     },
     Fault::too_deep, "array"},
    {"MetadataNotObject", [] { return image(R"({"__metadata__":"x"})"); }, Fault::bad_metadata,
     "string"},
    {"NonStringMetadata", [] { return image(R"({"__metadata__":{"seed":7}})"); },
     Fault::bad_metadata, "'seed'"},
    {"NullMetadataValue", [] { return image(R"({"__metadata__":{"k":null}})"); },
     Fault::bad_metadata, "'k'"},
    {"EntryNotObject", [] { return image(R"({"a":[0,1]})"); }, Fault::bad_entry, "'a'"},
    {"EmptyTensorName", [] { return image(R"({"":)" + kU8 + "}", "\x01"); }, Fault::bad_entry,
     "empty"},
    {"MissingDtype", [] { return one(R"({"shape":[1],"data_offsets":[0,1]})"); }, Fault::bad_entry,
     "'dtype'"},
    {"MissingShape", [] { return one(R"({"dtype":"U8","data_offsets":[0,1]})"); }, Fault::bad_entry,
     "'shape'"},
    {"MissingOffsets", [] { return one(R"({"dtype":"U8","shape":[1]})"); }, Fault::bad_entry,
     "'data_offsets'"},
    {"UnknownEntryField",
     [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1})"); },
     Fault::bad_entry, "'x'"},
    {"DtypeNotString", [] { return one(R"({"dtype":4,"shape":[1],"data_offsets":[0,1]})"); },
     Fault::bad_entry, "dtype"},
    {"ShapeNotArray", [] { return one(R"({"dtype":"U8","shape":1,"data_offsets":[0,1]})"); },
     Fault::bad_entry, "shape"},
    {"OffsetsNotPair", [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":[0]})"); },
     Fault::bad_entry, "pair"},
    {"UnknownDtype", [] { return one(R"({"dtype":"F12","shape":[1],"data_offsets":[0,1]})"); },
     Fault::unknown_dtype, "'F12'"},
    {"DisallowedDtype",
     [] {
       return one(R"({"dtype":"I16","shape":[1],"data_offsets":[0,2]})",
                  std::string("\x01\x00", 2));
     },
     Fault::unknown_dtype, "I32"},
    {"LowercaseDtype", [] { return one(R"({"dtype":"u8","shape":[1],"data_offsets":[0,1]})"); },
     Fault::unknown_dtype, "'u8'"},
    {"NonIntegerOffset", [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":[0.0,1]})"); },
     Fault::bad_number, "data_offsets[0]"},
    {"NegativeOffset", [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":[-1,1]})"); },
     Fault::bad_number, "negative"},
    {"StringOffset", [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":["0",1]})"); },
     Fault::bad_number, "string"},
    {"OffsetBeyondU64",
     [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551616]})"); },
     Fault::bad_number, "data_offsets[1]"},
    {"NegativeDim", [] { return one(R"({"dtype":"U8","shape":[-1],"data_offsets":[0,1]})"); },
     Fault::bad_number, "shape[0]"},
    {"FloatDim", [] { return one(R"({"dtype":"U8","shape":[1.0],"data_offsets":[0,1]})"); },
     Fault::bad_number, "shape[0]"},
    {"DimBeyondInt64",
     [] { return one(R"({"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1]})"); },
     Fault::shape_overflow, "int64"},
    {"ElementCountOverflow",
     [] {
       return one(R"({"dtype":"F64","shape":[4294967296,4294967296,0],"data_offsets":[0,0]})", "");
     },
     Fault::shape_overflow, "overflows"},
    {"ByteSizeOverflow",
     [] {
       return one(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]})", "");
     },
     Fault::shape_overflow, "overflows"},
    {"LengthMismatch",
     [] {
       return one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})", std::string(4, '\0'));
     },
     Fault::length_mismatch, "needs 8"},
    {"OffsetsReversed", [] { return one(R"({"dtype":"U8","shape":[0],"data_offsets":[1,0]})"); },
     Fault::offsets_not_contiguous, "end first"},
    {"OffsetsHole",
     [] {
       return image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                    R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                    "\x01\x02\x03");
     },
     Fault::offsets_not_contiguous, "belong to no tensor"},
    {"FirstTensorNotAtZero",
     [] { return one(R"({"dtype":"U8","shape":[1],"data_offsets":[1,2]})", "\x01\x02"); },
     Fault::offsets_not_contiguous, "[0, 1)"},
    {"OffsetsOverlap",
     [] {
       return image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                    R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                    "\x01\x02\x03");
     },
     Fault::offsets_not_contiguous, "inside tensor 'a'"},
    {"TwoTensorsOneRange", [] { return image(R"({"a":)" + kU8 + R"(,"b":)" + kU8 + "}", "\x01"); },
     Fault::offsets_not_contiguous, "inside"},
    {"OffsetsOutOfRange",
     [] { return one(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4]})", "\x01\x02"); },
     Fault::offsets_out_of_range, "2 bytes"},
    {"BufferLongerThanTensors", [] { return one(kU8, "\x01\x02"); }, Fault::buffer_size_mismatch,
     "2 bytes"},
    {"DataWithoutTensors", [] { return image("{}", "\x01"); }, Fault::buffer_size_mismatch,
     "cover 0"},
    {"BoolByteNotZeroOrOne",
     [] { return one(R"({"dtype":"BOOL","shape":[2],"data_offsets":[0,2]})", "\x01\x02"); },
     Fault::bad_bool, "element 1"},
};

class Reject : public ::testing::TestWithParam<Rejection> {};

TEST_P(Reject, NamesFileAndFault) {
  const Rejection& r = GetParam();
  try {
    moe::golden::parse(r.bytes(), "case.safetensors");
    FAIL() << r.name << ": accepted";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.fault(), r.fault) << e.what();
    EXPECT_EQ(e.file(), "case.safetensors");
    EXPECT_THAT(e.what(), HasSubstr("case.safetensors: "));
    EXPECT_THAT(e.what(), HasSubstr(std::string(moe::golden::fault_name(r.fault))));
    EXPECT_THAT(e.what(), HasSubstr(r.detail));
  }
}

INSTANTIATE_TEST_SUITE_P(GoldenFormat, Reject, ::testing::ValuesIn(kRejections),
                         [](const auto& info) { return std::string(info.param.name); });

// ------------------------------------------------------------------ schema (moe-golden/1)

moe::Case small_router_case() {
  return moe::Case::parse(
      "op=topk_router dtype=float32 regime=uniform seed=11 name=test_small T=5 E=6 topk=2 "
      "score_function=sigmoid use_pre_softmax=false num_groups=0 group_topk=0 "
      "scaling_factor=1.5 routing_map_format=bytemap expert_bias=true grad_dtype=float32");
}

File recorded_file(const moe::Case& c) {
  moe::golden::Recorded r = moe::golden::record_case(c);
  File f;
  f.metadata = std::move(r.metadata);
  f.tensors = std::move(r.tensors);
  return f;
}

TEST(GoldenSchema, RecordedFileIsValid) {
  const File f = recorded_file(small_router_case());
  const moe::golden::Header h = moe::golden::check_schema(f, "x");
  EXPECT_EQ(h.op, "topk_router");
  EXPECT_EQ(h.seed, 11u);
  EXPECT_EQ(h.dtype, DType::f32);
  EXPECT_EQ(h.params_text,
            R"({"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
            R"("scaling_factor":1.5,"score_function":"sigmoid","topk":2,"use_pre_softmax":false})");
  for (const char* k : {"x-generator", "x-git", "x-backend", "x-device", "x-toolkit", "x-case"}) {
    EXPECT_TRUE(f.metadata.count(k)) << k;
  }
  EXPECT_EQ(f.metadata.at("x-case"), small_router_case().line());
  EXPECT_THAT(f.metadata.at("x-generator"), HasSubstr(MOE_VERSION));
}

TEST(GoldenSchema, EveryParamKeyHasAKindAndTablesAreSorted) {
  for (auto& s : moe::golden::op_schemas()) {
    EXPECT_TRUE(std::is_sorted(s.params.begin(), s.params.end())) << s.op;
    for (auto& k : s.params) EXPECT_NO_THROW(moe::golden::param_kind(k)) << s.op << "." << k;
    EXPECT_FALSE(s.outputs.empty()) << s.op;
  }
  EXPECT_EQ(moe::golden::op_schemas().size(), 18u);  // every row of the §14 table
}

TEST(GoldenSchema, EveryRegisteredOpIsInTheTable) {
  for (const moe::ops::OpInfo* op : moe::ops::all_ops()) {
    EXPECT_NE(moe::golden::find_schema(op->name), nullptr) << op->name;
  }
}

struct SchemaRejection {
  const char* name;
  std::function<void(File&)> mutate;
  const char* detail;
};

void set_params(File& f, const std::string& p) {
  f.metadata["params"] = p;
}

const SchemaRejection kSchemaRejections[] = {
    {"MissingFormat", [](File& f) { f.metadata.erase("format"); }, "'format'"},
    {"WrongFormat", [](File& f) { f.metadata["format"] = "moe-golden/2"; }, "moe-golden/2"},
    {"MissingOp", [](File& f) { f.metadata.erase("op"); }, "'op'"},
    {"UnknownOp", [](File& f) { f.metadata["op"] = "softmax_router"; }, "softmax_router"},
    {"Float64Dtype", [](File& f) { f.metadata["dtype"] = "float64"; }, "float64"},
    {"ShortDtypeSpelling", [](File& f) { f.metadata["dtype"] = "f32"; }, "'f32'"},
    {"NegativeSeed", [](File& f) { f.metadata["seed"] = "-1"; }, "seed"},
    {"SeedLeadingZero", [](File& f) { f.metadata["seed"] = "011"; }, "seed"},
    {"SeedBeyondU64", [](File& f) { f.metadata["seed"] = "18446744073709551616"; }, "seed"},
    {"MissingSeed", [](File& f) { f.metadata.erase("seed"); }, "'seed'"},
    {"MissingParams", [](File& f) { f.metadata.erase("params"); }, "'params'"},
    {"ParamsNotJson", [](File& f) { set_params(f, "{topk:2}"); }, "params"},
    {"ParamsNotObject", [](File& f) { set_params(f, "2"); }, "not a JSON object"},
    {"ParamsDuplicateKey",
     [](File& f) {
       set_params(f, R"({"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1.5,"score_function":"sigmoid","topk":2,"topk":2,)"
                     R"("use_pre_softmax":false})");
     },
     "duplicate key 'topk'"},
    {"ParamsMissingKey",
     [](File& f) {
       set_params(f, R"({"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1.5,"score_function":"sigmoid","topk":2})");
     },
     "use_pre_softmax"},
    {"ParamsExtraKey",
     [](File& f) {
       set_params(f, R"({"T":5,"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1.5,"score_function":"sigmoid","topk":2,)"
                     R"("use_pre_softmax":false})");
     },
     "keys {T, "},
    {"ParamsFloatWrittenAsInteger",
     [](File& f) {
       set_params(f, R"({"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1,"score_function":"sigmoid","topk":2,)"
                     R"("use_pre_softmax":false})");
     },
     "scaling_factor = 1 is not a float"},
    {"ParamsIntegerWrittenAsFloat",
     [](File& f) {
       set_params(f, R"({"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1.5,"score_function":"sigmoid","topk":2.0,)"
                     R"("use_pre_softmax":false})");
     },
     "topk = 2.0 is not an integer"},
    {"ParamsNested",
     [](File& f) {
       set_params(f, R"({"group_topk":0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1.5,"score_function":"sigmoid","topk":[2],)"
                     R"("use_pre_softmax":false})");
     },
     "params"},
    {"ParamsNotCompact",
     [](File& f) {
       set_params(f, R"({"group_topk": 0,"num_groups":0,"routing_map_format":"bytemap",)"
                     R"("scaling_factor":1.5,"score_function":"sigmoid","topk":2,)"
                     R"("use_pre_softmax":false})");
     },
     "not canonical"},
    {"UnknownTensorName",
     [](File& f) { f.tensors.emplace("input.weights", Tensor(DType::f32, {1})); },
     "'input.weights'"},
    {"UnknownTensorPrefix",
     [](File& f) { f.tensors.emplace("state.logits", Tensor(DType::f32, {1})); }, "'state.logits'"},
    {"SavedScoresNotF32",
     [](File& f) {
       f.tensors["output.saved_scores"] = Tensor(DType::bf16, {5, 6});
     },
     "'output.saved_scores' is BF16"},
    {"MissingRequiredOutput", [](File& f) { f.tensors.erase("output.routing_map"); },
     "'output.routing_map' is missing"},
    {"MissingRequiredInput", [](File& f) { f.tensors.erase("input.logits"); }, "input.logits"},
    {"GradInForwardOnlyCase", [](File& f) { f.tensors.erase("cotangent.probs"); }, "forward-only"},
    {"BackwardCaseWithoutGrad", [](File& f) { f.tensors.erase("grad.logits"); },
     "'grad.logits' is missing"},
    {"GradOfInputWithoutGrad",
     [](File& f) { f.tensors.emplace("grad.expert_bias", Tensor(DType::f32, {6})); },
     "grad.expert_bias"},
};

class RejectSchema : public ::testing::TestWithParam<SchemaRejection> {};

TEST_P(RejectSchema, NamesFileAndFault) {
  File f = recorded_file(small_router_case());
  GetParam().mutate(f);
  try {
    moe::golden::check_schema(f, "case.safetensors");
    FAIL() << GetParam().name << ": accepted";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.fault(), Fault::schema) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("case.safetensors: not a moe-golden/1 file: "));
    EXPECT_THAT(e.what(), HasSubstr(GetParam().detail));
  }
}

INSTANTIATE_TEST_SUITE_P(GoldenSchema, RejectSchema, ::testing::ValuesIn(kSchemaRejections),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(GoldenSchema, UnknownMetadataKeysAreIgnored) {
  File f = recorded_file(small_router_case());
  f.metadata["comment"] = "written by hand";
  f.metadata["x-other-tool"] = "1";
  EXPECT_NO_THROW(moe::golden::check_schema(f, "x"));
}

// ------------------------------------------------------------------ fuzz corpus replay

// Every committed corpus input and crash reproducer: accepted, or rejected with a FormatError;
// what is accepted round-trips through the writer.
TEST(GoldenFuzzCorpus, ReplayEveryInput) {
  int n = 0, accepted = 0;
  for (const char* sub : {"/tests/fuzz/corpus", "/tests/fuzz/crashes"}) {
    const fs::path dir = fs::path(MOE_SOURCE_DIR) / std::string(sub).substr(1);
    if (!fs::exists(dir)) continue;
    for (auto& e : fs::directory_iterator(dir)) {
      if (!e.is_regular_file()) continue;
      std::ifstream in(e.path(), std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      ++n;
      try {
        const File f = moe::golden::parse(ss.str(), e.path().filename().string());
        ++accepted;
        const File g = moe::golden::parse(moe::golden::serialize(f.tensors, f.metadata), "again");
        expect_same(f.tensors, g.tensors);
        EXPECT_EQ(f.metadata, g.metadata) << e.path();
      } catch (const FormatError& err) {
        EXPECT_EQ(err.file(), e.path().filename().string());
      }
    }
  }
  EXPECT_GE(n, 10) << "the committed fuzz corpus is missing";
  EXPECT_GE(accepted, 3) << "the corpus must hold valid files too";
}

// ------------------------------------------------------------------ record / verify / diff / show

TEST(GoldenTool, UlpDistance) {
  auto d32 = [](float a, float b) {
    return moe::golden::ulp_distance(DType::f32, reinterpret_cast<const std::byte*>(&a),
                                     reinterpret_cast<const std::byte*>(&b));
  };
  EXPECT_EQ(d32(1.0f, std::nextafter(1.0f, 2.0f)), 1u);
  EXPECT_EQ(d32(0.0f, -0.0f), 0u);
  EXPECT_EQ(d32(-1e-45f, 1e-45f), 2u);
  EXPECT_EQ(d32(1.0f, 2.0f), 1u << 23);
  const uint16_t a = moe::bf16_bits(1.0), b = moe::bf16_bits(1.0078125);
  EXPECT_EQ(moe::golden::ulp_distance(DType::bf16, reinterpret_cast<const std::byte*>(&a),
                                      reinterpret_cast<const std::byte*>(&b)),
            1u);
}

TEST(GoldenTool, RecordThenVerifyPasses) {
  TempDir dir;
  const moe::Case c = small_router_case();
  moe::golden::RecordOptions o;
  o.out_dir = dir.path.string();
  o.case_line = c.line();
  std::ostringstream log;
  ASSERT_EQ(moe::golden::record(o, log), 0) << log.str();
  const std::string path = dir.file(moe::golden::file_name(c));
  EXPECT_EQ(moe::golden::file_name(c), "topk_router__test_small__float32.safetensors");
  const auto r = moe::golden::verify_file(path, "reference");
  EXPECT_EQ(r.verdict, "PASS") << r.report;
  EXPECT_EQ(r.op, "topk_router");
  EXPECT_EQ(r.worst_pct, 0.0) << "the reference reproduces its own file bit for bit";
}

// Writes f's tensors back under path, keeping its metadata.
void rewrite(const std::string& path, const std::function<void(File&)>& mutate) {
  File f = moe::golden::read_file(path);
  mutate(f);
  moe::golden::write_file(path, f.tensors, f.metadata);
}

TEST(GoldenTool, VerifyFailsOnATamperedOutputWithReportAndReplay) {
  TempDir dir;
  const moe::Case c = small_router_case();
  const std::string path = dir.file("a.safetensors");
  const File orig = recorded_file(c);
  moe::golden::write_file(path, orig.tensors, orig.metadata);
  rewrite(path, [](File& f) {
    Tensor& p = f.tensors.at("output.probs");
    for (int64_t i = 0; i < p.numel(); ++i) {
      if (p.at(i) != 0) {
        p.set(i, p.at(i) * 1.01);  // far beyond the §12 bound of a few ulps
        break;
      }
    }
  });
  const auto r = moe::golden::verify_file(path, "reference");
  EXPECT_EQ(r.verdict, "FAIL");
  EXPECT_THAT(r.report, HasSubstr("output.probs"));
  EXPECT_THAT(r.report, HasSubstr("first at ("));
  EXPECT_THAT(r.replay, HasSubstr("moe-harness check --impl reference --case '" + c.line()));
  EXPECT_GT(r.worst_pct, 100.0);

  std::ostringstream out;
  EXPECT_EQ(moe::golden::verify({dir.path.string()}, "reference", dir.file("j.xml"), out), 1);
  EXPECT_THAT(out.str(), HasSubstr("FAIL"));
  EXPECT_THAT(out.str(), HasSubstr("0 passed, 1 failed"));
  std::ifstream j(dir.file("j.xml"));
  std::stringstream xml;
  xml << j.rdbuf();
  EXPECT_THAT(xml.str(),
              HasSubstr("<testcase classname=\"golden.topk_router\" name=\"a.safetensors\""));
  EXPECT_THAT(xml.str(), HasSubstr("<failure message="));
  EXPECT_THAT(xml.str(), HasSubstr("--case &apos;op=topk_router"));

  // diff against the untouched file: one element, its coordinate and ULP distance.
  moe::golden::write_file(dir.file("b.safetensors"), orig.tensors, orig.metadata);
  std::ostringstream d;
  EXPECT_EQ(moe::golden::diff(path, dir.file("b.safetensors"), d), 1);
  EXPECT_THAT(d.str(), HasSubstr("output.probs: 1 of 30 elements differ"));
  EXPECT_THAT(d.str(), HasSubstr("ulp histogram: >64K:1"));
  EXPECT_THAT(d.str(), HasSubstr("first at (0, "));
  EXPECT_THAT(d.str(), HasSubstr("input.logits: identical"));
  std::ostringstream same;
  EXPECT_EQ(moe::golden::diff(dir.file("b.safetensors"), dir.file("b.safetensors"), same), 0);
}

TEST(GoldenTool, VerifyErrorsOnInconsistentParamsOrCase) {
  TempDir dir;
  const File orig = recorded_file(small_router_case());
  const std::string path = dir.file("a.safetensors");
  // x-case that disagrees with the stored params.
  moe::golden::write_file(path, orig.tensors, orig.metadata);
  rewrite(path, [](File& f) {
    std::string x = f.metadata.at("x-case");
    x.replace(x.find("topk=2"), 6, "topk=3");
    f.metadata["x-case"] = x;
  });
  auto r = moe::golden::verify_file(path, "reference");
  EXPECT_EQ(r.verdict, "ERROR");
  EXPECT_THAT(r.report, HasSubstr("differ from the op's to_params"));
  // A file whose schema check fails is an ERROR naming the file.
  rewrite(path, [](File& f) { f.metadata["format"] = "other"; });
  r = moe::golden::verify_file(path, "reference");
  EXPECT_EQ(r.verdict, "ERROR");
  EXPECT_THAT(r.report, HasSubstr(path + ": not a moe-golden/1 file"));
  // A missing path is an ERROR row, never skipped.
  r = moe::golden::verify_file(dir.file("none.safetensors"), "reference");
  EXPECT_EQ(r.verdict, "ERROR");
  std::ostringstream out;
  EXPECT_EQ(moe::golden::verify({dir.file("empty_dir_does_not_exist")}, "reference", "", out), 1);
}

TEST(GoldenTool, VerifyWithoutXCaseUsesFromParams) {
  TempDir dir;
  File f = recorded_file(small_router_case());
  f.metadata.erase("x-case");
  const std::string path = dir.file("external.safetensors");
  moe::golden::write_file(path, f.tensors, f.metadata);
  const auto r = moe::golden::verify_file(path, "reference");
  EXPECT_EQ(r.verdict, "PASS") << r.report;
}

TEST(GoldenTool, ShowPrintsMetadataAndSummaries) {
  TempDir dir;
  const File f = recorded_file(small_router_case());
  moe::golden::write_file(dir.file("a.safetensors"), f.tensors, f.metadata);
  std::ostringstream out;
  EXPECT_EQ(moe::golden::show(dir.file("a.safetensors"), out), 0);
  EXPECT_THAT(out.str(), HasSubstr("schema: valid moe-golden/1"));
  EXPECT_THAT(out.str(), HasSubstr("op: topk_router"));
  EXPECT_THAT(out.str(), HasSubstr("output.saved_scores"));
  EXPECT_THAT(out.str(), HasSubstr("[5, 6]"));
  std::ostringstream bad;
  EXPECT_EQ(moe::golden::show(dir.file("nope.safetensors"), bad), 2);
}

// Generic over the registry: for every op, its smallest named case records and verifies.
TEST(GoldenTool, EveryRegisteredOpRecordsAndVerifies) {
  TempDir dir;
  for (const moe::ops::OpInfo* op : moe::ops::all_ops()) {
    if (!op->named || !op->to_params) continue;
    const auto cases = op->named();
    ASSERT_FALSE(cases.empty()) << op->name << " has no named cases";
    size_t best = 0, best_bytes = SIZE_MAX;
    for (size_t i = 0; i < cases.size(); ++i) {
      size_t bytes = 0;
      for (auto& [k, t] : op->make_inputs(cases[i])) bytes += t.nbytes();
      if (bytes < best_bytes && bytes > 0) best = i, best_bytes = bytes;
    }
    const moe::Case& c = cases[best];
    moe::golden::RecordOptions o;
    o.out_dir = dir.path.string();
    o.case_line = c.line();
    std::ostringstream log;
    ASSERT_EQ(moe::golden::record(o, log), 0) << log.str();
    const std::string path = dir.file(moe::golden::file_name(c));
    const auto r = moe::golden::verify_file(path, "reference");
    EXPECT_EQ(r.verdict, "PASS") << op->name << "\n" << r.report << r.replay;
    // The same file as another tool would write it (no x-case): from_params rebuilds the case.
    rewrite(path, [](File& f) { f.metadata.erase("x-case"); });
    const auto p = moe::golden::verify_file(path, "reference");
    EXPECT_EQ(p.verdict, "PASS") << op->name << " via from_params\n" << p.report << p.replay;
  }
}

TEST(GoldenTool, VerifyOnGpuWithoutGpuIsAUsageError) {
  if (moe::ops::gpu_available()) GTEST_SKIP() << "a GPU is present";
  std::ostringstream out;
  EXPECT_EQ(moe::golden::verify({std::string(MOE_SOURCE_DIR) + "/golden/data"}, "gpu", "", out), 2);
  EXPECT_THAT(out.str(), HasSubstr("no CUDA GPU"));
}

TEST(GoldenTool, CatalogueRejectsUnknownOp) {
  EXPECT_THROW(moe::golden::catalogue("no_such_op"), std::invalid_argument);
  EXPECT_FALSE(moe::golden::catalogue().empty());
}

}  // namespace
