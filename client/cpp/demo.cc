#include "client/cpp/demo.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/cpp/workload.h"
#include "kernels/half.h"

namespace turbokv {
namespace {

// Progress on one line when stderr is a terminal, else a line per quarter.
class Progress {
 public:
  explicit Progress(const char* what) : what_(what), tty_(isatty(fileno(stderr))) {}
  void Update(int64_t done, int64_t total, const std::string& extra) {
    if (tty_) {
      std::fprintf(stderr, "\rdemo: %s %lld / %lld %s   ", what_, static_cast<long long>(done),
                   static_cast<long long>(total), extra.c_str());
      if (done == total) std::fprintf(stderr, "\n");
    } else if (done * 4 / total > quarter_ || done == total) {
      quarter_ = done * 4 / total;
      std::fprintf(stderr, "demo: %s %lld / %lld %s\n", what_, static_cast<long long>(done),
                   static_cast<long long>(total), extra.c_str());
    }
  }

 private:
  const char* what_;
  bool tty_;
  int64_t quarter_ = 0;
};

double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  return samples[static_cast<size_t>(std::min<double>(samples.size() - 1, p * samples.size()))];
}

std::vector<uint16_t> ToHalf(const std::vector<float>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = FloatToHalfBits(values[i]);
  return bits;
}

void FromHalf(const uint16_t* bits, size_t n, float* values) {
  for (size_t i = 0; i < n; ++i) values[i] = HalfBitsToFloat(bits[i]);
}

// "preset k4v4 (CODEC_TURBO4 keys / CODEC_TURBO4 values, ...)": what the
// session stores, as the daemon configured it.
std::string CodecsText(const v1::SessionConfig& config) {
  std::string text = absl::StrCat(config.preset().empty() ? "" : absl::StrCat("preset ", config.preset(), " ("),
                                  v1::Codec_Name(config.key_codec()), " keys / ", v1::Codec_Name(config.value_codec()),
                                  " values");
  if (config.layer_codecs_size() > 0) absl::StrAppend(&text, ", ", config.layer_codecs_size(), " layer ranges apart");
  absl::StrAppend(&text, ", ", v1::KeyTransform_Name(config.key_transform()), ", ", config.sink_tokens(),
                  " sink tokens");
  return config.preset().empty() ? text : absl::StrCat(text, ")");
}

}  // namespace

