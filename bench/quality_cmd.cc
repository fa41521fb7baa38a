// turbokv-bench quality: what each codec preset costs in attention error and
// buys in bits, on model-shaped data (the demo's workload: per-channel key
// offsets, outlier channels, values around a shared direction, queries that
// lean toward an earlier key), against float attention over the original
// vectors.
//
// The workload's layers are alike in distribution, so each pair of key and
// value codecs is measured on the first --sample-layers layers and a preset's
// error is the mean of its layers' pairs, weighted by how many layers take
// each (its boundary layers and the rest).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/cli.h"
#include "client/cpp/workload.h"
#include "kernels/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/paged_cache.h"
#include "kernels/rotation.h"
#include "service/store/presets.h"

namespace turbokv::bench {
namespace {

using CodecPair = std::pair<CodecKind, CodecKind>;

struct Row {
  std::string name;
  SessionConfig config;
};

// The presets, then single-codec sessions for comparison.
std::vector<Row> Rows(int layers, int head_dim) {
  std::vector<Row> rows;
  SessionConfig base;
  base.layers = layers;
  base.head_dim = head_dim;
  for (const Preset& preset : Presets()) {
    Row row{preset.name, base};
    ApplyPreset(preset.name, "preset", &row.config).IgnoreError();
    rows.push_back(row);
  }
  for (CodecKind kind : {CodecKind::kTurbo3, CodecKind::kTurbo4, CodecKind::kQ4_0, CodecKind::kQ8_0, CodecKind::kF16}) {
    Row row{std::string(CodecName(kind)) + " everywhere", base};
    row.config.key_codec = row.config.value_codec = kind;
    rows.push_back(row);
  }
  return rows;
}

// Mean relative L2 error of the attention outputs (one per query and query
// head) of `pair` over `tokens` tokens of each sample layer.
struct Measured {
  std::map<CodecPair, double> error;
};

Measured Measure(const WorkloadShape& shape, const std::vector<CodecPair>& pairs, int64_t tokens, int queries,
                 int sample_layers, ThreadPool& pool) {
  const Workload workload(shape);
  const size_t token_values = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  const size_t out_values = static_cast<size_t>(shape.q_heads) * shape.head_dim;
  std::map<CodecPair, double> sums;
  int64_t count = 0;
  for (int l = 0; l < sample_layers; ++l) {
    std::vector<float> keys(static_cast<size_t>(tokens) * token_values), values(keys.size());
    for (int64_t t = 0; t < tokens; ++t) workload.Token(l, t, &keys[t * token_values], &values[t * token_values]);
    std::vector<float> q(static_cast<size_t>(queries) * out_values);
    std::vector<std::vector<double>> reference(queries);
    for (int i = 0; i < queries; ++i) {
      workload.Query(l, tokens + i, tokens, &q[i * out_values]);
      ReferenceAttention(shape, keys, values, tokens, &q[i * out_values], &reference[i]);
    }
    const std::vector<int64_t> positions(queries, tokens - 1);
    for (const CodecPair& pair : pairs) {
      auto cache = PagedCacheBuffer::Create(
          CodecSpec{pair.first, shape.head_dim, DeriveRotationSeed(shape.seed, RotationStream::kKeys)},
          CodecSpec{pair.second, shape.head_dim, DeriveRotationSeed(shape.seed, RotationStream::kValues)},
          shape.kv_heads, 64);
      if (!cache.ok()) {
        std::fprintf(stderr, "quality: %s/%s: %s\n", CodecName(pair.first), CodecName(pair.second),
                     std::string(cache.status().message()).c_str());
        std::exit(1);
      }
      (*cache)->Append(tokens, keys.data(), values.data());
      std::vector<float> out(q.size()), lse(static_cast<size_t>(queries) * shape.q_heads);
      AttentionParams params;
      params.q_heads = shape.q_heads;
      const absl::Status status = AttendCpu((*cache)->descriptor(), params, AttentionQueries{queries, q.data(), positions.data()},
                                            AttentionOutput{out.data(), lse.data()}, AttentionOptions{AttentionPath::kSimd, &pool});
      if (!status.ok()) {
        std::fprintf(stderr, "quality: attention: %s\n", std::string(status.message()).c_str());
        std::exit(1);
      }
      for (int i = 0; i < queries; ++i) {
        for (int h = 0; h < shape.q_heads; ++h) {
          double diff = 0, norm = 0;
          for (int x = 0; x < shape.head_dim; ++x) {
            const size_t at = static_cast<size_t>(h) * shape.head_dim + x;
            const double d = out[i * out_values + at] - reference[i][at];
            diff += d * d;
            norm += reference[i][at] * reference[i][at];
          }
          sums[pair] += std::sqrt(diff / norm);
        }
      }
    }
    count += static_cast<int64_t>(queries) * shape.q_heads;
  }
  Measured measured;
  for (const auto& [pair, sum] : sums) measured.error[pair] = sum / count;
  return measured;
}

double SessionError(const SessionConfig& config, const Measured& measured) {
  double sum = 0;
  for (int l = 0; l < config.layers; ++l) sum += measured.error.at({config.KeyCodec(l), config.ValueCodec(l)});
  return sum / config.layers;
}

std::string Describe(const SessionConfig& config) {
  std::string text = std::string(CodecName(config.key_codec)) + "/" + CodecName(config.value_codec);
  for (const LayerCodecRange& range : config.layer_codecs) {
    text += ", layers " + std::to_string(range.first) + "-" + std::to_string(range.last) + " " +
            CodecName(range.key) + "/" + CodecName(range.value);
  }
  return text;
}

}  // namespace

int RunQuality(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv,
                     {"layers", "kv-heads", "q-heads", "head-dim", "tokens", "queries", "sample-layers", "threads",
                      "max-bits"},
                     {"json"}, &error)) {
    return UsageError(error);
  }
  long long layers, kv_heads, q_heads, head_dim, queries, sample_layers, threads;
  if (!options.GetInt("layers", 32, &layers, &error) || !options.GetInt("kv-heads", 8, &kv_heads, &error) ||
      !options.GetInt("q-heads", 32, &q_heads, &error) || !options.GetInt("head-dim", 128, &head_dim, &error) ||
      !options.GetInt("queries", 4, &queries, &error) || !options.GetInt("sample-layers", 2, &sample_layers, &error) ||
      !options.GetInt("threads", 2, &threads, &error)) {
    return UsageError(error);
  }
  if (q_heads % kv_heads != 0) return UsageError("--q-heads must be a multiple of --kv-heads");
  if (sample_layers > layers) return UsageError("--sample-layers must be at most --layers");
  if (kv_heads > 1024 || q_heads > 1024) return UsageError("--kv-heads and --q-heads must be at most 1024");
  for (CodecKind kind : {CodecKind::kTurbo2, CodecKind::kQ8_0}) {
    const absl::StatusOr<CodecLayout> layout = CheckCodecSpec(CodecSpec{kind, static_cast<int>(head_dim), 0});
    if (!layout.ok()) return UsageError("--head-dim: " + std::string(layout.status().message()));
  }
  std::vector<int64_t> token_counts;
  for (absl::string_view part : absl::StrSplit(options.Get("tokens", "4096,32768"), ',')) {
    int64_t t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 1) return UsageError("--tokens must be positive counts, comma-separated");
    token_counts.push_back(t);
  }
  double max_bits = 0;
  if (!absl::SimpleAtod(options.Get("max-bits", "3.7"), &max_bits) || max_bits <= 0) {
    return UsageError("--max-bits must be a positive number");
  }
  const WorkloadShape shape{static_cast<int>(layers), static_cast<int>(kv_heads), static_cast<int>(q_heads),
                            static_cast<int>(head_dim), 1};
  const std::vector<Row> rows = Rows(shape.layers, shape.head_dim);
  std::vector<CodecPair> pairs;
  for (const Row& row : rows) {
    for (int l = 0; l < shape.layers; ++l) {
      const CodecPair pair{row.config.KeyCodec(l), row.config.ValueCodec(l)};
      if (std::find(pairs.begin(), pairs.end(), pair) == pairs.end()) pairs.push_back(pair);
    }
  }
  ThreadPool pool(static_cast<int>(threads));
  std::fprintf(stderr,
               "quality: %d layers x %d kv heads (%d q heads), d %d; %zu codec pairs on %lld sample layer(s), %lld "
               "queries each\n",
               shape.layers, shape.kv_heads, shape.q_heads, shape.head_dim, pairs.size(), sample_layers, queries);
  std::vector<Measured> measured;
  for (int64_t tokens : token_counts) {
    std::fprintf(stderr, "quality: measuring at %lld tokens\n", static_cast<long long>(tokens));
    measured.push_back(Measure(shape, pairs, tokens, static_cast<int>(queries), static_cast<int>(sample_layers), pool));
  }
  const bool json = options.Has("json");
  if (!json) {
    std::printf("| preset | codecs (keys/values) | bits/value |");
    for (int64_t tokens : token_counts) std::printf(" error at %lld tokens |", static_cast<long long>(tokens));
    std::printf("\n|---|---|---:|");
    for (size_t i = 0; i < token_counts.size(); ++i) std::printf("---:|");
    std::printf("\n");
  }
  std::string best;
  double best_error = INFINITY;
  for (const Row& row : rows) {
    const double bits = BitsPerValue(row.config);
    double mean = 0;
    std::string errors;
    for (size_t i = 0; i < measured.size(); ++i) {
      const double e = SessionError(row.config, measured[i]);
      mean += e / measured.size();
      errors += json ? absl::StrFormat("%s\"%d\": %.6g", i == 0 ? "" : ", ", token_counts[i], e)
                     : absl::StrFormat(" %.2e |", e);
    }
    if (json) {
      std::printf("{\"row\": \"%s\", \"codecs\": \"%s\", \"bits_per_value\": %.4f, \"error\": {%s}}\n",
                  row.name.c_str(), Describe(row.config).c_str(), bits, errors.c_str());
    } else {
      std::printf("| %s | %s | %.2f |%s\n", row.name.c_str(), Describe(row.config).c_str(), bits, errors.c_str());
    }
    if (!row.config.preset.empty() && bits <= max_bits && mean < best_error) {
      best_error = mean;
      best = row.name;
    }
  }
  if (json) {
    std::printf("{\"lowest_error_at_or_below_bits\": %.2f, \"bits_per_value\": null, \"preset\": \"%s\"}\n", max_bits,
                best.c_str());
  } else {
    std::printf("\nlowest mean error at or below %.2f bits/value: %s\n", max_bits, best.empty() ? "(none)" : best.c_str());
  }
  return 0;
}

}  // namespace turbokv::bench
