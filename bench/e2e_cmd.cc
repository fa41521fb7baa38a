// turbokv-bench e2e: the service over a unix socket, next to what it is built
// from, measured in one run: append throughput, Step and Attend latency, the
// in-process attention kernel on the same stored layer, and an empty gRPC
// round trip (a health check) on the same channel.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/cli.h"
#include "client/cpp/client.h"
#include "kernels/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/half.h"
#include "service/server.h"

namespace turbokv::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

}  // namespace

int RunE2e(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv, {"tokens", "kv-heads", "q-heads", "head-dim", "layers", "threads", "chunk", "calls", "codec"},
                     {"json"}, &error)) {
    return UsageError(error);
  }
  long long tokens, kv_heads, q_heads, head_dim, layers, threads, chunk, calls;
  if (!options.GetInt("tokens", 32768, &tokens, &error) || !options.GetInt("kv-heads", 8, &kv_heads, &error) ||
      !options.GetInt("q-heads", 32, &q_heads, &error) || !options.GetInt("head-dim", 128, &head_dim, &error) ||
      !options.GetInt("layers", 1, &layers, &error) || !options.GetInt("threads", 2, &threads, &error) ||
      !options.GetInt("chunk", 512, &chunk, &error) || !options.GetInt("calls", 200, &calls, &error)) {
    return UsageError(error);
  }
  v1::Codec codec = v1::CODEC_UNSPECIFIED;
  if (!v1::Codec_Parse("CODEC_" + absl::AsciiStrToUpper(options.Get("codec", "turbo3")), &codec)) {
    return UsageError("--codec: f16, q8_0, q4_0, turbo2, turbo3 or turbo4");
  }

  ServerOptions server_options;
  const std::string socket = absl::StrCat("unix:///tmp/turbokv-bench-", getpid(), ".sock");
  server_options.listen = {socket};
  server_options.device = "cpu";
  server_options.threads = static_cast<int>(threads);
  server_options.memory_budget = size_t{16} << 30;
  server_options.metrics_listen = "";
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(server_options);
  if (!server.ok() || !(*server)->Start().ok()) {
    std::fprintf(stderr, "turbokv-bench e2e: the server did not start\n");
    return 1;
  }
  std::unique_ptr<Client> client = Client::Connect(socket);
  SessionOptions session_options;
  session_options.layers = static_cast<int>(layers);
  session_options.kv_heads = static_cast<int>(kv_heads);
  session_options.q_heads = static_cast<int>(q_heads);
  session_options.head_dim = static_cast<int>(head_dim);
  session_options.key_codec = session_options.value_codec = codec;
  absl::StatusOr<Session> session = client->CreateSession(session_options);
  if (!client->WaitUntilServing(absl::Seconds(10)).ok() || !session.ok()) {
    std::fprintf(stderr, "turbokv-bench e2e: %s\n", std::string(session.status().message()).c_str());
    return 1;
  }

  // fp16 input, made before the clock starts.
  const size_t token_values = static_cast<size_t>(kv_heads) * head_dim;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> pool_bits(size_t{1} << 22);
  for (uint16_t& b : pool_bits) b = FloatToHalfBits(normal(rng));
  const size_t chunk_values = static_cast<size_t>(layers) * chunk * token_values;
  auto slice = [&](int64_t start, uint64_t salt) {
    const size_t at = ((start * 7919 + salt * 104729) % (pool_bits.size() - chunk_values));
    return absl::Span<const uint16_t>(pool_bits.data() + at, chunk_values);
  };
  const auto append_start = Clock::now();
  std::unique_ptr<AppendStream> stream = session->OpenAppendStream();
  for (int64_t start = 0; start < tokens; start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, tokens - start);
    const size_t values = static_cast<size_t>(layers) * n * token_values;
    if (!stream->Write(-1, start, TensorData::F16(slice(start, 1).subspan(0, values)),
                       TensorData::F16(slice(start, 2).subspan(0, values))).ok()) {
      break;
    }
  }
  absl::StatusOr<v1::AppendResponse> appended = stream->Finish();
  const double append_seconds = Micros(append_start) / 1e6;
  if (!appended.ok()) {
    std::fprintf(stderr, "turbokv-bench e2e: append: %s\n", std::string(appended.status().message()).c_str());
    return 1;
  }
  const double token_layers_per_s = tokens * layers / append_seconds;
  const double input_mb_per_s = tokens * layers * token_values * 2 * 2 / append_seconds / 1e6;

  // Step, Attend, the kernel and an empty round trip take turns, a tenth of
  // the calls at a time, so the machine's drift hits them alike.
  std::vector<float> key(token_values), value(token_values), query(static_cast<size_t>(q_heads) * head_dim);
  for (float& x : query) x = normal(rng);
  std::vector<double> step_us, attend_us, kernel_us, rtt_us;
  ThreadPool kernel_pool(static_cast<int>(threads));
  absl::StatusOr<std::shared_ptr<SessionCache>> stored = (*server)->store().Find(session->id(), "", absl::Now());
  std::vector<float> out(query.size()), lse(q_heads);
  int64_t position = tokens;
  const int per_turn = std::max<int>(1, static_cast<int>(calls / 10));
  for (int turn = 0; turn < 10; ++turn) {
    for (int i = 0; i < per_turn; ++i, ++position) {
      for (float& x : key) x = normal(rng);
      for (float& x : value) x = normal(rng);
      const auto start = Clock::now();
      absl::StatusOr<StepResult> step = session->Step(0, position, TensorData::F32(key), TensorData::F32(value),
                                                      TensorData::F32(query));
      step_us.push_back(Micros(start));
      if (!step.ok()) {
        std::fprintf(stderr, "turbokv-bench e2e: step: %s\n", std::string(step.status().message()).c_str());
        return 1;
      }
    }
    for (int i = 0; i < per_turn; ++i) {
      const auto start = Clock::now();
      absl::StatusOr<Attention> attention = session->Attend(0, TensorData::F32(query));
      attend_us.push_back(Micros(start));
      if (!attention.ok()) return 1;
    }
    for (int i = 0; i < per_turn; ++i) {
      std::lock_guard<std::mutex> lock((*stored)->mutex());
      const PagedKvCache cache = (*stored)->layers()[0].Descriptor();
      const int64_t last = cache.tokens - 1;
      AttentionParams params;
      params.q_heads = static_cast<int>(q_heads);
      AttentionOptions attention_options;
      attention_options.pool = &kernel_pool;
      const auto start = Clock::now();
      absl::Status status = AttendCpu(cache, params, AttentionQueries{1, query.data(), &last},
                                      AttentionOutput{out.data(), lse.data()}, attention_options);
      kernel_us.push_back(Micros(start));
      if (!status.ok()) return 1;
    }
    for (int i = 0; i < per_turn; ++i) {
      const auto start = Clock::now();
      if (!client->Health().ok()) return 1;
      rtt_us.push_back(Micros(start));
    }
  }
  const double step_p50 = Percentile(step_us, 0.5), kernel_p50 = Percentile(kernel_us, 0.5),
               rtt_p50 = Percentile(rtt_us, 0.5);
  const double budget = 1.5 * (kernel_p50 + rtt_p50);
  (*server)->Shutdown(absl::Seconds(1));

  if (options.Has("json")) {
    std::printf(
        "{\"tokens\": %lld, \"layers\": %lld, \"kv_heads\": %lld, \"q_heads\": %lld, \"head_dim\": %lld, "
        "\"codec\": \"%s\", \"threads\": %lld, \"append_token_layers_per_s\": %.0f, \"append_fp16_mb_per_s\": %.1f, "
        "\"step_p50_us\": %.1f, \"step_p99_us\": %.1f, \"attend_p50_us\": %.1f, \"attend_p99_us\": %.1f, "
        "\"kernel_p50_us\": %.1f, \"kernel_p99_us\": %.1f, \"empty_rtt_p50_us\": %.1f, \"empty_rtt_p99_us\": %.1f, "
        "\"step_over_kernel_plus_rtt\": %.3f}\n",
        tokens, layers, kv_heads, q_heads, head_dim, v1::Codec_Name(codec).c_str(), threads, token_layers_per_s,
        input_mb_per_s, step_p50, Percentile(step_us, 0.99), Percentile(attend_us, 0.5), Percentile(attend_us, 0.99),
        kernel_p50, Percentile(kernel_us, 0.99), rtt_p50, Percentile(rtt_us, 0.99),
        step_p50 / (kernel_p50 + rtt_p50));
    return 0;
  }
  std::printf("turbokvd over a unix socket, %s keys and values, %lld kv heads, %lld q heads, d %lld, %lld threads\n\n",
              v1::Codec_Name(codec).c_str(), kv_heads, q_heads, head_dim, threads);
  std::printf("| measure | p50 | p99 |\n|---|---:|---:|\n");
  std::printf("| append, %lld tokens x %lld layers in chunks of %lld (fp16 in) | %.0f token-layers/s, %.0f MB/s | |\n",
              tokens, layers, chunk, token_layers_per_s, input_mb_per_s);
  std::printf("| Step (append 1 token + attend, %lld tokens) | %.0f us | %.0f us |\n", tokens, step_p50,
              Percentile(step_us, 0.99));
  std::printf("| Attend (1 query) | %.0f us | %.0f us |\n", Percentile(attend_us, 0.5), Percentile(attend_us, 0.99));
  std::printf("| in-process kernel, same layer and query | %.0f us | %.0f us |\n", kernel_p50,
              Percentile(kernel_us, 0.99));
  std::printf("| empty gRPC round trip (health check) | %.0f us | %.0f us |\n", rtt_p50, Percentile(rtt_us, 0.99));
  std::printf("\nStep p50 / (kernel p50 + empty round trip p50) = %.2f (target <= 1.5: %s)\n",
              step_p50 / (kernel_p50 + rtt_p50), step_p50 <= budget ? "met" : "NOT met");
  return 0;
}

}  // namespace turbokv::bench
