// turbokv: the command-line client of turbokvd.
//
// Every command declares its flags (name, kind, default, range); the command
// line is checked against that table before anything is sent, so an unknown
// flag or a bad value stops the command with exit status 2 naming it.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "client/cpp/demo.h"
#include "kernels/half.h"

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

// Exit statuses (also in the help text, README.md and docs/API.md).
constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;       // the daemon answered with an error not listed below
constexpr int kExitUsage = 2;        // bad command line, or INVALID_ARGUMENT from the daemon
constexpr int kExitUnreachable = 3;  // UNAVAILABLE or DEADLINE_EXCEEDED: no answer within --timeout
constexpr int kExitNotFound = 4;     // NOT_FOUND: no such session

constexpr char kExitCodes[] = R"(exit status:
  0  success
  1  the daemon answered with an error (its gRPC code and message on stderr)
  2  usage: unknown command or flag, bad or out-of-range value, wrong arguments,
     or a value the daemon rejects (INVALID_ARGUMENT)
  3  the daemon was not reached or did not answer within --timeout
     (UNAVAILABLE, DEADLINE_EXCEEDED)
  4  no such session (NOT_FOUND)
)";

int ExitCode(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk: return kExitOk;
    case absl::StatusCode::kInvalidArgument: return kExitUsage;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded: return kExitUnreachable;
    case absl::StatusCode::kNotFound: return kExitNotFound;
    default: return kExitFailed;
  }
}

// ---------------------------------------------------------------------------
// Flags.

enum class Kind { kInt, kLayerOrAll, kDuration, kBool, kCodec, kOutput, kText, kFile };

struct FlagSpec {
  std::string name;
  Kind kind = Kind::kText;
  std::string fallback;  // the default, as it would be typed
  std::string help;
  int64_t min = 0, max = 0;                              // kInt, kLayerOrAll
  absl::Duration min_duration, max_duration;             // kDuration
};

FlagSpec OtherFlag(std::string name, Kind kind, std::string fallback, std::string help) {
  FlagSpec spec;
  spec.name = std::move(name);
  spec.kind = kind;
  spec.fallback = std::move(fallback);
  spec.help = std::move(help);
  return spec;
}

FlagSpec IntFlag(std::string name, int64_t fallback, int64_t min, int64_t max, std::string help) {
  FlagSpec spec = OtherFlag(std::move(name), Kind::kInt, absl::StrCat(fallback), std::move(help));
  spec.min = min;
  spec.max = max;
  return spec;
}

FlagSpec LayerFlag(std::string fallback, bool all, std::string help) {
  FlagSpec spec = OtherFlag("layer", all ? Kind::kLayerOrAll : Kind::kInt, std::move(fallback), std::move(help));
  spec.min = 0;
  spec.max = 1023;
  return spec;
}

FlagSpec DurationFlag(std::string name, std::string fallback, absl::Duration min, absl::Duration max, std::string help) {
  FlagSpec spec = OtherFlag(std::move(name), Kind::kDuration, std::move(fallback), std::move(help));
  spec.min_duration = min;
  spec.max_duration = max;
  return spec;
}

std::string ValueName(const FlagSpec& spec) {
  switch (spec.kind) {
    case Kind::kInt: return "N";
    case Kind::kLayerOrAll: return "L|all";
    case Kind::kDuration: return "DURATION";
    case Kind::kBool: return "true|false";
    case Kind::kCodec: return "CODEC";
    case Kind::kOutput: return "table|json";
    case Kind::kText: return absl::AsciiStrToUpper(spec.name);
    case Kind::kFile: return "PEM";
  }
  return "";
}

// "1 to 1024", "1ms to 1h": the range a value must be in.
std::string Range(const FlagSpec& spec) {
  if (spec.kind == Kind::kInt || spec.kind == Kind::kLayerOrAll) return absl::StrCat(spec.min, " to ", spec.max);
  if (spec.kind == Kind::kDuration) {
    return absl::StrCat(absl::FormatDuration(spec.min_duration), " to ", absl::FormatDuration(spec.max_duration));
  }
  return "";
}

struct FlagValue {
  int64_t number = 0;  // kInt; kLayerOrAll (-1: all)
  absl::Duration duration;
  bool boolean = false;
  turbokv::v1::Codec codec = turbokv::v1::CODEC_UNSPECIFIED;
  std::string text;  // kOutput, kText; kFile: the file's contents
};

absl::StatusOr<turbokv::v1::Codec> ParseCodec(const std::string& name) {
  turbokv::v1::Codec codec;
  if (!turbokv::v1::Codec_Parse("CODEC_" + absl::AsciiStrToUpper(name), &codec) || codec == turbokv::v1::CODEC_UNSPECIFIED) {
    return absl::InvalidArgumentError("not a codec: use f16, q8_0, q4_0, turbo2, turbo3 or turbo4");
  }
  return codec;
}

// The value of one flag, or why `text` is not one (without the flag's name).
absl::StatusOr<FlagValue> ParseValue(const FlagSpec& spec, const std::string& text) {
  FlagValue value;
  switch (spec.kind) {
    case Kind::kLayerOrAll:
      if (text == "all") {
        value.number = -1;
        return value;
      }
      [[fallthrough]];
    case Kind::kInt:
      if (!absl::SimpleAtoi(text, &value.number)) {
        return absl::InvalidArgumentError(absl::StrCat("not an integer", spec.kind == Kind::kLayerOrAll ? " or all" : "",
                                                       " (", Range(spec), ")"));
      }
      if (value.number < spec.min || value.number > spec.max) {
        return absl::InvalidArgumentError(absl::StrCat("must be from ", Range(spec)));
      }
      return value;
    case Kind::kDuration:
      if (!absl::ParseDuration(text, &value.duration)) {
        return absl::InvalidArgumentError(absl::StrCat("not a duration like 500ms, 5s or 30m (", Range(spec), ")"));
      }
      if (value.duration < spec.min_duration || value.duration > spec.max_duration) {
        return absl::InvalidArgumentError(absl::StrCat("must be from ", Range(spec)));
      }
      return value;
    case Kind::kBool:
      if (text != "true" && text != "false") return absl::InvalidArgumentError("expected true or false");
      value.boolean = text == "true";
      return value;
    case Kind::kCodec: {
      if (text.empty() && spec.fallback.empty()) return value;  // unspecified: the daemon chooses
      absl::StatusOr<turbokv::v1::Codec> codec = ParseCodec(text);
      if (!codec.ok()) return codec.status();
      value.codec = *codec;
      return value;
    }
    case Kind::kOutput:
      if (text != "table" && text != "json") return absl::InvalidArgumentError("expected table or json");
      value.text = text;
      return value;
    case Kind::kText:
      value.text = text;
      return value;
    case Kind::kFile: {
      if (text.empty()) return value;
      std::ifstream in(text);
      if (!in) return absl::InvalidArgumentError("cannot read the file");
      std::stringstream contents;
      contents << in.rdbuf();
      value.text = contents.str();
      return value;
    }
  }
  return value;
}

