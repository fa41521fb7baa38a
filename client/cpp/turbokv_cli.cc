// turbokv: the command-line client of turbokvd.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "client/cpp/demo.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/half.h"

namespace {

constexpr char kUsage[] = R"(turbokv: command-line client of turbokvd

usage: turbokv [--target=ADDR] COMMAND [ARGS] [--flag=value ...]
  --target=ADDR   unix:///path or host:port (default unix:///tmp/turbokv.sock)
  --token=TOKEN   bearer token (turbokvd --auth-tokens-file)
  --tls-ca=PEM    TLS to a TCP target, trusting this CA; --tls-cert=PEM --tls-key=PEM for mTLS

commands:
  create [--layers=N --kv-heads=N --q-heads=N --head-dim=N --key-codec=C --value-codec=C
          --max-tokens=N --ttl=DURATION --pinned=true]
                                              create a session, print its id
  list                                        every session (JSON lines)
  get ID                                      one session (JSON)
  delete ID
  stats                                       the daemon's totals (JSON)
  snapshot                                    write every session to turbokvd's --snapshot-dir now
  prefetch ID...                              bring sessions back from turbokvd's --spill-dir
  append-random ID [--tokens=N --chunk=N --layer=L|all]
                                              append random fp16 keys/values
  attend-random ID [--layer=L --queries=N --calls=N]
                                              random queries, print latency
  decode-random [--batch=B --layers=L --steps=S --kv-heads=N --q-heads=N --head-dim=N --codec=C]
                                              B new sessions decoded together through one
                                              Decode stream (a message per layer and step),
                                              print throughput and latency, delete them
  demo [--layers=32 --kv-heads=8 --q-heads=32 --head-dim=128 --tokens=8192 --chunk=128
        --steps=32 --codec=turbo3]            a model-shaped workload, checked
                                              against float attention
codecs: f16, q8_0, q4_0, turbo2, turbo3, turbo4
)";

struct Args {
  std::string command;
  std::vector<std::string> positional;
  std::map<std::string, std::string> flags;
  std::map<std::string, bool> used;

  std::string Flag(const std::string& name, const std::string& fallback) {
    used[name] = true;
    auto it = flags.find(name);
    return it == flags.end() ? fallback : it->second;
  }
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t fallback) {
    const std::string text = Flag(name, "");
    if (text.empty()) return fallback;
    int64_t value;
    if (!absl::SimpleAtoi(text, &value)) return absl::InvalidArgumentError(absl::StrCat("--", name, "=", text, ": not a number"));
    return value;
  }
};

absl::StatusOr<turbokv::v1::Codec> ParseCodec(const std::string& name) {
  turbokv::v1::Codec codec;
  if (!turbokv::v1::Codec_Parse("CODEC_" + absl::AsciiStrToUpper(name), &codec) || codec == turbokv::v1::CODEC_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("unknown codec '", name, "': use f16, q8_0, q4_0, turbo2, turbo3 or turbo4"));
  }
  return codec;
}

std::string Json(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(message, &json, options).ok()) return message.ShortDebugString();
  return json;
}

