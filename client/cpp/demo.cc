#include "client/cpp/demo.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/half.h"

namespace turbokv {
namespace {

// Deterministic normal samples (xorshift64* + Box-Muller).
class Normal {
 public:
  explicit Normal(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (Next() >> 11) * 0x1.0p-53 + 0x1.0p-54, u2 = (Next() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(6.283185307179586 * u2));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t Next() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545F4914F6CDD1Dull;
  }
  uint64_t state_;
  float spare_ = 0;
  bool has_spare_ = false;
};

// Synthetic keys and values shaped like a model's: keys carry a per-head
// channel offset and a few outlier channels (x6), values a per-head shared
// direction plus per-token noise. The noise of token t of layer l is a slice
// of one table of normal samples at an offset hashed from (l, t), so any
// token can be made again, fast.
class Workload {
 public:
  explicit Workload(const DemoOptions& o) : o_(o), noise_(size_t{1} << 22) {
    Normal normal(o.seed);
    const size_t per_layer = static_cast<size_t>(o.kv_heads) * o.head_dim;
    key_offset_.resize(per_layer * o.layers);
    value_mean_.resize(per_layer * o.layers);
    for (float& x : key_offset_) x = 0.5f * normal();
    for (float& x : value_mean_) x = normal();
    for (float& x : noise_) x = normal();
  }

  // Token t of layer l: kv_heads x head_dim keys and values.
  void Token(int l, int64_t t, float* key, float* value) const {
    const size_t n = static_cast<size_t>(o_.kv_heads) * o_.head_dim;
    const float* key_noise = Slice(l, t, 1, n);
    const float* value_noise = Slice(l, t, 2, n);
    const float* offset = &key_offset_[l * n];
    const float* mean = &value_mean_[l * n];
    for (size_t i = 0; i < n; ++i) {
      key[i] = offset[i] + key_noise[i] * (i % o_.head_dim < 4 ? 6.0f : 1.0f);
      value[i] = mean[i] + value_noise[i];
    }
  }

  // A query for layer l at step s: q_heads x head_dim, leaning toward the
  // key of an earlier token so attention is peaked, as in a model.
  void Query(int l, int64_t s, int64_t visible, float* query) const {
    const size_t n = static_cast<size_t>(o_.kv_heads) * o_.head_dim;
    std::vector<float> key(n), value(n);
    const int group = o_.q_heads / o_.kv_heads;
    const float* noise = Slice(l, s, 3, static_cast<size_t>(o_.q_heads) * o_.head_dim);
    for (int h = 0; h < o_.q_heads; ++h) {
      const int64_t target = static_cast<int64_t>(Hash(l, s * 1000 + h, 4) % static_cast<uint64_t>(visible));
      Token(l, target, key.data(), value.data());
      const float* k = &key[static_cast<size_t>(h / group) * o_.head_dim];
      for (int i = 0; i < o_.head_dim; ++i) {
        query[h * o_.head_dim + i] = 0.25f * k[i] + noise[h * o_.head_dim + i];
      }
    }
  }

 private:
  uint64_t Hash(int l, int64_t t, uint64_t stream) const {
    uint64_t z = o_.seed ^ (static_cast<uint64_t>(l) << 48) ^ (static_cast<uint64_t>(t) << 8) ^ stream;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  const float* Slice(int l, int64_t t, uint64_t stream, size_t n) const {
    return &noise_[Hash(l, t, stream) % (noise_.size() - n)];
  }

  DemoOptions o_;
  std::vector<float> noise_;
  std::vector<float> key_offset_;
  std::vector<float> value_mean_;
};

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

// Softmax attention in double over the original vectors: the reference.
void ReferenceAttention(const DemoOptions& o, const std::vector<float>& keys, const std::vector<float>& values,
                        int64_t visible, const float* query, std::vector<double>* out) {
  const int group = o.q_heads / o.kv_heads;
  const size_t token_stride = static_cast<size_t>(o.kv_heads) * o.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  out->assign(static_cast<size_t>(o.q_heads) * o.head_dim, 0.0);
  std::vector<double> logits(visible);
  for (int h = 0; h < o.q_heads; ++h) {
    const size_t head = static_cast<size_t>(h / group) * o.head_dim;
    const float* q = query + static_cast<size_t>(h) * o.head_dim;
    double max = -INFINITY;
    for (int64_t t = 0; t < visible; ++t) {
      const float* k = &keys[t * token_stride + head];
      float dot = 0;
      for (int i = 0; i < o.head_dim; ++i) dot += q[i] * k[i];
      logits[t] = dot * scale;
      max = std::max(max, logits[t]);
    }
    double sum = 0;
    double* acc = &(*out)[static_cast<size_t>(h) * o.head_dim];
    for (int64_t t = 0; t < visible; ++t) {
      const double p = std::exp(logits[t] - max);
      sum += p;
      const float* v = &values[t * token_stride + head];
      for (int i = 0; i < o.head_dim; ++i) acc[i] += p * v[i];
    }
    for (int i = 0; i < o.head_dim; ++i) acc[i] /= sum;
  }
}

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

}  // namespace

absl::Status RunDemo(const Client& client, const DemoOptions& o) {
  if (absl::Status ready = client.WaitUntilServing(absl::Seconds(30)); !ready.ok()) return ready;
  absl::StatusOr<v1::StatsResponse> stats = client.Stats();
  if (!stats.ok()) return stats.status();
  std::fprintf(stderr, "demo: turbokvd on %s; session of %d layers x %d kv heads x d %d (%d q heads), %s keys, %s values\n",
               stats->device().c_str(), o.layers, o.kv_heads, o.head_dim, o.q_heads,
               v1::Codec_Name(o.key_codec).c_str(), v1::Codec_Name(o.value_codec).c_str());
  SessionOptions session_options;
  session_options.layers = o.layers;
  session_options.kv_heads = o.kv_heads;
  session_options.q_heads = o.q_heads;
  session_options.head_dim = o.head_dim;
  session_options.key_codec = o.key_codec;
  session_options.value_codec = o.value_codec;
  absl::StatusOr<Session> session = client.CreateSession(session_options);
  if (!session.ok()) return session.status();

  const Workload workload(o);
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
    std::vector<uint16_t> keys, values;
  };
  std::vector<Chunk> chunks;
  std::vector<float> keys, values;
  for (int64_t start = 0; start < o.tokens; start += o.chunk) {
    const int64_t n = std::min(o.chunk, o.tokens - start);
    keys.resize(static_cast<size_t>(o.layers) * n * token_values);
    values.resize(keys.size());
    for (int l = 0; l < o.layers; ++l) {
      for (int64_t t = 0; t < n; ++t) {
        const size_t at = (static_cast<size_t>(l) * n + t) * token_values;
        workload.Token(l, start + t, &keys[at], &values[at]);
      }
    }
    chunks.push_back(Chunk{start, ToHalf(keys), ToHalf(values)});
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
    absl::Status status = stream->Write(-1, chunk.start, TensorData::F16(chunk.keys), TensorData::F16(chunk.values));
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
      ReferenceAttention(o, kept_keys[c], kept_values[c], position + 1, query.data(), &reference);
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

  std::printf("\nturbokv demo: %d layers x %d kv heads x d %d, %d q heads, %s keys / %s values, synthetic model-shaped data\n",
              o.layers, o.kv_heads, o.head_dim, o.q_heads, v1::Codec_Name(o.key_codec).c_str(),
              v1::Codec_Name(o.value_codec).c_str());
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