// The parsed command line of one command: every flag it has, given or defaulted.
class Args {
 public:
  std::vector<std::string> positional;

  void Set(const std::string& name, FlagValue value) { values_[name] = std::move(value); }
  int64_t Int(const std::string& name) const { return values_.at(name).number; }
  absl::Duration Duration(const std::string& name) const { return values_.at(name).duration; }
  bool Bool(const std::string& name) const { return values_.at(name).boolean; }
  turbokv::v1::Codec Codec(const std::string& name) const { return values_.at(name).codec; }
  const std::string& Text(const std::string& name) const { return values_.at(name).text; }
  bool Json() const { return values_.count("output") && Text("output") == "json"; }

 private:
  std::map<std::string, FlagValue> values_;
};

// ---------------------------------------------------------------------------
// Results: one tree, printed as JSON or as a table.

struct Value {
  enum Type { kNull, kBool, kInt, kUint, kDouble, kString, kArray, kObject };
  Type type = kNull;
  bool boolean = false;
  int64_t int_value = 0;
  uint64_t uint_value = 0;
  double double_value = 0;
  std::string text;  // kString; kDouble: "s" for a duration (tables print it as one)
  std::vector<std::string> keys;  // kObject, in order; items[i] is keys[i]'s value
  std::vector<Value> items;       // kArray, kObject

  static Value Null() { return Value(); }
  static Value Bool(bool b) { Value v; v.type = kBool; v.boolean = b; return v; }
  static Value Int(int64_t i) { Value v; v.type = kInt; v.int_value = i; return v; }
  static Value Uint(uint64_t u) { Value v; v.type = kUint; v.uint_value = u; return v; }
  static Value Double(double d, std::string unit = "") { Value v; v.type = kDouble; v.double_value = d; v.text = std::move(unit); return v; }
  static Value String(std::string s) { Value v; v.type = kString; v.text = std::move(s); return v; }
  static Value Array() { Value v; v.type = kArray; return v; }
  static Value Object() { Value v; v.type = kObject; return v; }

  Value& Add(std::string key, Value value) {
    keys.push_back(std::move(key));
    items.push_back(std::move(value));
    return *this;
  }
};

Value FromMessage(const Message& message);

// One field's value (index >= 0: an element of a repeated field).
Value FromField(const Message& message, const FieldDescriptor* field, int index) {
  const google::protobuf::Reflection* r = message.GetReflection();
  const bool repeated = index >= 0;
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return Value::Int(repeated ? r->GetRepeatedInt32(message, field, index) : r->GetInt32(message, field));
    case FieldDescriptor::CPPTYPE_INT64:
      return Value::Int(repeated ? r->GetRepeatedInt64(message, field, index) : r->GetInt64(message, field));
    case FieldDescriptor::CPPTYPE_UINT32:
      return Value::Uint(repeated ? r->GetRepeatedUInt32(message, field, index) : r->GetUInt32(message, field));
    case FieldDescriptor::CPPTYPE_UINT64:
      return Value::Uint(repeated ? r->GetRepeatedUInt64(message, field, index) : r->GetUInt64(message, field));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Value::Double(repeated ? r->GetRepeatedDouble(message, field, index) : r->GetDouble(message, field));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return Value::Double(repeated ? r->GetRepeatedFloat(message, field, index) : r->GetFloat(message, field));
    case FieldDescriptor::CPPTYPE_BOOL:
      return Value::Bool(repeated ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field));
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string text = repeated ? r->GetRepeatedString(message, field, index) : r->GetString(message, field);
      return Value::String(field->type() == FieldDescriptor::TYPE_BYTES ? absl::Base64Escape(text) : text);
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int number = repeated ? r->GetRepeatedEnumValue(message, field, index) : r->GetEnumValue(message, field);
      const google::protobuf::EnumValueDescriptor* named = field->enum_type()->FindValueByNumber(number);
      return named != nullptr ? Value::String(named->name()) : Value::Int(number);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return FromMessage(repeated ? r->GetRepeatedMessage(message, field, index) : r->GetMessage(message, field));
  }
  return Value::Null();
}

// Every field of `message`, zero or not, under its proto name. A duration is
// its seconds; an unset optional scalar is null.
Value FromMessage(const Message& message) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const google::protobuf::Reflection* r = message.GetReflection();
  if (descriptor->full_name() == "google.protobuf.Duration") {
    const int64_t seconds = r->GetInt64(message, descriptor->FindFieldByName("seconds"));
    const int32_t nanos = r->GetInt32(message, descriptor->FindFieldByName("nanos"));
    return Value::Double(static_cast<double>(seconds) + nanos / 1e9, "s");
  }
  Value object = Value::Object();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) {
      Value array = Value::Array();
      for (int j = 0; j < r->FieldSize(message, field); ++j) array.items.push_back(FromField(message, field, j));
      object.Add(field->name(), std::move(array));
    } else if (field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE && field->has_presence() &&
               !r->HasField(message, field)) {
      object.Add(field->name(), Value::Null());
    } else {
      object.Add(field->name(), FromField(message, field, -1));
    }
  }
  return object;
}

std::string NumberText(double d) {
  char buffer[32];
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), d);
  return std::string(buffer, result.ptr);
}

std::string ScalarText(const Value& value) {
  switch (value.type) {
    case Value::kNull: return "null";
    case Value::kBool: return value.boolean ? "true" : "false";
    case Value::kInt: return absl::StrCat(value.int_value);
    case Value::kUint: return absl::StrCat(value.uint_value);
    case Value::kDouble: return std::isfinite(value.double_value) ? NumberText(value.double_value) : "null";
    default: return value.text;
  }
}