#define TRY_INT(var, args, name, fallback)                 \
  absl::StatusOr<int64_t> var##_or = (args).Int(name, fallback); \
  if (!var##_or.ok()) return var##_or.status();            \
  const int64_t var = *var##_or

absl::Status Create(const turbokv::Client& client, Args& args) {
  turbokv::SessionOptions options;
  TRY_INT(layers, args, "layers", 32);
  TRY_INT(kv_heads, args, "kv-heads", 8);
  TRY_INT(q_heads, args, "q-heads", 32);
  TRY_INT(head_dim, args, "head-dim", 128);
  TRY_INT(max_tokens, args, "max-tokens", 0);
  options.layers = static_cast<int>(layers);
  options.kv_heads = static_cast<int>(kv_heads);
  options.q_heads = static_cast<int>(q_heads);
  options.head_dim = static_cast<int>(head_dim);
  options.max_tokens = max_tokens;
  absl::StatusOr<turbokv::v1::Codec> key = ParseCodec(args.Flag("key-codec", "turbo3"));
  if (!key.ok()) return key.status();
  absl::StatusOr<turbokv::v1::Codec> value = ParseCodec(args.Flag("value-codec", "turbo3"));
  if (!value.ok()) return value.status();
  options.key_codec = *key;
  options.value_codec = *value;
  const std::string ttl = args.Flag("ttl", "0");
  if (!absl::ParseDuration(ttl, &options.idle_ttl)) return absl::InvalidArgumentError("--ttl: expected a duration like 30m");
  const std::string pinned = args.Flag("pinned", "false");
  if (pinned != "true" && pinned != "false") return absl::InvalidArgumentError("--pinned: expected true or false");
  options.pinned = pinned == "true";
  absl::StatusOr<turbokv::Session> session = client.CreateSession(options);
  if (!session.ok()) return session.status();
  std::printf("%s\n", session->id().c_str());
  return absl::OkStatus();
}

absl::Status AppendRandom(const turbokv::Client& client, Args& args) {
  absl::StatusOr<turbokv::Session> session = client.OpenSession(args.positional.at(0));
  if (!session.ok()) return session.status();
  TRY_INT(tokens, args, "tokens", 1024);
  TRY_INT(chunk, args, "chunk", 128);
  const std::string layer_flag = args.Flag("layer", "all");
  int layer = -1;
  if (layer_flag != "all" && !absl::SimpleAtoi(layer_flag, &layer)) {
    return absl::InvalidArgumentError("--layer: expected a layer number or all");
  }
  const auto& shape = session->config().shape();
  absl::StatusOr<turbokv::v1::SessionInfo> info = session->Info();
  if (!info.ok()) return info.status();
  if (layer >= info->layer_tokens_size()) {
    return absl::InvalidArgumentError(absl::StrCat("--layer=", layer, ": the session has ", info->layer_tokens_size(),
                                                   " layers"));
  }
  const int64_t start = info->layer_tokens(layer < 0 ? 0 : layer);
  const size_t row = static_cast<size_t>(shape.kv_heads()) * shape.head_dim() * (layer < 0 ? shape.layers() : 1);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::unique_ptr<turbokv::AppendStream> stream = session->OpenAppendStream();
  const absl::Time begin = absl::Now();
  for (int64_t t = 0; t < tokens && chunk > 0; t += chunk) {
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
  std::printf("appended %lld tokens in %.2f s (%.0f tokens/s); layer holds %lld\n", static_cast<long long>(tokens),
              seconds, tokens / seconds, static_cast<long long>(last->tokens()));
  return absl::OkStatus();
}

absl::Status AttendRandom(const turbokv::Client& client, Args& args) {
  absl::StatusOr<turbokv::Session> session = client.OpenSession(args.positional.at(0));
  if (!session.ok()) return session.status();
  TRY_INT(layer, args, "layer", 0);
  TRY_INT(queries, args, "queries", 1);
  TRY_INT(calls, args, "calls", 10);
  const auto& shape = session->config().shape();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<size_t>(std::max<int64_t>(queries, 1)) * shape.q_heads() * shape.head_dim());
  std::vector<double> us;
  for (int64_t c = 0; c < calls; ++c) {
    for (float& x : q) x = normal(rng);
    const absl::Time begin = absl::Now();
    absl::StatusOr<turbokv::Attention> attention = session->Attend(static_cast<int>(layer), turbokv::TensorData::F32(q));
    if (!attention.ok()) return attention.status();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - begin));
  }
  std::sort(us.begin(), us.end());
  std::printf("attend: %lld calls of %lld queries on layer %lld: p50 %.0f us, max %.0f us\n",
              static_cast<long long>(calls), static_cast<long long>(queries), static_cast<long long>(layer),
              us.empty() ? 0 : us[us.size() / 2], us.empty() ? 0 : us.back());
  return absl::OkStatus();
}

