// turbokv-bench attend: attention on the compressed cache, next to the same
// attention on an f16 cache of the same vectors and a plain streaming read of
// as many bytes as the compressed cache, all with the same threads, in one run;
// and the floor of the integer scan's arithmetic: its 16-bit multiply-adds
// alone, at this core's peak rate for them.
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/cli.h"
#include "kernels/attention.h"
#include "kernels/cpu/cpu_codecs.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/paged_cache.h"
#ifdef TURBOKV_WITH_CUDA
#include "bench/cuda_attention_timing.h"
#endif

namespace turbokv::bench {
namespace {

// Uniform values in [-1, 1): attention speed does not depend on the data.
void FillRandom(std::vector<float>* x, uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& v : *x) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    v = static_cast<float>(static_cast<int32_t>(s >> 32)) * (1.0f / 2147483648.0f);
  }
}

struct Cache {
  std::unique_ptr<PagedCacheBuffer> buffer;
  size_t bytes = 0;  // what attention reads: every token's key and value records
};

std::string BuildCache(CodecKind k, CodecKind v, int head_dim, int kv_heads, int page_tokens,
                       int64_t tokens, const std::vector<float>& keys,
                       const std::vector<float>& values, Cache* cache) {
  auto made = PagedCacheBuffer::Create(CodecSpec{k, head_dim, 1}, CodecSpec{v, head_dim, 2},
                                       kv_heads, page_tokens);
  if (!made.ok()) return std::string(made.status().message());
  cache->buffer = *std::move(made);
  cache->buffer->Append(tokens, keys.data(), values.data());
  const PagedKvCache& d = cache->buffer->descriptor();
  cache->bytes = static_cast<size_t>(tokens) * kv_heads *
                 (d.key_layout.code_size() + d.value_layout.code_size());
  return std::string();
}