// A JSON string: quotes, backslashes and control characters escaped, UTF-8 as is.
void AppendJsonString(const std::string& text, std::string* out) {
  out->push_back('"');
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(out, "\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
}

void AppendJson(const Value& value, std::string* out) {
  switch (value.type) {
    case Value::kString:
      AppendJsonString(value.text, out);
      return;
    case Value::kArray:
      out->push_back('[');
      for (size_t i = 0; i < value.items.size(); ++i) {
        if (i > 0) out->append(", ");
        AppendJson(value.items[i], out);
      }
      out->push_back(']');
      return;
    case Value::kObject:
      out->push_back('{');
      for (size_t i = 0; i < value.items.size(); ++i) {
        if (i > 0) out->append(", ");
        AppendJsonString(value.keys[i], out);
        out->append(": ");
        AppendJson(value.items[i], out);
      }
      out->push_back('}');
      return;
    default:
      out->append(ScalarText(value));
  }
}

// Table lines "path value" of every leaf; an array of scalars on one line.
void Flatten(const Value& value, const std::string& path, std::vector<std::pair<std::string, std::string>>* lines) {
  if (value.type == Value::kObject) {
    for (size_t i = 0; i < value.items.size(); ++i) {
      Flatten(value.items[i], path.empty() ? value.keys[i] : absl::StrCat(path, ".", value.keys[i]), lines);
    }
  } else if (value.type == Value::kArray &&
             std::any_of(value.items.begin(), value.items.end(),
                         [](const Value& item) { return item.type == Value::kObject || item.type == Value::kArray; })) {
    for (size_t i = 0; i < value.items.size(); ++i) Flatten(value.items[i], absl::StrCat(path, "[", i, "]"), lines);
  } else if (value.type == Value::kArray) {
    std::vector<std::string> items;
    for (const Value& item : value.items) items.push_back(ScalarText(item));
    lines->emplace_back(path, absl::StrJoin(items, ","));
  } else if (value.type == Value::kDouble && value.text == "s") {
    lines->emplace_back(path, absl::FormatDuration(absl::Seconds(value.double_value)));
  } else {
    lines->emplace_back(path, ScalarText(value));
  }
}

void PrintJson(const Value& value) {
  std::string json;
  AppendJson(value, &json);
  std::printf("%s\n", json.c_str());
}

void PrintFields(const Value& value) {
  std::vector<std::pair<std::string, std::string>> lines;
  Flatten(value, "", &lines);
  size_t width = 0;
  for (const auto& line : lines) width = std::max(width, line.first.size());
  for (const auto& [path, text] : lines) std::printf("%-*s  %s\n", static_cast<int>(width), path.c_str(), text.c_str());
}

// A message as JSON or as "field value" lines.
void PrintMessage(const Args& args, const Message& message) {
  if (args.Json()) {
    PrintJson(FromMessage(message));
  } else {
    PrintFields(FromMessage(message));
  }
}

// ---------------------------------------------------------------------------
// Commands.

// The chained hashes of the full blocks of the token ids in the file named by
// --FLAG (ids separated by spaces, commas or newlines), in the daemon's
// block size, salted with --salt.
absl::StatusOr<std::vector<std::string>> TokenBlockHashes(const turbokv::Client& client, const Args& args,
                                                          const std::string& flag) {
  const std::string& path = args.Text(flag);
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  std::stringstream contents;
  contents << in.rdbuf();
  std::vector<int32_t> tokens;
  for (absl::string_view word : absl::StrSplit(contents.str(), absl::ByAnyChar(" ,\t\n\r"), absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(word, &id) || id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": '", word, "' is not a token id"));
    }
    tokens.push_back(id);
  }
  absl::StatusOr<turbokv::v1::StatsResponse> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  return turbokv::BlockHashes(tokens, stats->block_tokens(), args.Text("salt"));
}

absl::Status Create(const turbokv::Client& client, const Args& args) {
  turbokv::SessionOptions options;
  if (!args.Text("prefix-tokens").empty()) {
    absl::StatusOr<std::vector<std::string>> hashes = TokenBlockHashes(client, args, "prefix-tokens");
    if (!hashes.ok()) return hashes.status();
    options.prefix_blocks = *std::move(hashes);
  }
  options.layers = static_cast<int>(args.Int("layers"));
  options.kv_heads = static_cast<int>(args.Int("kv-heads"));
  options.q_heads = static_cast<int>(args.Int("q-heads"));
  options.head_dim = static_cast<int>(args.Int("head-dim"));
  options.max_tokens = args.Int("max-tokens");
  options.key_codec = args.Codec("key-codec");
  options.value_codec = args.Codec("value-codec");
  options.preset = args.Text("preset");
  options.idle_ttl = args.Duration("ttl");
  options.pinned = args.Bool("pinned");
  const std::string& transform = args.Text("key-transform");
  if (!transform.empty() &&
      !turbokv::v1::KeyTransform_Parse("KEY_TRANSFORM_" + absl::AsciiStrToUpper(transform), &options.key_transform)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--key-transform=", transform, ": use none, center or center_scale"));
  }
  options.center_values = args.Bool("center-values");
  if (args.Int("sink-tokens") >= 0) options.sink_tokens = static_cast<int>(args.Int("sink-tokens"));
  options.sink_codec = args.Codec("sink-codec");
  absl::StatusOr<turbokv::Session> session = client.CreateSession(options);
  if (!session.ok()) return session.status();
  if (args.Json()) {
    PrintJson(Value::Object()
                  .Add("session_id", Value::String(session->id()))
                  .Add("config", FromMessage(session->config()))
                  .Add("prefix_tokens", Value::Int(session->prefix_tokens())));
  } else {
    std::printf("%s\n", session->id().c_str());
    if (!options.prefix_blocks.empty()) {
      std::fprintf(stderr, "started with %lld tokens of a stored prefix\n",
                   static_cast<long long>(session->prefix_tokens()));
    }
  }
  return absl::OkStatus();
}

absl::Status NameBlocks(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<std::vector<std::string>> hashes = TokenBlockHashes(client, args, "tokens");
  if (!hashes.ok()) return hashes.status();
  if (hashes->empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--tokens=", args.Text("tokens"), ": no full block of token ids"));
  }
  absl::StatusOr<turbokv::Session> session = client.OpenSession(args.positional[0]);
  if (!session.ok()) return session.status();
  absl::StatusOr<turbokv::v1::NameBlocksResponse> named = session->NameBlocks(0, *hashes);
  if (!named.ok()) return named.status();
  PrintMessage(args, *named);
  return absl::OkStatus();
}