absl::Status DecodeRandom(const turbokv::Client& client, Args& args) {
  TRY_INT(batch, args, "batch", 8);
  TRY_INT(layers, args, "layers", 4);
  TRY_INT(steps, args, "steps", 16);
  TRY_INT(kv_heads, args, "kv-heads", 8);
  TRY_INT(q_heads, args, "q-heads", 32);
  TRY_INT(head_dim, args, "head-dim", 128);
  if (batch < 1 || layers < 1 || steps < 1) return absl::InvalidArgumentError("--batch, --layers and --steps must be >= 1");
  turbokv::SessionOptions options;
  options.layers = static_cast<int>(layers);
  options.kv_heads = static_cast<int>(kv_heads);
  options.q_heads = static_cast<int>(q_heads);
  options.head_dim = static_cast<int>(head_dim);
  absl::StatusOr<turbokv::v1::Codec> codec = ParseCodec(args.Flag("codec", "turbo3"));
  if (!codec.ok()) return codec.status();
  options.key_codec = options.value_codec = *codec;
  std::vector<turbokv::Session> sessions;
  turbokv::DecodeBatch message;
  for (int64_t i = 0; i < batch; ++i) {
    absl::StatusOr<turbokv::Session> session = client.CreateSession(options);
    if (!session.ok()) return session.status();
    message.session_ids.push_back(session->id());
    sessions.push_back(*std::move(session));
  }
  message.q_heads = options.q_heads;
  message.kv_heads = options.kv_heads;
  message.head_dim = options.head_dim;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  std::vector<float> keys(static_cast<size_t>(batch) * kv_heads * head_dim), values(keys.size()),
      queries(static_cast<size_t>(batch) * q_heads * head_dim);
  std::unique_ptr<turbokv::DecodeStream> stream = client.OpenDecodeStream();
  std::vector<double> us;
  absl::Status status;
  const absl::Time begin = absl::Now();
  for (int64_t step = 0; step < steps && status.ok(); ++step) {
    message.positions.assign(batch, step);
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
  std::printf("decode: %lld sessions x %lld layers x %lld steps through one Decode stream: %.0f tokens/s, "
              "per layer-step p50 %.0f us, p99 %.0f us\n",
              static_cast<long long>(batch), static_cast<long long>(layers), static_cast<long long>(steps),
              batch * steps / seconds, us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]);
  return absl::OkStatus();
}

