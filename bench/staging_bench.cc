// The host's share of a GPU attention call (cuda_staging.h), measured without
// a GPU: planning a Decode layer-step over a batch of sessions, writing its
// page tables, queries and descriptors into the staging buffer (plain host
// memory here, pinned on a GPU machine) and delivering the results back.
// The page tables are staged whole on every call, not kept on the device;
// this is what that costs. Run: build/bench/staging_bench.
#include <cstdint>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/attention.h"
#include "kernels/cuda/cuda_staging.h"
#include "kernels/layout.h"

namespace turbokv {
namespace {

constexpr int kKvHeads = 8, kQHeads = 32, kDim = 128, kPageTokens = 64;

// state.range(0) sessions of state.range(1) tokens each, turbo3 keys and
// values, one query each: a Decode message of one layer.
void BM_AttentionStaging(benchmark::State& state) {
  const int64_t sessions = state.range(0), tokens = state.range(1);
  const int64_t pages = (tokens + kPageTokens - 1) / kPageTokens;
  // Page addresses only: staging copies the table, never the pages.
  std::vector<const uint8_t*> table(static_cast<size_t>(pages));
  for (int64_t p = 0; p < pages; ++p) table[p] = reinterpret_cast<const uint8_t*>(uintptr_t{4096} * (p + 1));
  std::vector<float> q(static_cast<size_t>(kQHeads) * kDim, 0.5f), out(q.size() * sessions);
  std::vector<float> lse(static_cast<size_t>(kQHeads) * sessions);
  const std::vector<int64_t> positions(1, tokens - 1);
  std::vector<AttentionProblem> problems(static_cast<size_t>(sessions));
  for (int64_t s = 0; s < sessions; ++s) {
    PagedKvCache& cache = problems[s].cache;
    cache.key_layout = MakeCodecLayout(CodecKind::kTurbo3, kDim);
    cache.value_layout = cache.key_layout;
    cache.key_seed = 1;
    cache.value_seed = 2;
    cache.kv_heads = kKvHeads;
    cache.page_tokens = kPageTokens;
    cache.tokens = tokens;
    cache.pages = table.data();
    problems[s].queries = {1, q.data(), positions.data()};
    problems[s].output = {out.data() + s * kQHeads * kDim, lse.data() + s * kQHeads, nullptr, nullptr};
  }
  AttentionParams params;
  params.q_heads = kQHeads;
  // The buffers sized once, as a stream's are kept from call to call.
  const cuda::StagingLayout sizes = cuda::AttentionStaging(problems.data(), problems.size(), params).layout();
  std::vector<uint8_t> host(sizes.host_bytes), device(sizes.device_bytes);
  for (auto _ : state) {
    cuda::AttentionStaging staging(problems.data(), problems.size(), params);
    benchmark::DoNotOptimize(staging.Fill(host.data(), device.data()).data());
    staging.Deliver(host.data());
  }
  state.counters["bytes_up"] = static_cast<double>(sizes.up);
  state.counters["table_bytes"] = static_cast<double>(sessions * pages * sizeof(uint8_t*));
}
BENCHMARK(BM_AttentionStaging)->Args({1, 16384})->Args({32, 16384})->Args({8, 131072})->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace turbokv