absl::Status List(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<std::vector<turbokv::v1::SessionInfo>> sessions = client.ListSessions();
  if (!sessions.ok()) return sessions.status();
  if (args.Json()) {
    turbokv::v1::ListSessionsResponse response;
    for (const auto& s : *sessions) *response.add_sessions() = s;
    PrintJson(FromMessage(response));
    return absl::OkStatus();
  }
  std::printf("%-26s %6s %12s %14s %14s %-17s %10s\n", "SESSION_ID", "LAYERS", "TOKENS/LAYER", "BYTES_USED", "FP16_BYTES",
              "RESIDENCY", "IDLE");
  for (const auto& s : *sessions) {
    const auto [fewest, most] = std::minmax_element(s.layer_tokens().begin(), s.layer_tokens().end());
    const std::string tokens = fewest == s.layer_tokens().end() ? "0"
                               : *fewest == *most          ? absl::StrCat(*fewest)
                                                           : absl::StrCat(*fewest, "..", *most);
    const std::string residency(absl::StripPrefix(turbokv::v1::Residency_Name(s.residency()), "RESIDENCY_"));
    std::printf("%-26s %6d %12s %14lld %14lld %-17s %9llds\n", s.session_id().c_str(), s.config().shape().layers(),
                tokens.c_str(), static_cast<long long>(s.bytes_used()), static_cast<long long>(s.fp16_bytes()),
                absl::AsciiStrToLower(residency).c_str(), static_cast<long long>(s.idle().seconds()));
  }
  return absl::OkStatus();
}

absl::Status Get(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<turbokv::v1::SessionInfo> info = client.GetSession(args.positional[0]);
  if (!info.ok()) return info.status();
  PrintMessage(args, *info);
  return absl::OkStatus();
}

absl::Status Delete(const turbokv::Client& client, const Args& args) {
  return client.DeleteSession(args.positional[0]);
}

absl::Status Stats(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<turbokv::v1::StatsResponse> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  if (!args.Json()) std::printf("# tokens: summed over sessions and layers (turbokv list: tokens per layer)\n");
  PrintMessage(args, *stats);
  return absl::OkStatus();
}

absl::Status Snapshot(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<turbokv::v1::SnapshotResponse> snapshot = client.Snapshot();
  if (!snapshot.ok()) return snapshot.status();
  PrintMessage(args, *snapshot);
  return absl::OkStatus();
}

absl::Status Prefetch(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<std::vector<absl::Status>> prefetched = client.Prefetch(args.positional);
  if (!prefetched.ok()) return prefetched.status();
  absl::Status status;
  Value results = Value::Array();
  for (size_t i = 0; i < prefetched->size(); ++i) {
    const absl::Status& one = (*prefetched)[i];
    const std::string code = absl::StatusCodeToString(one.code());
    if (args.Json()) {
      results.items.push_back(Value::Object()
                                  .Add("session_id", Value::String(args.positional[i]))
                                  .Add("code", Value::String(code))
                                  .Add("message", Value::String(std::string(one.message()))));
    } else {
      std::printf("%s %s%s%s\n", args.positional[i].c_str(), code.c_str(), one.ok() ? "" : ": ",
                  std::string(one.message()).c_str());
    }
    if (!one.ok() && status.ok()) status = absl::Status(one.code(), "not every session was prefetched");
  }
  if (args.Json()) PrintJson(Value::Object().Add("results", std::move(results)));
  return status;
}

absl::Status AppendRandom(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<turbokv::Session> session = client.OpenSession(args.positional[0]);
  if (!session.ok()) return session.status();
  const int64_t tokens = args.Int("tokens");
  const int64_t chunk = args.Int("chunk");
  const int layer = static_cast<int>(args.Int("layer"));
  const auto& shape = session->config().shape();
  if (layer >= shape.layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layer=", layer, ": the session has ", shape.layers(), " layers (0 to ", shape.layers() - 1, ")"));
  }
  const size_t row = static_cast<size_t>(shape.kv_heads()) * shape.head_dim() * (layer < 0 ? shape.layers() : 1);
  // f16 keys and values: 4 bytes per value of a row, in one Append message.
  const int64_t limit = turbokv::ClientOptions().max_message_bytes;
  const int64_t most = std::max<int64_t>(1, (limit - 4096) / static_cast<int64_t>(row * 4));
  if (chunk > most) {
    return absl::InvalidArgumentError(absl::StrCat("--chunk=", chunk, ": a chunk of this session is at most ", most,
                                                   " tokens (", limit >> 20, " MiB per message)"));
  }
  absl::StatusOr<turbokv::v1::SessionInfo> info = session->Info();
  if (!info.ok()) return info.status();
  const int64_t start = info->layer_tokens(layer < 0 ? 0 : layer);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::unique_ptr<turbokv::AppendStream> stream = session->OpenAppendStream();
  const absl::Time begin = absl::Now();
  for (int64_t t = 0; t < tokens; t += chunk) {
    const int64_t n = std::min(chunk, tokens - t);
    std::vector<uint16_t> keys(row * n), values(row * n);
    for (auto* v : {&keys, &values}) {
      for (uint16_t& x : *v) x = turbokv::FloatToHalfBits(normal(rng));
    }
    if (!stream->Write(layer, start + t, turbokv::TensorData::F16(keys), turbokv::TensorData::F16(values)).ok()) break;
  }
  absl::StatusOr<turbokv::v1::AppendResponse> last = stream->Finish();
  if (!last.ok()) return last.status();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  if (args.Json()) {
    PrintJson(Value::Object()
                  .Add("session_id", Value::String(session->id()))
                  .Add("layer", layer < 0 ? Value::Null() : Value::Int(layer))
                  .Add("start", Value::Int(start))
                  .Add("tokens", Value::Int(tokens))
                  .Add("chunk", Value::Int(chunk))
                  .Add("seconds", Value::Double(seconds))
                  .Add("tokens_per_second", Value::Double(tokens / seconds))
                  .Add("layer_tokens", Value::Int(last->tokens())));
  } else {
    std::printf("appended %lld tokens in %.2f s (%.0f tokens/s); layer holds %lld\n", static_cast<long long>(tokens),
                seconds, tokens / seconds, static_cast<long long>(last->tokens()));
  }
  return absl::OkStatus();
}

