#include "bench/prefill.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "bench/cli.h"
#include "kernels/half.h"

namespace turbokv::bench {

long long DefaultChunk(long long layers, long long kv_heads, long long head_dim) {
  const long long token_bytes = std::max(1LL, layers * kv_heads * head_dim * 2 * 2);
  return std::max(1LL, std::min(512LL, (32LL << 20) / token_bytes));
}

std::vector<uint16_t> Fp16Pool(const Shape& shape, size_t slack, std::mt19937* rng) {
  std::normal_distribution<float> normal;
  std::vector<uint16_t> pool(static_cast<size_t>(shape.layers) * shape.chunk * shape.kv_heads * shape.head_dim + slack);
  for (uint16_t& b : pool) b = FloatToHalfBits(normal(*rng));
  return pool;
}

double Prefill(const Session& session, const Shape& shape, const std::vector<uint16_t>& pool, size_t slack,
               uint64_t salt) {
  const size_t token_values = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  auto slice = [&](int64_t start, uint64_t which, size_t values) {
    const size_t at = static_cast<size_t>(start * 7919 + (salt * 2 + which) * 104729) % slack;
    return absl::Span<const uint16_t>(pool.data() + at, values);
  };
  const auto start_time = std::chrono::steady_clock::now();
  std::unique_ptr<AppendStream> stream = session.OpenAppendStream();
  for (int64_t start = 0; start < shape.tokens; start += shape.chunk) {
    const int64_t n = std::min<int64_t>(shape.chunk, shape.tokens - start);
    const size_t values = static_cast<size_t>(shape.layers) * n * token_values;
    if (!stream->Write(-1, start, TensorData::F16(slice(start, 1, values)), TensorData::F16(slice(start, 2, values)))
             .ok()) {
      break;
    }
  }
  absl::StatusOr<v1::AppendResponse> appended = stream->Finish();
  if (!appended.ok()) {
    std::fprintf(stderr, "turbokv-bench: append: %s\n", std::string(appended.status().message()).c_str());
    return -1;
  }
  return Micros(start_time) / 1e6;
}

absl::StatusOr<BenchServer> StartBenchServer(ServerOptions options) {
  const std::string socket = absl::StrCat("unix:///tmp/turbokv-bench-", getpid(), ".sock");
  options.listen = {socket};
  options.memory_budget = size_t{16} << 30;
  BenchServer out;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
  if (!server.ok()) return server.status();
  out.server = *std::move(server);
  if (absl::Status started = out.server->Start(); !started.ok()) return started;
  out.client = Client::Connect(socket);
  if (absl::Status serving = out.client->WaitUntilServing(absl::Seconds(10)); !serving.ok()) return serving;
  return out;
}

}  // namespace turbokv::bench