absl::Status RunDemo(const Client& client, const DemoOptions& o) {
  if (absl::Status ready = client.WaitUntilServing(absl::Seconds(30)); !ready.ok()) return ready;
  absl::StatusOr<v1::StatsResponse> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  SessionOptions session_options;
  session_options.layers = o.layers;
  session_options.kv_heads = o.kv_heads;
  session_options.q_heads = o.q_heads;
  session_options.head_dim = o.head_dim;
  session_options.key_codec = o.key_codec;
  session_options.value_codec = o.value_codec;
  session_options.preset = o.preset;
  absl::StatusOr<Session> session = client.CreateSession(session_options);
  if (!session.ok()) return session.status();
  const std::string codecs = CodecsText(session->config());
  std::fprintf(stderr, "demo: turbokvd on %s; session of %d layers x %d kv heads x d %d (%d q heads), %s\n",
               stats->device().c_str(), o.layers, o.kv_heads, o.head_dim, o.q_heads, codecs.c_str());

  const WorkloadShape shape{o.layers, o.kv_heads, o.q_heads, o.head_dim, o.seed};
  const Workload workload(shape);
  const size_t token_values = static_cast<size_t>(o.kv_heads) * o.head_dim;
  const int64_t total = o.tokens + o.steps;
  // Originals of the checked layers (as fp16 rounds them), for the reference.
  std::vector<int> checked;
  for (int i = 0; i < o.checked_layers && i < o.layers; ++i) {
    checked.push_back(o.checked_layers == 1 ? 0 : i * (o.layers - 1) / (o.checked_layers - 1));
  }
  std::vector<std::vector<float>> kept_keys(checked.size()), kept_values(checked.size());
  for (size_t c = 0; c < checked.size(); ++c) {
    kept_keys[c].resize(total * token_values);
    kept_values[c].resize(total * token_values);
  }

  // The prefill's messages are made first (fp16, every layer's chunk in one
  // message), so that the timed part measures the service, not this
  // generator.
  Progress generate_progress("generating fp16 prefill data, tokens"), prefill_progress("prefill, tokens"),
      step_progress("decode step");
  struct Chunk {
    int64_t start;
    std::vector<uint16_t> keys, values, queries;
  };
  std::vector<Chunk> chunks;
  std::vector<float> keys, values, queries;
  const size_t query_values = static_cast<size_t>(o.q_heads) * o.head_dim;
  for (int64_t start = 0; start < o.tokens; start += o.chunk) {
    const int64_t n = std::min(o.chunk, o.tokens - start);
    keys.resize(static_cast<size_t>(o.layers) * n * token_values);
    values.resize(keys.size());
    // The first chunk carries its tokens' queries: it fits each layer's key
    // transform (docs/API.md "Keys made safe").
    queries.assign(start == 0 ? static_cast<size_t>(o.layers) * n * query_values : 0, 0.0f);
    for (int l = 0; l < o.layers; ++l) {
      for (int64_t t = 0; t < n; ++t) {
        const size_t at = (static_cast<size_t>(l) * n + t) * token_values;
        workload.Token(l, start + t, &keys[at], &values[at]);
        if (start == 0) workload.Query(l, t, t + 1, &queries[(static_cast<size_t>(l) * n + t) * query_values]);
      }
    }
    chunks.push_back(Chunk{start, ToHalf(keys), ToHalf(values), ToHalf(queries)});
    // The reference sees what the daemon gets: the fp16 values.
    for (size_t c = 0; c < checked.size(); ++c) {
      const size_t at = static_cast<size_t>(checked[c]) * n * token_values;
      FromHalf(&chunks.back().keys[at], n * token_values, &kept_keys[c][start * token_values]);
      FromHalf(&chunks.back().values[at], n * token_values, &kept_values[c][start * token_values]);
    }
    generate_progress.Update(start + n, o.tokens, "");
  }

  // Prefill, pipelined: messages are sent without waiting for their
  // acknowledgements.
  const absl::Time prefill_start = absl::Now();
  std::unique_ptr<AppendStream> stream = session->OpenAppendStream();
  for (const Chunk& chunk : chunks) {
    absl::Status status = stream->Write(-1, chunk.start, TensorData::F16(chunk.keys), TensorData::F16(chunk.values),
                                        TensorData::F16(chunk.queries));
    if (!status.ok()) break;  // Finish says why
    const int64_t done = chunk.start + static_cast<int64_t>(chunk.keys.size() / (o.layers * token_values));
    const double seconds = absl::ToDoubleSeconds(absl::Now() - prefill_start);
    prefill_progress.Update(done, o.tokens, absl::StrFormat("(%.0f tokens/s)", done / seconds));
  }
  absl::StatusOr<v1::AppendResponse> last = stream->Finish();
  if (!last.ok()) return last.status();
  const double prefill_seconds = absl::ToDoubleSeconds(absl::Now() - prefill_start);
  chunks.clear();

  // Decode steps: each appends one token to every layer and attends with its query.
  std::vector<double> step_us, rel_l2, cosine;
  std::vector<float> key(token_values), value(token_values), query(static_cast<size_t>(o.q_heads) * o.head_dim);
  std::vector<double> reference;
  for (int s = 0; s < o.steps; ++s) {
    const int64_t position = o.tokens + s;
    for (int l = 0; l < o.layers; ++l) {
      workload.Token(l, position, key.data(), value.data());
      workload.Query(l, s, position + 1, query.data());
      const absl::Time begin = absl::Now();
      absl::StatusOr<StepResult> step = session->Step(l, position, TensorData::F32(key), TensorData::F32(value),
                                                      TensorData::F32(query));
      step_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - begin));
      if (!step.ok()) return step.status();
      const auto c = std::find(checked.begin(), checked.end(), l) - checked.begin();
      if (c == static_cast<long>(checked.size())) continue;
      std::copy(key.begin(), key.end(), &kept_keys[c][position * token_values]);
      std::copy(value.begin(), value.end(), &kept_values[c][position * token_values]);
      ReferenceAttention(shape, kept_keys[c], kept_values[c], position + 1, query.data(), &reference);
      for (int h = 0; h < o.q_heads; ++h) {
        double err = 0, ref = 0, got = 0, dot = 0;
        for (int i = 0; i < o.head_dim; ++i) {
          const double r = reference[h * o.head_dim + i], g = step->attention.output[h * o.head_dim + i];
          err += (g - r) * (g - r);
          ref += r * r;
          got += g * g;
          dot += g * r;
        }
        rel_l2.push_back(std::sqrt(err / ref));
        cosine.push_back(dot / std::sqrt(ref * got));
      }
    }
    step_progress.Update(s + 1, o.steps, absl::StrCat("(", o.layers, " layers each)"));
  }

  // Attend: one query per call over the whole context of layer 0.
  std::vector<double> attend_us;
  for (int i = 0; i < o.attend_calls; ++i) {
    workload.Query(0, o.steps + i, total, query.data());
    const absl::Time begin = absl::Now();
    absl::StatusOr<Attention> attention = session->Attend(0, TensorData::F32(query));
    attend_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - begin));
    if (!attention.ok()) return attention.status();
  }

  absl::StatusOr<v1::SessionInfo> info = session->Info();
  if (!info.ok()) return info.status();
  double mean_l2 = 0, mean_cos = 0;
  for (double x : rel_l2) mean_l2 += x / rel_l2.size();
  for (double x : cosine) mean_cos += x / cosine.size();
  const double fp16_mb = info->fp16_bytes() / 1e6, stored_mb = info->bytes_used() / 1e6;
  const double input_mb = static_cast<double>(o.tokens) * o.layers * token_values * 2 * 2 / 1e6;

  std::printf("\nturbokv demo: %d layers x %d kv heads x d %d, %d q heads, %s, synthetic model-shaped data\n",
              o.layers, o.kv_heads, o.head_dim, o.q_heads, codecs.c_str());
  std::printf("  %-34s %s\n", "tokens per layer", absl::StrCat(info->layer_tokens(0)).c_str());
  std::printf("  %-34s %.1f MB (fp16 would be %.1f MB)\n", "bytes stored", stored_mb, fp16_mb);
  std::printf("  %-34s %.2fx\n", "compression vs fp16", fp16_mb / stored_mb);
  const double max_l2 = rel_l2.empty() ? 0 : *std::max_element(rel_l2.begin(), rel_l2.end());
  const double min_cos = cosine.empty() ? 0 : *std::min_element(cosine.begin(), cosine.end());
  std::printf("  %-34s rel L2 %.4f (max %.4f), cosine %.5f (min %.5f)\n", "attention error vs float reference",
              mean_l2, max_l2, mean_cos, min_cos);
  std::printf("  %-34s %zu outputs (%zu layers x %d steps x %d q heads)\n", "  compared", rel_l2.size(), checked.size(),
              o.steps, o.q_heads);
  std::printf("  %-34s %.0f tokens/s, %.0f MB/s of fp16 input\n", "append (prefill, all layers)",
              o.tokens / prefill_seconds, input_mb / prefill_seconds);
  std::printf("  %-34s p50 %.0f us, p99 %.0f us (%zu calls)\n", "step latency (append 1 + attend)",
              Percentile(step_us, 0.5), Percentile(step_us, 0.99), step_us.size());
  std::printf("  %-34s p50 %.0f us, p99 %.0f us (%zu calls)\n", "attend latency (1 query, 1 layer)",
              Percentile(attend_us, 0.5), Percentile(attend_us, 0.99), attend_us.size());
  return session->Delete();
}

}  // namespace turbokv