absl::Status AttendRandom(const turbokv::Client& client, const Args& args) {
  absl::StatusOr<turbokv::Session> session = client.OpenSession(args.positional[0]);
  if (!session.ok()) return session.status();
  const int64_t layer = args.Int("layer");
  const int64_t queries = args.Int("queries");
  const int64_t calls = args.Int("calls");
  const auto& shape = session->config().shape();
  if (layer >= shape.layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layer=", layer, ": the session has ", shape.layers(), " layers (0 to ", shape.layers() - 1, ")"));
  }
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<size_t>(queries) * shape.q_heads() * shape.head_dim());
  std::vector<double> us;
  for (int64_t c = 0; c < calls; ++c) {
    for (float& x : q) x = normal(rng);
    const absl::Time begin = absl::Now();
    absl::StatusOr<turbokv::Attention> attention = session->Attend(static_cast<int>(layer), turbokv::TensorData::F32(q));
    if (!attention.ok()) return attention.status();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - begin));
  }
  std::sort(us.begin(), us.end());
  if (args.Json()) {
    PrintJson(Value::Object()
                  .Add("session_id", Value::String(session->id()))
                  .Add("layer", Value::Int(layer))
                  .Add("queries", Value::Int(queries))
                  .Add("calls", Value::Int(calls))
                  .Add("p50_us", Value::Double(us[us.size() / 2]))
                  .Add("max_us", Value::Double(us.back())));
  } else {
    std::printf("attend: %lld calls of %lld queries on layer %lld: p50 %.0f us, max %.0f us\n",
                static_cast<long long>(calls), static_cast<long long>(queries), static_cast<long long>(layer),
                us[us.size() / 2], us.back());
  }
  return absl::OkStatus();
}

