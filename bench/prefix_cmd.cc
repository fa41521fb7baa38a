// turbokv-bench prefix: sessions that share a prefix by content. One
// session appends the prefix (every layer, fp16 in, over the client) and
// names its blocks; the others start from it (CreateSession with the block
// hashes). Reports the memory the store holds for all of them against one
// session's, and the time of starting from the prefix against appending it.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "bench/cli.h"
#include "bench/prefill.h"
#include "client/cpp/client.h"

namespace turbokv::bench {

int RunPrefix(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv, {"sessions", "tokens", "layers", "kv-heads", "q-heads", "head-dim", "threads", "preset"},
                     {"json"}, &error)) {
    return UsageError(error);
  }
  long long sessions = 0, tokens = 0, layers = 0, kv_heads = 0, q_heads = 0, head_dim = 0, threads = 0;
  if (!options.GetInt("sessions", 32, &sessions, &error) || !options.GetInt("tokens", 4096, &tokens, &error) ||
      !options.GetInt("layers", 32, &layers, &error) || !options.GetInt("kv-heads", 8, &kv_heads, &error) ||
      !options.GetInt("q-heads", 32, &q_heads, &error) || !options.GetInt("head-dim", 128, &head_dim, &error) ||
      !options.GetInt("threads", 2, &threads, &error)) {
    return UsageError(error);
  }
  if (sessions < 2) return UsageError("--sessions must be at least 2 (one appends, the others start from it)");
  auto fail = [](const std::string& what, const absl::Status& status) {
    std::fprintf(stderr, "turbokv-bench prefix: %s: %s\n", what.c_str(), std::string(status.message()).c_str());
    return 1;
  };
  ServerOptions server_options;
  server_options.device = "cpu";
  server_options.threads = static_cast<int>(threads);
  server_options.metrics_listen = "";
  absl::StatusOr<BenchServer> started = StartBenchServer(server_options);
  if (!started.ok()) return fail("the server did not start", started.status());
  Client& client = *started->client;

  SessionOptions session_options;
  session_options.layers = static_cast<int>(layers);
  session_options.kv_heads = static_cast<int>(kv_heads);
  session_options.q_heads = static_cast<int>(q_heads);
  session_options.head_dim = static_cast<int>(head_dim);
  session_options.preset = options.Get("preset", "");
  session_options.rotation_seed = 1;
  absl::StatusOr<Session> storer = client.CreateSession(session_options);
  if (!storer.ok()) return fail("create", storer.status());
  const std::string preset = storer->config().preset();

  // The prefix, appended in the daemon's usual chunks: the first fixes the
  // key transform, within the prefix.
  const Shape shape{tokens, kv_heads, q_heads, head_dim, layers, threads, DefaultChunk(layers, kv_heads, head_dim)};
  constexpr size_t kSlack = size_t{1} << 20;
  std::mt19937 rng(1);
  const std::vector<uint16_t> pool = Fp16Pool(shape, kSlack, &rng);
  const double append_seconds = Prefill(*storer, shape, pool, kSlack, 0);
  if (append_seconds < 0) return 1;
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(1000 + i);
  const std::vector<std::string> hashes = BlockHashes(ids, storer->block_tokens(), "turbokv-bench prefix");
  absl::StatusOr<v1::NameBlocksResponse> named = storer->NameBlocks(0, hashes);
  if (!named.ok()) return fail("name blocks", named.status());
  absl::StatusOr<v1::StatsResponse> one = client.Stats();
  if (!one.ok()) return fail("stats", one.status());

  session_options.prefix_blocks = hashes;
  std::vector<double> attach_ms;
  for (long long i = 1; i < sessions; ++i) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<Session> attached = client.CreateSession(session_options);
    attach_ms.push_back(Micros(start) / 1e3);
    if (!attached.ok()) return fail("create with the prefix", attached.status());
    if (attached->prefix_tokens() != static_cast<int64_t>(hashes.size()) * storer->block_tokens()) {
      std::fprintf(stderr, "turbokv-bench prefix: a session started with %lld of the prefix's %lld tokens\n",
                   static_cast<long long>(attached->prefix_tokens()), tokens);
      return 1;
    }
  }
  absl::StatusOr<v1::StatsResponse> all = client.Stats();
  if (!all.ok()) return fail("stats", all.status());
  started->server->Shutdown(absl::Seconds(1)).IgnoreError();  // no snapshot dir: nothing to fail

  const double memory_ratio = static_cast<double>(all->bytes_used()) / static_cast<double>(one->bytes_used());
  const double attach_p50 = Percentile(attach_ms, 0.5), attach_max = Percentile(attach_ms, 1.0);
  const double time_ratio = attach_p50 / (append_seconds * 1e3);
  if (options.Has("json")) {
    std::printf(
        "{\"sessions\": %lld, \"tokens\": %lld, \"layers\": %lld, \"kv_heads\": %lld, \"head_dim\": %lld, "
        "\"preset\": \"%s\", \"block_tokens\": %d, \"named_blocks\": %lld, \"append_ms\": %.3f, "
        "\"attach_p50_ms\": %.3f, \"attach_max_ms\": %.3f, \"attach_over_append\": %.5f, \"bytes_one\": %lld, "
        "\"bytes_all\": %lld, \"memory_ratio\": %.4f, \"device\": \"%s\"}\n",
        sessions, tokens, layers, kv_heads, head_dim, preset.c_str(), storer->block_tokens(),
        static_cast<long long>(named->named_blocks()), append_seconds * 1e3, attach_p50, attach_max, time_ratio,
        static_cast<long long>(one->bytes_used()), static_cast<long long>(all->bytes_used()), memory_ratio,
        one->device().c_str());
    return 0;
  }
  std::printf("%lld sessions sharing a %lld-token prefix: %lld layers, %lld kv heads, d %lld, preset %s, %s\n\n",
              sessions, tokens, layers, kv_heads, head_dim, preset.c_str(), one->device().c_str());
  std::printf("  append the prefix (one session, fp16 in)   %10.1f ms\n", append_seconds * 1e3);
  std::printf("  start a session from it (p50 / max)       %10.3f / %.3f ms   %.2f%% of appending\n", attach_p50,
              attach_max, 100 * time_ratio);
  std::printf("  memory held, one session                  %10.1f MB\n", one->bytes_used() / 1e6);
  std::printf("  memory held, all %3lld sessions             %10.1f MB   %.3fx one session's\n", sessions,
              all->bytes_used() / 1e6, memory_ratio);
  return 0;
}

}  // namespace turbokv::bench
