// turbokv-bench codec: fidelity and speed of one codec or all of them.
//
// Relative MSE on random unit vectors, the least-squares slope of <q, x_hat>
// against <q, x> for random q, stored bits per value (scales included), and
// encode / decode vectors per second: on one CPU thread, or, with --impl cuda,
// on GPU 0 (device buffers, CUDA events, next to a device-to-device copy of
// the same bytes).
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/cli.h"
#include "kernels/codec.h"
#include "kernels/cpu/cpu_codecs.h"
#ifdef TURBOKV_WITH_CUDA
#include "bench/cuda_codec_timing.h"
#include "kernels/cuda/cuda_codec.h"
#endif

namespace turbokv::bench {
namespace {

// One implementation of a codec as the benchmark sees it.
struct CodecUnderTest {
  std::string implementation;
  CodecLayout layout;
  // Host arrays in and out; an error message on failure.
  std::function<std::string(size_t, const float*, uint8_t*)> encode;
  std::function<std::string(size_t, const uint8_t*, float*)> decode;
  // Vectors per second, on a working set the implementation chooses, and a
  // note saying how it was timed. encode_with_stats_rate: encoding that also
  // measures its quantization error (EncodeStats, what turbokvd does); 0
  // where the implementation has none.
  std::function<std::string(double* encode_rate, double* encode_with_stats_rate, double* decode_rate, std::string* how)>
      speed;
};

std::string MakeCpuUnderTest(const CodecSpec& spec, CpuPath path, CodecUnderTest* out) {
  auto made = MakeCpuCodec(spec, path);
  if (!made.ok()) return std::string(made.status().message());
  std::shared_ptr<Codec> codec = *std::move(made);
  out->implementation = codec->implementation();
  out->layout = codec->layout();
  out->encode = [codec](size_t n, const float* x, uint8_t* codes) {
    codec->Encode(n, x, codes);
    return std::string();
  };
  out->decode = [codec](size_t n, const uint8_t* codes, float* x) {
    codec->Decode(n, codes, x);
    return std::string();
  };
  out->speed = [codec](double* encode_rate, double* encode_with_stats_rate, double* decode_rate, std::string* how) {
    // One thread, a working set that stays in cache: 4096 vectors.
    const size_t timed = 4096;
    const int d = codec->layout().head_dim;
    std::mt19937_64 rng(3);
    std::normal_distribution<float> normal;
    std::vector<float> x(timed * d), y(timed * d);
    for (float& v : x) v = normal(rng);
    std::vector<uint8_t> codes(timed * codec->code_size());
    EncodeStats stats;
    const std::vector<double> rates =
        InterleavedMedianRates({{timed, [&] { codec->Encode(timed, x.data(), codes.data()); }},
                                {timed, [&] { codec->Encode(timed, x.data(), codes.data(), &stats); }},
                                {timed, [&] { codec->Decode(timed, codes.data(), y.data()); }}},
                               5, 0.1);
    *encode_rate = rates[0];
    *encode_with_stats_rate = rates[1];
    *decode_rate = rates[2];
    *how = "one CPU thread, 4096 vectors in cache";
    return std::string();
  };
  return std::string();
}

#ifdef TURBOKV_WITH_CUDA
std::string MakeCudaUnderTest(const CodecSpec& spec, CodecUnderTest* out) {
  auto made = cuda::CudaCodec::Create(spec, 0);
  if (!made.ok()) return std::string(made.status().message());
  std::shared_ptr<cuda::CudaCodec> codec = *std::move(made);
  out->implementation = "cuda:0";
  out->layout = codec->layout();
  out->encode = [codec](size_t n, const float* x, uint8_t* codes) {
    return std::string(codec->Encode(n, x, codes).message());
  };
  out->decode = [codec](size_t n, const uint8_t* codes, float* x) {
    return std::string(codec->Decode(n, codes, x).message());
  };
  out->speed = [codec](double* encode_rate, double* encode_with_stats_rate, double* decode_rate, std::string* how) {
    auto timing = MeasureCudaCodec(*codec, 1 << 20);
    if (!timing.ok()) return std::string(timing.status().message());
    *encode_rate = timing->encode_vectors_per_s;
    *encode_with_stats_rate = 0;  // the CUDA encoders measure no error
    *decode_rate = timing->decode_vectors_per_s;
    *how = absl::StrFormat(
        "GPU 0, 1M vectors; encode moves %.0f GB/s, decode %.0f GB/s, device copy %.0f GB/s",
        timing->encode_gb_per_s, timing->decode_gb_per_s, timing->copy_gb_per_s);
    return std::string();
  };
  return std::string();
}
#endif

struct CodecResult {
  std::string implementation;
  double rel_mse = 0;
  double ip_slope = 0;
  double bits_per_value = 0;
  double encode_rate = 0;
  double encode_with_stats_rate = 0;
  double decode_rate = 0;
  std::string how;
};

// Fidelity on n random unit vectors (and n random queries), then speed.
std::string MeasureCodec(const CodecUnderTest& codec, size_t n, CodecResult* r) {
  const int d = codec.layout.head_dim;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(n * d), q(n * d);
  for (float& v : q) v = normal(rng);
  for (size_t v = 0; v < n; ++v) {
    double sq = 0;
    for (int i = 0; i < d; ++i) {
      x[v * d + i] = normal(rng);
      sq += double(x[v * d + i]) * x[v * d + i];
    }
    for (int i = 0; i < d; ++i) x[v * d + i] = static_cast<float>(x[v * d + i] / std::sqrt(sq));
  }
  std::vector<uint8_t> codes(n * codec.layout.code_size());
  std::vector<float> y(n * d);
  if (std::string e = codec.encode(n, x.data(), codes.data()); !e.empty()) return e;
  if (std::string e = codec.decode(n, codes.data(), y.data()); !e.empty()) return e;

  double err = 0, norm = 0;
  double sa = 0, sb = 0, saa = 0, sab = 0;
  for (size_t v = 0; v < n; ++v) {
    double a = 0, b = 0;
    for (int i = 0; i < d; ++i) {
      const double e = double(x[v * d + i]) - y[v * d + i];
      err += e * e;
      norm += double(x[v * d + i]) * x[v * d + i];
      a += double(q[v * d + i]) * x[v * d + i];
      b += double(q[v * d + i]) * y[v * d + i];
    }
    sa += a;
    sb += b;
    saa += a * a;
    sab += a * b;
  }
  r->implementation = codec.implementation;
  r->rel_mse = err / norm;
  r->ip_slope = (n * sab - sa * sb) / (n * saa - sa * sa);
  r->bits_per_value = codec.layout.bits_per_value();
  return codec.speed(&r->encode_rate, &r->encode_with_stats_rate, &r->decode_rate, &r->how);
}

}  // namespace

int RunCodec(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv, {"codec", "head-dim", "vectors", "impl", "target"}, {"json"}, &error)) {
    return UsageError(error);
  }
  if (options.Has("target")) {  // measure a lower Highway target on this CPU
    const absl::Status forced = ForceSimdTarget(options.Get("target", ""));
    if (!forced.ok()) return UsageError(std::string(forced.message()));
  }
  long long head_dim = 0, vectors = 0;
  if (!options.GetInt("head-dim", 128, &head_dim, &error) ||
      !options.GetInt("vectors", 100000, &vectors, &error)) {
    return UsageError(error);
  }
  if (head_dim > kMaxHeadDim) return UsageError("--head-dim is larger than " + std::to_string(kMaxHeadDim));
  const std::string name = options.Get("codec", "turbo3");
  std::vector<CodecKind> kinds;
  if (name == "all") {
    kinds = {CodecKind::kF16,    CodecKind::kQ8_0,   CodecKind::kQ4_0,
             CodecKind::kTurbo2, CodecKind::kTurbo3, CodecKind::kTurbo4};
  } else {
    const auto kind = ParseCodecKind(name);
    if (!kind.ok()) return UsageError(std::string(kind.status().message()));
    kinds = {*kind};
  }
  const std::string impl = options.Get("impl", "simd");
  const bool json = options.Has("json");
  const bool table = kinds.size() > 1 && !json;
  if (table) {
    std::printf("%zu random unit vectors, head_dim %lld\n\n", static_cast<size_t>(vectors), head_dim);
    std::printf("| codec  | bits/value | vs fp16 | relative MSE | inner-product slope | encode M vec/s | decode M vec/s | code path    |\n");
    std::printf("|--------|-----------:|--------:|-------------:|--------------------:|---------------:|---------------:|--------------|\n");
  }
  std::string how;
  for (CodecKind kind : kinds) {
    const CodecSpec spec{kind, static_cast<int>(head_dim), 0x5eed};
    CodecUnderTest codec;
    if (impl == "simd" || impl == "scalar") {
      error = MakeCpuUnderTest(spec, impl == "simd" ? CpuPath::kSimd : CpuPath::kScalar, &codec);
#ifdef TURBOKV_WITH_CUDA
    } else if (impl == "cuda") {
      error = MakeCudaUnderTest(spec, &codec);
#endif
    } else {
      return UsageError("--impl must be simd, scalar or cuda (when built with CUDA)");
    }
    CodecResult r;
    if (error.empty()) error = MeasureCodec(codec, static_cast<size_t>(vectors), &r);
    if (!error.empty()) {
      std::fprintf(stderr, "turbokv-bench: %s\n", error.c_str());
      return 1;
    }
    if (json) {
      std::printf(
          "{\"codec\": \"%s\", \"head_dim\": %lld, \"vectors\": %lld, \"implementation\": \"%s\", "
          "\"rel_mse\": %.6g, \"ip_slope\": %.6g, \"bits_per_value\": %.6g, "
          "\"encode_vectors_per_s\": %.6g, \"encode_with_stats_vectors_per_s\": %.6g, "
          "\"decode_vectors_per_s\": %.6g}\n",
          CodecName(kind), head_dim, vectors, r.implementation.c_str(), r.rel_mse, r.ip_slope,
          r.bits_per_value, r.encode_rate, r.encode_with_stats_rate, r.decode_rate);
    } else if (table) {
      std::printf("| %-6s | %10.3f | %6.2fx | %12.5f | %19.4f | %14.2f | %14.2f | %-12s |\n",
                  CodecName(kind), r.bits_per_value, 16.0 / r.bits_per_value, r.rel_mse, r.ip_slope,
                  r.encode_rate / 1e6, r.decode_rate / 1e6, r.implementation.c_str());
      how = r.how;
    } else {
      std::printf("codec %s, head_dim %lld, %lld random unit vectors, %s\n", CodecName(kind), head_dim,
                  vectors, r.implementation.c_str());
      std::printf("  relative MSE          %.5f\n", r.rel_mse);
      std::printf("  inner-product slope   %.4f\n", r.ip_slope);
      std::printf("  bits per value        %.3f  (%.2fx smaller than fp16)\n", r.bits_per_value,
                  16.0 / r.bits_per_value);
      std::printf("  encode                %.2f M vectors/s\n", r.encode_rate / 1e6);
      if (r.encode_with_stats_rate > 0) {
        std::printf("  encode + error stats  %.2f M vectors/s (what turbokvd runs)\n", r.encode_with_stats_rate / 1e6);
      }
      std::printf("  decode                %.2f M vectors/s\n", r.decode_rate / 1e6);
      std::printf("  timed on              %s\n", r.how.c_str());
    }
  }
  if (table) std::printf("\nspeed: %s\n", how.c_str());
  return 0;
}

}  // namespace turbokv::bench