absl::Status DecodeRandom(const turbokv::Client& client, const Args& args) {
  const int64_t batch = args.Int("batch");
  const int64_t layers = args.Int("layers");
  const int64_t steps = args.Int("steps");
  turbokv::SessionOptions options;
  options.layers = static_cast<int>(layers);
  options.kv_heads = static_cast<int>(args.Int("kv-heads"));
  options.q_heads = static_cast<int>(args.Int("q-heads"));
  options.head_dim = static_cast<int>(args.Int("head-dim"));
  options.key_codec = options.value_codec = args.Codec("codec");
  std::vector<turbokv::Session> sessions;
  turbokv::DecodeBatch message;
  for (int64_t i = 0; i < batch; ++i) {
    absl::StatusOr<turbokv::Session> session = client.CreateSession(options);
    if (!session.ok()) {
      for (const turbokv::Session& made : sessions) made.Delete().IgnoreError();
      return session.status();
    }
    message.session_ids.push_back(session->id());
    sessions.push_back(*std::move(session));
  }
  message.q_heads = options.q_heads;
  message.kv_heads = options.kv_heads;
  message.head_dim = options.head_dim;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  // The prefill, in chunks of every layer, the same random tokens in each session.
  const int64_t prefill = args.Int("prefill");
  constexpr int64_t kPrefillChunk = 256;
  std::vector<float> chunk;
  for (int64_t start = 0; start < prefill; start += kPrefillChunk) {
    const int64_t n = std::min(kPrefillChunk, prefill - start);
    chunk.resize(static_cast<size_t>(layers) * n * options.kv_heads * options.head_dim);
    for (float& x : chunk) x = normal(rng);
    for (const turbokv::Session& session : sessions) {
      absl::StatusOr<int64_t> appended =
          session.AppendAllLayers(start, turbokv::TensorData::F32(chunk), turbokv::TensorData::F32(chunk));
      if (!appended.ok()) {
        for (const turbokv::Session& made : sessions) made.Delete().IgnoreError();
        return appended.status();
      }
    }
  }
  std::vector<float> keys(static_cast<size_t>(batch) * options.kv_heads * options.head_dim), values(keys.size()),
      queries(static_cast<size_t>(batch) * options.q_heads * options.head_dim);
  std::unique_ptr<turbokv::DecodeStream> stream = client.OpenDecodeStream();
  std::vector<double> us;
  absl::Status status;
  const absl::Time begin = absl::Now();
  for (int64_t step = 0; step < steps && status.ok(); ++step) {
    message.positions.assign(batch, prefill + step);
    for (int64_t l = 0; l < layers && status.ok(); ++l) {
      for (std::vector<float>* v : {&keys, &values, &queries}) {
        for (float& x : *v) x = normal(rng);
      }
      message.layer = static_cast<int>(l);
      message.keys = turbokv::TensorData::F32(keys);
      message.values = turbokv::TensorData::F32(values);
      message.queries = turbokv::TensorData::F32(queries);
      const absl::Time start = absl::Now();
      absl::StatusOr<turbokv::DecodeResult> result = stream->Step(message);
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
      if (!result.ok()) {
        status = result.status();
      } else if (result->failed > 0) {
        for (const absl::Status& item : result->status) {
          if (!item.ok()) status = item;
        }
      }
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  if (status.ok()) status = stream->Finish();
  for (const turbokv::Session& session : sessions) session.Delete().IgnoreError();
  if (!status.ok()) return status;
  std::sort(us.begin(), us.end());
  const double p50 = us[us.size() / 2], p99 = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  if (args.Json()) {
    PrintJson(Value::Object()
                  .Add("batch", Value::Int(batch))
                  .Add("layers", Value::Int(layers))
                  .Add("steps", Value::Int(steps))
                  .Add("prefill", Value::Int(prefill))
                  .Add("seconds", Value::Double(seconds))
                  .Add("tokens_per_second", Value::Double(batch * steps / seconds))
                  .Add("p50_us", Value::Double(p50))
                  .Add("p99_us", Value::Double(p99)));
  } else {
    std::printf("decode: %lld sessions x %lld layers x %lld steps after %lld tokens, through one Decode stream: "
                "%.0f tokens/s, per layer-step p50 %.0f us, p99 %.0f us\n",
                static_cast<long long>(batch), static_cast<long long>(layers), static_cast<long long>(steps),
                static_cast<long long>(prefill), batch * steps / seconds, p50, p99);
  }
  return absl::OkStatus();
}

absl::Status Demo(const turbokv::Client& client, const Args& args) {
  turbokv::DemoOptions options;
  options.layers = static_cast<int>(args.Int("layers"));
  options.kv_heads = static_cast<int>(args.Int("kv-heads"));
  options.q_heads = static_cast<int>(args.Int("q-heads"));
  options.head_dim = static_cast<int>(args.Int("head-dim"));
  options.tokens = args.Int("tokens");
  options.chunk = args.Int("chunk");
  options.steps = static_cast<int>(args.Int("steps"));
  options.key_codec = options.value_codec = args.Codec("codec");
  options.preset = args.Text("preset");
  return turbokv::RunDemo(client, options);
}

struct Command {
  std::string name;
  std::string arguments;  // as in the usage line: "", "ID", "ID..."
  size_t min_positional, max_positional;
  std::string summary;
  std::vector<FlagSpec> flags;  // its own; --output where it prints a result
  std::string timeout;          // the default --timeout
  absl::Status (*run)(const turbokv::Client&, const Args&);
};

constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxLayers = 1024;

FlagSpec OutputFlag() {
  return OtherFlag("output", Kind::kOutput, "table", "table for people, json for scripts (every field, numbers as numbers)");
}

FlagSpec SaltFlag() {
  return OtherFlag("salt", Kind::kText, "", "mixed into the first block's hash: e.g. the model's name and revision");
}

std::vector<FlagSpec> ShapeFlags(int64_t layers, int64_t kv_heads, int64_t q_heads, int64_t head_dim) {
  return {IntFlag("layers", layers, 1, kMaxLayers, "layers"),
          IntFlag("kv-heads", kv_heads, 1, kMaxHeads, "key/value heads"),
          IntFlag("q-heads", q_heads, 1, kMaxHeads, "query heads, a multiple of --kv-heads"),
          IntFlag("head-dim", head_dim, 64, 4096, "head dimension, a multiple of 64")};
}

const std::vector<Command>& Commands() {
  static const std::vector<Command>* commands = [] {
    std::vector<FlagSpec> create = ShapeFlags(32, 8, 32, 128);
    for (FlagSpec flag : {OtherFlag("preset", Kind::kText, "",
                                    "a named codec choice: k8v4, k4v4, k4v3, k3v4, k3v3 or k2v2; with neither it "
                                    "nor the codecs, the daemon's default preset"),
                          OtherFlag("key-codec", Kind::kCodec, "", "codec of the keys (not with --preset)"),
                          OtherFlag("value-codec", Kind::kCodec, "", "codec of the values (not with --preset)"),
                          IntFlag("max-tokens", 0, 0, int64_t{1} << 40, "most tokens per layer; 0: the daemon's --max-tokens"),
                          DurationFlag("ttl", "0s", absl::ZeroDuration(), absl::Hours(24 * 365),
                                       "deleted after this long without a call; 0s: the daemon's --session-ttl"),
                          OtherFlag("pinned", Kind::kBool, "false", "never demoted to the daemon's --spill-dir"),
                          OtherFlag("key-transform", Kind::kText, "",
                                    "how keys are stored before their codec: none, center or center_scale; empty: "
                                    "the daemon's default (center_scale)"),
                          OtherFlag("center-values", Kind::kBool, "false", "values centered before their codec too"),
                          IntFlag("sink-tokens", -1, -1, 64,
                                  "first tokens of every layer kept apart in --sink-codec; -1: the daemon's default (4)"),
                          OtherFlag("sink-codec", Kind::kCodec, "", "codec of the sink tokens (the daemon takes f16 or q8_0 for them)"),
                          OtherFlag("prefix-tokens", Kind::kText, "",
                                    "a file of the session's first token ids: it starts with the longest stored "
                                    "prefix of their blocks (see name-blocks)"),
                          SaltFlag(), OutputFlag()}) {
      create.push_back(flag);
    }
    std::vector<FlagSpec> decode = {IntFlag("batch", 8, 1, 1024, "sessions decoded together")};
    for (FlagSpec flag : ShapeFlags(4, 8, 32, 128)) decode.push_back(flag);
    for (FlagSpec flag : {IntFlag("steps", 16, 1, 1000000, "decode steps, each over every layer"),
                          IntFlag("prefill", 0, 0, int64_t{1} << 24,
                                  "tokens appended to every session (all layers) before decoding: long-context decode"),
                          OtherFlag("codec", Kind::kCodec, "turbo3", "codec of keys and values"), OutputFlag()}) {
      decode.push_back(flag);
    }
    const turbokv::DemoOptions demo_defaults;
    std::vector<FlagSpec> demo =
        ShapeFlags(demo_defaults.layers, demo_defaults.kv_heads, demo_defaults.q_heads, demo_defaults.head_dim);
    for (FlagSpec flag : {IntFlag("tokens", demo_defaults.tokens, 1, 1 << 24, "prefill tokens"),
                          IntFlag("chunk", demo_defaults.chunk, 1, 1 << 16, "tokens per Append message (all layers)"),
                          IntFlag("steps", demo_defaults.steps, 1, 100000, "decode steps, each over every layer"),
                          OtherFlag("codec", Kind::kCodec, "", "codec of keys and values (not with --preset)"),
                          OtherFlag("preset", Kind::kText, "",
                                    "a named codec choice; with neither it nor --codec, the daemon's default "
                                    "preset")}) {
      demo.push_back(flag);
    }
    return new std::vector<Command>{
        {"create", "", 0, 0, "create a session and print its id (json: the id and the effective configuration)",
         create, "5s", Create},
        {"list", "", 0, 0, "every session (json: {\"sessions\": [...]}, each as `get` prints it)", {OutputFlag()}, "5s",
         List},
        {"get", "ID", 1, 1, "one session: shape, codecs, tokens per layer, bytes, residency", {OutputFlag()}, "5s", Get},
        {"delete", "ID", 1, 1, "delete a session (prints nothing)", {}, "5s", Delete},
        {"name-blocks", "ID", 1, 1,
         "name the session's full blocks by the token ids they hold, for reuse by later sessions (create "
         "--prefix-tokens)",
         {OtherFlag("tokens", Kind::kText, "", "a file of the session's token ids from its first (spaces, commas or "
                                               "newlines between them)"),
          SaltFlag(), OutputFlag()},
         "5s", NameBlocks},
        {"stats", "", 0, 0, "the daemon's totals (tokens: over sessions and layers)", {OutputFlag()}, "5s", Stats},
        {"snapshot", "", 0, 0, "write every session to turbokvd's --snapshot-dir now", {OutputFlag()}, "60s",
         Snapshot},
        {"prefetch", "ID...", 1, 1 << 20, "bring sessions back from turbokvd's --spill-dir; a code per session",
         {OutputFlag()}, "60s", Prefetch},
        {"append-random", "ID", 1, 1, "append random fp16 keys and values through one Append stream",
         {IntFlag("tokens", 1024, 1, 1 << 24, "tokens to append"),
          IntFlag("chunk", 128, 1, 1 << 20, "tokens per Append message"),
          LayerFlag("all", true, "the layer, or all of them at once"), OutputFlag()},
         "5s", AppendRandom},
        {"attend-random", "ID", 1, 1, "random queries against one layer, print the latency",
         {LayerFlag("0", false, "the layer"), IntFlag("queries", 1, 1, 4096, "queries per call"),
          IntFlag("calls", 10, 1, 1000000, "Attend calls"), OutputFlag()},
         "5s", AttendRandom},
        {"decode-random", "", 0, 0,
         "B new sessions decoded through one Decode stream; throughput and latency",
         decode, "5s", DecodeRandom},
        {"demo", "", 0, 0, "a model-shaped workload, checked against float attention (a report for people)", demo, "5s",
         Demo},
    };
  }();
  return *commands;
}

// The default target: $TURBOKV_TARGET (the Helm chart sets it in the
// worker), else the daemon's default socket.
std::string DefaultTarget() {
  const char* env = std::getenv("TURBOKV_TARGET");
  return env != nullptr && *env != '\0' ? env : "unix:///tmp/turbokv.sock";
}

std::vector<FlagSpec> GlobalFlags(const Command* command) {
  return {OtherFlag("target", Kind::kText, DefaultTarget(),
                    "unix:///path (or the bare absolute path) or host:port of turbokvd, $TURBOKV_TARGET when set"),
          DurationFlag("timeout", command != nullptr ? command->timeout : "5s", absl::Milliseconds(1), absl::Hours(1),
                       "deadline to reach the daemon, and of each unary call (streams have none)"),
          OtherFlag("wait", Kind::kBool, "false",
                    "wait up to --timeout for a unix socket that is not there yet (a daemon still starting); "
                    "without it a missing socket fails at once"),
          OtherFlag("token", Kind::kText, "", "bearer token (turbokvd --auth-tokens-file)"),
          OtherFlag("tls-ca", Kind::kFile, "", "TLS to a TCP target, trusting the CA in this PEM file"),
          OtherFlag("tls-cert", Kind::kFile, "", "this client's certificate (PEM file), for mTLS"),
          OtherFlag("tls-key", Kind::kFile, "", "this client's key (PEM file), for mTLS")};
}

std::string FlagLines(const std::vector<FlagSpec>& flags) {
  std::string text;
  for (const FlagSpec& flag : flags) {
    const std::string left = absl::StrCat("--", flag.name, "=", ValueName(flag));
    const std::string range = Range(flag);
    absl::StrAppend(&text, "  ", left, std::string(left.size() < 26 ? 26 - left.size() : 1, ' '), flag.help,
                    range.empty() ? "" : absl::StrCat(", ", range),
                    flag.kind == Kind::kCodec ? ": f16, q8_0, q4_0, turbo2, turbo3, turbo4" : "",
                    " (default ", flag.fallback.empty() ? "none" : flag.fallback, ")\n");
  }
  return text;
}

std::string UsageLine(const Command& command) {
  return absl::StrCat("turbokv ", command.name, command.arguments.empty() ? "" : " ", command.arguments,
                      command.flags.empty() ? "" : " [FLAGS]", " [GLOBAL FLAGS]");
}

std::string CommandHelp(const Command& command) {
  return absl::StrCat("usage: ", UsageLine(command), "\n\n", command.summary, "\n\n",
                      command.flags.empty() ? "" : absl::StrCat("flags:\n", FlagLines(command.flags), "\n"),
                      "global flags:\n", FlagLines(GlobalFlags(&command)),
                      "  --help                    this text\n\n"
                      "Flags go before or after the command, as --flag=value or --flag value.\n\n",
                      kExitCodes);
}

std::string TopHelp() {
  std::string text =
      "turbokv: command-line client of turbokvd\n\n"
      "usage: turbokv COMMAND [ARGS] [FLAGS]   (turbokv help COMMAND, or COMMAND --help: its flags)\n\ncommands:\n";
  for (const Command& command : Commands()) {
    const std::string left = absl::StrCat(command.name, command.arguments.empty() ? "" : " ", command.arguments);
    absl::StrAppend(&text, "  ", left, std::string(left.size() < 22 ? 22 - left.size() : 1, ' '), command.summary,
                    "\n");
  }
  absl::StrAppend(&text, "\nglobal flags (every command):\n", FlagLines(GlobalFlags(nullptr)),
                  "Commands that print a result take --output=table|json (default table).\n\n", kExitCodes);
  return text;
}

const Command* FindCommand(const std::string& name) {
  for (const Command& command : Commands()) {
    if (command.name == name) return &command;
  }
  return nullptr;
}

bool IsBoolFlag(const std::string& name) {
  if (name == "help") return true;
  for (const FlagSpec& flag : GlobalFlags(nullptr)) {
    if (flag.name == name && flag.kind == Kind::kBool) return true;
  }
  for (const Command& command : Commands()) {
    for (const FlagSpec& flag : command.flags) {
      if (flag.name == name && flag.kind == Kind::kBool) return true;
    }
  }
  return false;
}

// A known flag one or two edits away from `name`, for "did you mean".
std::string Closest(const std::string& name, const std::vector<FlagSpec>& flags) {
  std::string best;
  size_t best_distance = 3;
  for (const FlagSpec& flag : flags) {
    const std::string& other = flag.name;
    std::vector<size_t> row(other.size() + 1);
    for (size_t j = 0; j <= other.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= name.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= other.size(); ++j) {
        const size_t above = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (name[i - 1] == other[j - 1] ? 0 : 1)});
        diagonal = above;
      }
    }
    if (row[other.size()] < best_distance) {
      best_distance = row[other.size()];
      best = other;
    }
  }
  return best;
}