// A plain read of every 8-byte word of `buffer`, split over the pool.
uint64_t StreamRead(ThreadPool& pool, const std::vector<uint64_t>& buffer) {
  const int parts = pool.size();
  std::vector<uint64_t> sums(parts);
  pool.ParallelFor(parts, [&](int64_t part) {
    const size_t begin = buffer.size() * part / parts, end = buffer.size() * (part + 1) / parts;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    size_t i = begin;
    for (; i + 4 <= end; i += 4) {
      a += buffer[i];
      b += buffer[i + 1];
      c += buffer[i + 2];
      d += buffer[i + 3];
    }
    for (; i < end; ++i) a += buffer[i];
    sums[part] = a + b + c + d;
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return total;
}

#ifdef TURBOKV_WITH_CUDA
// The same comparison on GPU 0, for a batch of `sessions` copies of the cache
// (one decode step of that many sessions in one call): the kernels' time
// (CUDA events), the compressed cache's bytes read per second against a
// device-to-device copy of as many bytes, and the f16 cache through the same
// kernel (the tensor-core one in its default variant when `kernel` names
// another).
int RunAttendCuda(const Cache& compressed, const Cache& f16, int sessions, const AttentionParams& params,
                  const AttentionQueries& queries, CudaKernelChoice kernel, bool json) {
  auto c = MeasureCudaAttention(compressed.buffer->descriptor(), sessions, params, queries, compressed.bytes, kernel);
  auto f = MeasureCudaAttention(f16.buffer->descriptor(), sessions, params, queries, f16.bytes,
                                {kernel.tensor_cores, 0, 0});
  if (!c.ok() || !f.ok()) {
    std::fprintf(stderr, "turbokv-bench: %s\n", std::string((c.ok() ? f.status() : c.status()).message()).c_str());
    return 1;
  }
  const double bytes = static_cast<double>(compressed.bytes) * sessions;
  const double cache_gb_per_s = bytes / (c->us_per_call * 1e-6) / 1e9;
  const double f16_gb_per_s = static_cast<double>(f16.bytes) * sessions / (f->us_per_call * 1e-6) / 1e9;
  if (json) {
    std::printf("{\"implementation\": \"cuda:0\", \"kernel\": \"%s\", \"warps\": %d, \"stages\": %d, "
                "\"sessions\": %d, \"us_per_call\": %.6g, "
                "\"f16_us_per_call\": %.6g, \"cache_bytes\": %.0f, \"cache_gb_per_s\": %.6g, "
                "\"f16_gb_per_s\": %.6g, \"device_copy_gb_per_s\": %.6g, \"fraction_of_device_copy\": %.6g, "
                "\"speedup_vs_f16\": %.6g}\n",
                kernel.tensor_cores ? "tensor-cores" : "split", kernel.warps, kernel.stages, sessions, c->us_per_call,
                f->us_per_call, bytes, cache_gb_per_s, f16_gb_per_s, c->copy_gb_per_s,
                cache_gb_per_s / c->copy_gb_per_s, f->us_per_call / c->us_per_call);
    return 0;
  }
  std::printf("attend %s keys, %s values: %d session%s x %lld tokens, %d kv heads, %d q heads, d %d, %lld quer%s, "
              "GPU 0, %s kernel\n",
              CodecName(compressed.buffer->descriptor().key_layout.kind),
              CodecName(compressed.buffer->descriptor().value_layout.kind), sessions, sessions == 1 ? "" : "s",
              static_cast<long long>(compressed.buffer->tokens()), compressed.buffer->descriptor().kv_heads,
              params.q_heads, compressed.buffer->descriptor().key_layout.head_dim,
              static_cast<long long>(queries.n), queries.n == 1 ? "y" : "ies",
              kernel.tensor_cores ? "tensor-core" : "CUDA-core split");
  std::printf("  compressed %.1f us/call (%.0f GB/s of cache, %.0f%% of the device copy), f16 %.1f us/call "
              "(%.0f GB/s); speed-up %.2fx; device copy %.0f GB/s\n",
              c->us_per_call, cache_gb_per_s, 100 * cache_gb_per_s / c->copy_gb_per_s, f->us_per_call, f16_gb_per_s,
              f->us_per_call / c->us_per_call, c->copy_gb_per_s);
  return 0;
}
#endif

}  // namespace

int RunAttend(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv,
                     {"k-codec", "v-codec", "tokens", "kv-heads", "q-heads", "head-dim", "queries",
                      "threads", "page-tokens", "impl", "target", "chunk-tokens", "sessions", "kernel", "variant"},
                     {"json", "few-tokens"}, &error)) {
    return UsageError(error);
  }
  long long tokens, kv_heads, q_heads, head_dim, n_queries, threads, page_tokens, sessions, chunk_tokens = 0;
  if (!options.GetInt("tokens", 16384, &tokens, &error) ||
      !options.GetInt("kv-heads", 8, &kv_heads, &error) ||
      !options.GetInt("q-heads", 32, &q_heads, &error) ||
      !options.GetInt("head-dim", 128, &head_dim, &error) ||
      !options.GetInt("queries", 1, &n_queries, &error) ||
      !options.GetInt("threads", 1, &threads, &error) ||
      !options.GetInt("page-tokens", 256, &page_tokens, &error) ||
      !options.GetInt("sessions", 1, &sessions, &error) ||
      (options.Has("chunk-tokens") && !options.GetInt("chunk-tokens", 1024, &chunk_tokens, &error))) {
    return UsageError(error);
  }
  if (options.Has("target")) {  // measure a lower Highway target on this CPU
    const absl::Status forced = ForceSimdTarget(options.Get("target", ""));
    if (!forced.ok()) return UsageError(std::string(forced.message()));
  }
  const auto k_codec = ParseCodecKind(options.Get("k-codec", "turbo3"));
  if (!k_codec.ok()) return UsageError(std::string(k_codec.status().message()));
  const auto v_codec = ParseCodecKind(options.Get("v-codec", "turbo3"));
  if (!v_codec.ok()) return UsageError(std::string(v_codec.status().message()));
  if (q_heads % kv_heads != 0) return UsageError("--q-heads must be a multiple of --kv-heads");
  if (n_queries > tokens) return UsageError("--queries cannot exceed --tokens");
  if (head_dim > kMaxHeadDim || kv_heads > 1024 || q_heads > 8192 || threads > 1024 || sessions < 1 ||
      sessions > 4096) {
    return UsageError("a size is out of range");
  }
  const int d = static_cast<int>(head_dim), kv = static_cast<int>(kv_heads);

  std::vector<float> keys(static_cast<size_t>(tokens) * kv * d), values(keys.size());
  FillRandom(&keys, 1);
  FillRandom(&values, 2);
  Cache compressed, f16;
  error = BuildCache(*k_codec, *v_codec, d, kv, static_cast<int>(page_tokens), tokens, keys, values,
                     &compressed);
  if (error.empty()) {
    error = BuildCache(CodecKind::kF16, CodecKind::kF16, d, kv, static_cast<int>(page_tokens), tokens,
                       keys, values, &f16);
  }
  if (!error.empty()) return UsageError(error);
  keys = {};
  values = {};

  std::vector<float> q(static_cast<size_t>(n_queries) * q_heads * d);
  FillRandom(&q, 3);
  std::vector<int64_t> positions(n_queries);
  for (long long i = 0; i < n_queries; ++i) positions[i] = tokens - n_queries + i;
  std::vector<float> out(q.size()), lse(static_cast<size_t>(n_queries) * q_heads);
  AttentionParams params;
  params.q_heads = static_cast<int>(q_heads);
  const AttentionQueries queries{n_queries, q.data(), positions.data()};
  const std::string impl = options.Get("impl", "cpu");