absl::Status Demo(const turbokv::Client& client, Args& args) {
  turbokv::DemoOptions options;
  TRY_INT(layers, args, "layers", options.layers);
  TRY_INT(kv_heads, args, "kv-heads", options.kv_heads);
  TRY_INT(q_heads, args, "q-heads", options.q_heads);
  TRY_INT(head_dim, args, "head-dim", options.head_dim);
  TRY_INT(tokens, args, "tokens", options.tokens);
  TRY_INT(chunk, args, "chunk", options.chunk);
  TRY_INT(steps, args, "steps", options.steps);
  options.layers = static_cast<int>(layers);
  options.kv_heads = static_cast<int>(kv_heads);
  options.q_heads = static_cast<int>(q_heads);
  options.head_dim = static_cast<int>(head_dim);
  options.tokens = tokens;
  options.chunk = chunk;
  options.steps = static_cast<int>(steps);
  if (options.tokens < 1 || options.chunk < 1 || options.steps < 1 || options.layers < 1) {
    return absl::InvalidArgumentError("--tokens, --chunk, --steps and --layers must be at least 1");
  }
  absl::StatusOr<turbokv::v1::Codec> codec = ParseCodec(args.Flag("codec", "turbo3"));
  if (!codec.ok()) return codec.status();
  options.key_codec = options.value_codec = *codec;
  return turbokv::RunDemo(client, options);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (absl::StartsWith(arg, "--")) {
      const size_t eq = arg.find('=');
      if (eq == std::string::npos) {
        if (i + 1 >= argc) {
          std::fprintf(stderr, "turbokv: %s needs a value\n", arg.c_str());
          return 2;
        }
        args.flags[arg.substr(2)] = argv[++i];
      } else {
        args.flags[arg.substr(2, eq - 2)] = arg.substr(eq + 1);
      }
    } else if (args.command.empty()) {
      args.command = arg;
    } else {
      args.positional.push_back(arg);
    }
  }
  if (args.command.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const bool needs_id = args.command == "get" || args.command == "delete" || args.command == "append-random" ||
                        args.command == "attend-random";
  if (needs_id && args.positional.size() != 1) {
    std::fprintf(stderr, "turbokv %s: expected one session id\n", args.command.c_str());
    return 2;
  }
  if (args.command == "prefetch" && args.positional.empty()) {
    std::fprintf(stderr, "turbokv prefetch: expected session ids\n");
    return 2;
  }
  turbokv::ClientOptions client_options;
  client_options.auth_token = args.Flag("token", "");
  for (const auto& [flag, field] : {std::pair<const char*, std::string*>{"tls-ca", &client_options.tls_root_certs},
                                    {"tls-cert", &client_options.tls_client_cert},
                                    {"tls-key", &client_options.tls_client_key}}) {
    const std::string path = args.Flag(flag, "");
    if (path.empty()) continue;
    std::ifstream in(path);
    if (!in) {
      std::fprintf(stderr, "turbokv: --%s: cannot read %s\n", flag, path.c_str());
      return 2;
    }
    std::stringstream text;
    text << in.rdbuf();
    *field = text.str();
  }
  const std::unique_ptr<turbokv::Client> client =
      turbokv::Client::Connect(args.Flag("target", "unix:///tmp/turbokv.sock"), client_options);

  // The daemon may still be starting (a sidecar next to its worker); if it
  // does not come up, the command itself reports the connection error.
  client->WaitUntilServing(absl::Seconds(30)).IgnoreError();
  absl::Status status;
  if (args.command == "create") {
    status = Create(*client, args);
  } else if (args.command == "list") {
    absl::StatusOr<std::vector<turbokv::v1::SessionInfo>> sessions = client->ListSessions();
    status = sessions.status();
    if (sessions.ok()) {
      for (const auto& s : *sessions) std::printf("%s\n", Json(s).c_str());
    }
  } else if (args.command == "get") {
    absl::StatusOr<turbokv::v1::SessionInfo> info = client->GetSession(args.positional[0]);
    status = info.status();
    if (info.ok()) std::printf("%s\n", Json(*info).c_str());
  } else if (args.command == "delete") {
    status = client->DeleteSession(args.positional[0]);
  } else if (args.command == "stats") {
    absl::StatusOr<turbokv::v1::StatsResponse> stats = client->Stats();
    status = stats.status();
    if (stats.ok()) std::printf("%s\n", Json(*stats).c_str());
  } else if (args.command == "snapshot") {
    absl::StatusOr<turbokv::v1::SnapshotResponse> snapshot = client->Snapshot();
    status = snapshot.status();
    if (snapshot.ok()) std::printf("%s\n", Json(*snapshot).c_str());
  } else if (args.command == "prefetch") {
    absl::StatusOr<std::vector<absl::Status>> prefetched = client->Prefetch(args.positional);
    status = prefetched.status();
    for (size_t i = 0; prefetched.ok() && i < prefetched->size(); ++i) {
      const absl::Status& one = (*prefetched)[i];
      std::printf("%s %s%s%s\n", args.positional[i].c_str(), absl::StatusCodeToString(one.code()).c_str(),
                  one.ok() ? "" : ": ", std::string(one.message()).c_str());
      if (!one.ok() && status.ok()) status = absl::Status(one.code(), "not every session was prefetched");
    }
  } else if (args.command == "append-random") {
    status = AppendRandom(*client, args);
  } else if (args.command == "attend-random") {
    status = AttendRandom(*client, args);
  } else if (args.command == "decode-random") {
    status = DecodeRandom(*client, args);
  } else if (args.command == "demo") {
    status = Demo(*client, args);
  } else {
    std::fprintf(stderr, "turbokv: unknown command '%s'\n%s", args.command.c_str(), kUsage);
    return 2;
  }
  for (const auto& [name, value] : args.flags) {
    if (!args.used.count(name)) std::fprintf(stderr, "turbokv: warning: --%s is not used by %s\n", name.c_str(), args.command.c_str());
  }
  if (!status.ok()) {
    std::fprintf(stderr, "turbokv %s: %s: %s\n", args.command.c_str(), absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