struct Invocation {
  const Command* command = nullptr;
  Args args;
};

// The command line checked against the command's flags. A message on stderr
// and an exit status when there is nothing to run (help, a usage error).
std::variant<Invocation, int> ParseCommandLine(int argc, char** argv) {
  // The command is the first word that is neither a flag nor a flag's value.
  std::vector<std::string> words(argv + 1, argv + argc);
  int command_index = -1;
  bool help = false;
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& word = words[i];
    if (word == "--version") {
      std::printf("turbokv %s\n", TURBOKV_VERSION);
      return kExitOk;
    }
    if (word == "--help" || word == "-h") {
      help = true;
    } else if (absl::StartsWith(word, "--")) {
      if (word.find('=') == std::string::npos && !IsBoolFlag(word.substr(2))) ++i;
    } else {
      command_index = static_cast<int>(i);
      break;
    }
  }
  if (command_index < 0) {
    std::fputs(TopHelp().c_str(), help ? stdout : stderr);
    return help ? kExitOk : kExitUsage;
  }
  std::string name = words[command_index];
  if (name == "help") {
    const int topic = command_index + 1;
    if (topic >= static_cast<int>(words.size())) {
      std::fputs(TopHelp().c_str(), stdout);
      return kExitOk;
    }
    name = words[topic];
    help = true;
    words.erase(words.begin() + topic);
  }
  const Command* command = FindCommand(name);
  if (command == nullptr) {
    std::vector<std::string> names;
    for (const Command& c : Commands()) names.push_back(c.name);
    std::fprintf(stderr, "turbokv: unknown command '%s' (commands: %s; see turbokv --help)\n", name.c_str(),
                 absl::StrJoin(names, ", ").c_str());
    return kExitUsage;
  }
  const auto usage_error = [&](const std::string& message) {
    std::fprintf(stderr, "turbokv %s: %s (see turbokv %s --help)\n", command->name.c_str(), message.c_str(),
                 command->name.c_str());
    return kExitUsage;
  };
  std::vector<FlagSpec> flags = command->flags;
  for (FlagSpec flag : GlobalFlags(command)) flags.push_back(flag);
  for (const std::string& word : words) {
    if (word == "--help" || word == "-h") help = true;
  }
  if (help) {
    std::fputs(CommandHelp(*command).c_str(), stdout);
    return kExitOk;
  }

  Invocation invocation;
  invocation.command = command;
  std::map<std::string, std::string> given;
  for (size_t i = 0; i < words.size(); ++i) {
    if (static_cast<int>(i) == command_index) continue;
    const std::string& word = words[i];
    if (!absl::StartsWith(word, "-") || word == "-") {
      invocation.args.positional.push_back(word);
      continue;
    }
    if (!absl::StartsWith(word, "--")) return usage_error(absl::StrCat("unknown flag ", word, ": flags start with --"));
    const size_t eq = word.find('=');
    const std::string flag_name = word.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const auto spec = std::find_if(flags.begin(), flags.end(), [&](const FlagSpec& f) { return f.name == flag_name; });
    if (spec == flags.end()) {
      const std::string closest = Closest(flag_name, flags);
      return usage_error(absl::StrCat("unknown flag --", flag_name,
                                      closest.empty() ? "" : absl::StrCat(" (did you mean --", closest, "?)")));
    }
    std::string text;
    if (eq != std::string::npos) {
      text = word.substr(eq + 1);
    } else if (spec->kind == Kind::kBool) {
      text = "true";
    } else if (i + 1 < words.size()) {
      text = words[++i];
    } else {
      return usage_error(absl::StrCat("--", flag_name, " needs a value (", ValueName(*spec), ")"));
    }
    if (given.count(flag_name)) return usage_error(absl::StrCat("--", flag_name, " is given twice"));
    given[flag_name] = text;
  }
  for (const FlagSpec& spec : flags) {
    const auto it = given.find(spec.name);
    const std::string& text = it == given.end() ? spec.fallback : it->second;
    absl::StatusOr<FlagValue> value = ParseValue(spec, text);
    if (!value.ok()) return usage_error(absl::StrCat("--", spec.name, "=", text, ": ", value.status().message()));
    invocation.args.Set(spec.name, *std::move(value));
  }
  const size_t n = invocation.args.positional.size();
  if (n < command->min_positional || n > command->max_positional) {
    if (command->arguments.empty()) {
      return usage_error(absl::StrCat("takes no arguments, got '", invocation.args.positional[0], "'"));
    }
    return usage_error(absl::StrCat(command->max_positional == 1 ? "expected one session id" : "expected session ids",
                                    ", got ", n));
  }
  return invocation;
}

}  // namespace