#ifdef TURBOKV_WITH_CUDA
  if (impl == "cuda") {
    CudaKernelChoice kernel;
    const std::string name = options.Get("kernel", "split");
    if (name != "split" && name != "tensor-cores") return UsageError("--kernel must be split or tensor-cores");
    kernel.tensor_cores = name == "tensor-cores";
    if (options.Has("variant")) {
      const std::string variant = options.Get("variant", "");
      char rest = 0;
      if (!kernel.tensor_cores ||
          std::sscanf(variant.c_str(), "%d,%d%c", &kernel.warps, &kernel.stages, &rest) != 2 ||
          kernel.warps < 1 || kernel.stages < 1) {
        return UsageError("--variant takes WARPS,STAGES (4,2 say) with --kernel tensor-cores");
      }
    }
    return RunAttendCuda(compressed, f16, static_cast<int>(sessions), params, queries, kernel, options.Has("json"));
  }
#endif
  if (options.Has("kernel") || options.Has("variant")) return UsageError("--kernel and --variant go with --impl cuda");
  if (impl != "cpu") return UsageError("--impl must be cpu or cuda (when built with CUDA)");
  ThreadPool pool(static_cast<int>(threads));
  AttentionOptions attend_options{AttentionPath::kSimd, &pool};
  attend_options.chunk_tokens = chunk_tokens;

  // `sessions` problems in one call, each the same cache with its own
  // outputs: a decode step of that many sessions, as a Decode message makes.
  std::vector<float> batch_out(out.size() * sessions), batch_lse(lse.size() * sessions);
  auto attend = [&](const Cache& cache) {
    return [&] {
      std::vector<AttentionProblem> problems;
      for (long long i = 0; i < sessions; ++i) {
        problems.push_back(AttentionProblem{cache.buffer->descriptor(), queries,
                                            {batch_out.data() + i * out.size(), batch_lse.data() + i * lse.size()}});
        // --few-tokens: attended as a layer's sinks are (AttendFewCpu).
        problems.back().few_tokens = options.Has("few-tokens");
      }
      const absl::Status s =
          AttendCpu(AttentionBatch{problems.data(), static_cast<int64_t>(problems.size())}, params, attend_options);
      if (!s.ok()) error = std::string(s.message());
    };
  };
  // A call reads every session's cache: the same one `sessions` times (warm
  // in the CPU's caches when it is small). The streaming read is of one.
  const size_t read_bytes = compressed.bytes * static_cast<size_t>(sessions);
  const size_t f16_read_bytes = f16.bytes * static_cast<size_t>(sessions);
  const double tokens_read = static_cast<double>(tokens) * static_cast<double>(sessions);
  std::vector<uint64_t> stream((compressed.bytes + 7) / 8, 1);
  uint64_t sink = 0;
  // The call's multiply-adds: every query row of a kv head by every token it
  // sees (query i of n at position tokens - n + i), key and value.
  const double visible = static_cast<double>(n_queries) * static_cast<double>(tokens) -
                         static_cast<double>(n_queries) * static_cast<double>(n_queries - 1) / 2;
  const double multiply_adds = 2.0 * visible * static_cast<double>(q_heads) * static_cast<double>(head_dim) *
                               static_cast<double>(sessions);
  // The floor: those multiply-adds alone at the scan's step's peak rate, on
  // the same threads; none where the scan multiplies floats (SCALAR, f16, and
  // --few-tokens' AttendFewCpu).
  int per_step = 0;
  if (!options.Has("few-tokens")) MultiplyAddPeak(*k_codec, *v_codec, 0, &per_step);
  const int64_t steps_per_thread =
      per_step > 0 ? static_cast<int64_t>(multiply_adds / per_step / pool.size()) : 0;
  std::vector<int64_t> checksums(pool.size());
  // Compressed, f16, the streaming read and the floor take turns, so machine
  // noise hits them all alike.
  std::vector<std::pair<size_t, std::function<void()>>> ops = {
      {1, attend(compressed)}, {1, attend(f16)}, {stream.size() * 8, [&] { sink += StreamRead(pool, stream); }}};
  if (per_step > 0) {
    ops.push_back({1, [&] {
                     pool.ParallelFor(pool.size(), [&](int64_t part) {
                       int unused;
                       checksums[part] += MultiplyAddPeak(*k_codec, *v_codec, steps_per_thread, &unused);
                     });
                   }});
  }
  const std::vector<double> rates = InterleavedMedianRates(ops);
  for (int64_t c : checksums) sink += static_cast<uint64_t>(c);
  if (!error.empty()) {
    std::fprintf(stderr, "turbokv-bench: %s\n", error.c_str());
    return 1;
  }
  const double compressed_rate = rates[0], f16_rate = rates[1], stream_rate = rates[2];
  const double floor_us = per_step > 0 ? 1e6 / rates[3] : 0.0;

  const double us = 1e6 / compressed_rate, f16_us = 1e6 / f16_rate;
  const double cache_gb_per_s = read_bytes * compressed_rate / 1e9;
  const double stream_gb_per_s = stream_rate / 1e9;
  if (options.Has("json")) {
    char floor_json[32] = "null";  // no floor where the scan multiplies floats
    if (per_step > 0) std::snprintf(floor_json, sizeof(floor_json), "%.6g", floor_us);
    std::printf(
        "{\"k_codec\": \"%s\", \"v_codec\": \"%s\", \"tokens\": %lld, \"kv_heads\": %lld, "
        "\"q_heads\": %lld, \"head_dim\": %lld, \"queries\": %lld, \"threads\": %lld, "
        "\"sessions\": %lld, \"implementation\": \"simd:%s\", \"us_per_call\": %.6g, \"f16_us_per_call\": %.6g, "
        "\"cache_bytes\": %zu, \"f16_cache_bytes\": %zu, \"cache_gb_per_s\": %.6g, "
        "\"stream_read_gb_per_s\": %.6g, \"speedup_vs_f16\": %.6g, \"fraction_of_stream_read\": %.6g, "
        "\"multiply_adds\": %.0f, \"multiply_adds_per_step\": %d, \"multiply_add_floor_us\": %s}\n",
        CodecName(*k_codec), CodecName(*v_codec), tokens, kv_heads, q_heads, head_dim, n_queries,
        threads, sessions, ChosenSimdTarget(), us, f16_us, read_bytes, f16_read_bytes, cache_gb_per_s,
        stream_gb_per_s, f16_us / us, cache_gb_per_s / stream_gb_per_s, multiply_adds, per_step,
        floor_json);
    return sink == 42 ? 3 : 0;
  }
  std::printf("attend %s keys, %s values: %lld tokens, %lld kv heads, %lld q heads, d %lld, %lld "
              "quer%s, %lld session%s a call, %lld thread%s, simd:%s\n",
              CodecName(*k_codec), CodecName(*v_codec), tokens, kv_heads, q_heads, head_dim, n_queries,
              n_queries == 1 ? "y" : "ies", sessions, sessions == 1 ? "" : "s", threads, threads == 1 ? "" : "s",
              ChosenSimdTarget());
  std::printf("  compressed   %10.1f us/call  %8.1f M tokens/s  %6.1f GB/s of cache (%.1f MB)\n", us,
              tokens_read * compressed_rate / 1e6, cache_gb_per_s, read_bytes / 1e6);
  std::printf("  f16          %10.1f us/call  %8.1f M tokens/s  %6.1f GB/s of cache (%.1f MB)\n", f16_us,
              tokens_read * f16_rate / 1e6, f16_read_bytes * f16_rate / 1e9, f16_read_bytes / 1e6);
  std::printf("  speed-up over f16: %.2fx\n", f16_us / us);
  std::printf("  streaming read of %.1f MB: %.1f GB/s; the compressed cache is read at %.0f%% of it\n",
              compressed.bytes / 1e6, stream_gb_per_s, 100 * cache_gb_per_s / stream_gb_per_s);
  if (per_step > 0) {
    std::printf("  the scan's 16-bit multiply-adds alone (%.0f M, %d a step) at their peak rate on these %lld "
                "thread%s: %.1f us/call, %.0f%% of the compressed path's time\n",
                multiply_adds / 1e6, per_step, threads, threads == 1 ? "" : "s", floor_us, 100 * floor_us / us);
  }
  return sink == 42 ? 3 : 0;
}

}  // namespace turbokv::bench