int main(int argc, char** argv) {
  std::variant<Invocation, int> parsed = ParseCommandLine(argc, argv);
  if (const int* exit_status = std::get_if<int>(&parsed)) return *exit_status;
  const Invocation& invocation = std::get<Invocation>(parsed);
  const Args& args = invocation.args;
  const std::string& name = invocation.command->name;

  turbokv::ClientOptions options;
  options.timeout = args.Duration("timeout");
  options.auth_token = args.Text("token");
  options.tls_root_certs = args.Text("tls-ca");
  options.tls_client_cert = args.Text("tls-cert");
  options.tls_client_key = args.Text("tls-key");
  const std::string target = turbokv::ChannelTarget(args.Text("target"));
  // A unix socket that is not there: nothing listens (a wrong path, a daemon
  // not started), said at once; --wait waits for one still starting.
  if (!args.Bool("wait") && absl::StartsWith(target, "unix:")) {
    std::string path = target.substr(5);
    if (absl::StartsWith(path, "//")) path = path.substr(2);
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      std::fprintf(stderr, "turbokv %s: UNAVAILABLE: no socket at %s (%s): is turbokvd running and listening there? "
                   "(--wait waits for one that is starting)\n",
                   name.c_str(), path.c_str(), std::strerror(errno));
      return ExitCode(absl::UnavailableError(""));
    }
  }
  const std::unique_ptr<turbokv::Client> client = turbokv::Client::Connect(target, options);

  // The daemon may still be starting (a sidecar next to its worker): wait
  // for it, up to --timeout.
  absl::Status status = client->WaitUntilServing(options.timeout);
  if (!status.ok()) {
    status = absl::Status(status.code(), absl::StrCat("no answer from ", target, ": ", status.message()));
  } else {
    status = invocation.command->run(*client, args);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "turbokv %s: %s: %s\n", name.c_str(), absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str());
  }
  return ExitCode(status);
}
