// turbokv-bench e2e: the service over a unix socket, next to what it is built
// from, measured in one run: append throughput, Step and Attend latency, the
// daemon's attention backend called in process on the same stored layer (the
// kernels alone on the CPU; on a GPU, with their copies in and out), and an
// empty gRPC round trip (a health check) on the same channel. With --batch B:
// one decode step over every layer for B sessions through a Decode stream,
// the same work as B x L unary Step calls, and the backend alone on the same
// batches, interleaved. --device cpu (default) or cuda:N (--cuda-attention
// as turbokvd's flag). With --spill: the disk tier (RunSpill); with
// --redis-url too, the disk stacked over that Redis (a redis-server you run).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/cli.h"
#include "bench/prefill.h"
#include "client/cpp/client.h"
#include "kernels/attention.h"
#include "service/handler/handler.h"
#include "service/server.h"
#include "service/store/session_store.h"
#include "service/tensor.h"

namespace turbokv::bench {
namespace {

using Clock = std::chrono::steady_clock;

// --batch B: (a) Decode stream, (b) B x L unary Steps, (c) the attention backend alone,
// (d) the handler's Decode in process (no gRPC, no client), (e) the Decode
// stream with its tensors in the messages (a client without shared memory),
// one whole decode step (every layer) of each in turn.
int RunBatch(const Shape& shape, long long batch, long long steps, Client& client, Server& server,
             const SessionOptions& session_options, bool json) {
  const size_t token_values = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  constexpr size_t kSlack = size_t{1} << 20;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  const std::vector<uint16_t> pool = Fp16Pool(shape, kSlack, &rng);
  std::vector<Session> sessions;
  std::vector<std::string> ids;
  double prefill_seconds = 0;
  for (long long i = 0; i < batch; ++i) {
    absl::StatusOr<Session> session = client.CreateSession(session_options);
    if (!session.ok()) {
      std::fprintf(stderr, "turbokv-bench e2e: %s\n", std::string(session.status().message()).c_str());
      return 1;
    }
    const double seconds = Prefill(*session, shape, pool, kSlack, static_cast<uint64_t>(i));
    if (seconds < 0) return 1;
    prefill_seconds += seconds;
    ids.push_back(session->id());
    sessions.push_back(*std::move(session));
  }
  // The stored sessions, in id order (the order the daemon locks them in).
  std::vector<std::shared_ptr<SessionCache>> stored;
  for (const std::string& id : ids) stored.push_back(*server.store().Find(id, "", absl::Now()));
  std::sort(stored.begin(), stored.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });

  const size_t q_values = static_cast<size_t>(shape.q_heads) * shape.head_dim;
  std::vector<float> keys(batch * token_values), values(keys.size()), queries(batch * q_values);
  auto draw = [&] {
    for (float& x : keys) x = normal(rng);
    for (float& x : values) x = normal(rng);
    for (float& x : queries) x = normal(rng);
  };
  ClientOptions in_messages;
  in_messages.shared_memory_bytes = 0;
  const std::unique_ptr<Client> bytes_client = Client::Connect(server.endpoints()[0], in_messages);
  std::unique_ptr<DecodeStream> decode = client.OpenDecodeStream();
  std::unique_ptr<DecodeStream> decode_bytes = bytes_client->OpenDecodeStream();
  std::vector<double> decode_us, unary_us, kernel_us, handler_us, bytes_us;  // per layer-step
  int64_t position = shape.tokens;
  for (long long step = 0; step < steps; ++step) {
    // (a) one Decode message per layer, each answered before the next (the
    // next layer's query depends on this one's output); (e) the same through
    // the client that sends its tensors in the messages.
    for (DecodeStream* stream : {decode.get(), decode_bytes.get()}) {
      std::vector<double>& took = stream == decode.get() ? decode_us : bytes_us;
      for (long long l = 0; l < shape.layers; ++l, draw()) {
        DecodeBatch message;
        message.layer = static_cast<int>(l);
        message.session_ids = ids;
        message.positions.assign(batch, position);
        message.q_heads = static_cast<int>(shape.q_heads);
        message.kv_heads = static_cast<int>(shape.kv_heads);
        message.head_dim = static_cast<int>(shape.head_dim);
        message.queries = TensorData::F32(queries);
        message.keys = TensorData::F32(keys);
        message.values = TensorData::F32(values);
        const auto start = Clock::now();
        absl::StatusOr<DecodeResult> result = stream->Step(message);
        took.push_back(Micros(start));
        if (!result.ok() || result->failed != 0) {
          std::fprintf(stderr, "turbokv-bench e2e: decode: %s\n",
                       std::string(result.ok() ? result->status[0].message() : result.status().message()).c_str());
          return 1;
        }
      }
      ++position;
    }
    // (b) the same work as B x L unary Step calls from one thread.
    for (long long l = 0; l < shape.layers; ++l, draw()) {
      const auto start = Clock::now();
      for (long long i = 0; i < batch; ++i) {
        absl::StatusOr<StepResult> result = sessions[i].Step(
            static_cast<int>(l), position, TensorData::F32(absl::MakeSpan(keys).subspan(i * token_values, token_values)),
            TensorData::F32(absl::MakeSpan(values).subspan(i * token_values, token_values)),
            TensorData::F32(absl::MakeSpan(queries).subspan(i * q_values, q_values)));
        if (!result.ok()) {
          std::fprintf(stderr, "turbokv-bench e2e: step: %s\n", std::string(result.status().message()).c_str());
          return 1;
        }
      }
      unary_us.push_back(Micros(start));
    }
    ++position;
    // (d) the same messages straight into the handler: what the service adds
    // around the kernels without the transport.
    for (long long l = 0; l < shape.layers; ++l, draw()) {
      v1::DecodeRequest request;
      request.set_layer(static_cast<int>(l));
      for (const std::string& id : ids) request.add_session_ids(id);
      for (long long i = 0; i < batch; ++i) request.add_positions(position);
      FloatsToTensor(queries, {batch, shape.q_heads, shape.head_dim}, v1::DTYPE_F32, request.mutable_queries());
      FloatsToTensor(keys, {batch, shape.kv_heads, shape.head_dim}, v1::DTYPE_F32, request.mutable_keys());
      FloatsToTensor(values, {batch, shape.kv_heads, shape.head_dim}, v1::DTYPE_F32, request.mutable_values());
      const auto start = Clock::now();
      absl::StatusOr<v1::DecodeResponse> result = server.handler().Decode(request, "");
      handler_us.push_back(Micros(start));
      if (!result.ok() || result->failed() != 0) {
        std::fprintf(stderr, "turbokv-bench e2e: handler decode failed\n");
        return 1;
      }
    }
    ++position;
    // (c) the attention backend alone: each layer's attention for the B
    // sessions as one batch, in process, on as many threads; each problem as
    // the handler builds it (pages, key transform and sink tokens).
    std::vector<float> out(batch * q_values), lse(batch * shape.q_heads);
    std::vector<int64_t> last(batch);
    for (long long l = 0; l < shape.layers; ++l) {
      std::vector<std::unique_lock<std::mutex>> locks;
      std::vector<AttentionProblem> problems;
      for (long long i = 0; i < batch; ++i) {
        locks.emplace_back(stored[i]->mutex());
        const LayerCache& layer = stored[i]->layers()[l];
        last[i] = layer.Descriptor().tokens - 1;
        problems.push_back(layer.Attention({1, queries.data() + i * q_values, &last[i]},
                                           {out.data() + i * q_values, lse.data() + i * shape.q_heads}));
      }
      AttentionParams params;
      params.q_heads = static_cast<int>(shape.q_heads);
      const auto start = Clock::now();
      const absl::Status status = server.store().backend().Attend(
          AttentionBatch{problems.data(), static_cast<int64_t>(problems.size())}, params);
      kernel_us.push_back(Micros(start));
      if (!status.ok()) return 1;
    }
  }
  if (!decode->Finish().ok() || !decode_bytes->Finish().ok()) return 1;
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return sum / v.size();
  };
  // Tokens per second: B tokens per whole step of L layer-steps.
  auto tokens_per_s = [&](const std::vector<double>& v) { return batch * 1e6 / (mean(v) * shape.layers); };
  const double decode_p50 = Percentile(decode_us, 0.5), unary_p50 = Percentile(unary_us, 0.5),
               kernel_p50 = Percentile(kernel_us, 0.5), handler_p50 = Percentile(handler_us, 0.5),
               bytes_p50 = Percentile(bytes_us, 0.5);
  const double speedup = unary_p50 / decode_p50;
  const double overhead = (decode_p50 - kernel_p50) / decode_p50;
  if (json) {
    std::printf(
        "{\"batch\": %lld, \"tokens\": %lld, \"layers\": %lld, \"kv_heads\": %lld, \"q_heads\": %lld, "
        "\"head_dim\": %lld, \"codec\": \"%s\", \"threads\": %lld, \"steps\": %lld, \"prefill_s\": %.2f, "
        "\"decode_layer_step_p50_us\": %.1f, \"decode_layer_step_p99_us\": %.1f, \"decode_tokens_per_s\": %.1f, "
        "\"unary_layer_step_p50_us\": %.1f, \"unary_layer_step_p99_us\": %.1f, \"unary_tokens_per_s\": %.1f, "
        "\"kernel_layer_step_p50_us\": %.1f, \"kernel_layer_step_p99_us\": %.1f, \"kernel_tokens_per_s\": %.1f, "
        "\"handler_layer_step_p50_us\": %.1f, \"handler_layer_step_p99_us\": %.1f, "
        "\"decode_in_messages_layer_step_p50_us\": %.1f, \"decode_in_messages_layer_step_p99_us\": %.1f, "
        "\"decode_speedup_over_unary\": %.2f, \"service_overhead\": %.3f}\n",
        batch, shape.tokens, shape.layers, shape.kv_heads, shape.q_heads, shape.head_dim,
        v1::Codec_Name(session_options.key_codec).c_str(), shape.threads, steps, prefill_seconds, decode_p50,
        Percentile(decode_us, 0.99), tokens_per_s(decode_us), unary_p50, Percentile(unary_us, 0.99),
        tokens_per_s(unary_us), kernel_p50, Percentile(kernel_us, 0.99), tokens_per_s(kernel_us), handler_p50,
        Percentile(handler_us, 0.99), bytes_p50, Percentile(bytes_us, 0.99), speedup, overhead);
    return 0;
  }
  std::printf("turbokvd over a unix socket: %lld sessions x %lld tokens, %lld layers, %s keys and values, %lld kv heads, "
              "%lld q heads, d %lld, %lld threads, %lld steps, %s\n\n",
              batch, shape.tokens, shape.layers, v1::Codec_Name(session_options.key_codec).c_str(), shape.kv_heads,
              shape.q_heads, shape.head_dim, shape.threads, steps, server.device().c_str());
  std::printf("| path (one layer-step = %lld sessions, 1 token each) | p50 | p99 | tokens/s |\n|---|---:|---:|---:|\n",
              batch);
  std::printf("| (a) Decode stream, one message per layer | %.0f us | %.0f us | %.0f |\n", decode_p50,
              Percentile(decode_us, 0.99), tokens_per_s(decode_us));
  std::printf("| (b) %lld unary Step calls per layer, one thread | %.0f us | %.0f us | %.0f |\n", batch, unary_p50,
              Percentile(unary_us, 0.99), tokens_per_s(unary_us));
  std::printf("| (c) the attention backend alone, same batch | %.0f us | %.0f us | %.0f |\n", kernel_p50,
              Percentile(kernel_us, 0.99), tokens_per_s(kernel_us));
  std::printf("| (d) the handler's Decode in process, same messages | %.0f us | %.0f us | %.0f |\n", handler_p50,
              Percentile(handler_us, 0.99), tokens_per_s(handler_us));
  std::printf("| (e) the Decode stream with its tensors in the messages | %.0f us | %.0f us | %.0f |\n", bytes_p50,
              Percentile(bytes_us, 0.99), tokens_per_s(bytes_us));
  std::printf("\n(a) is %.1fx faster than (b); service overhead ((a) - (c)) / (a) = %.0f%%, of which the handler "
              "((d) - (c)) %.0f%% and transport and client ((a) - (d)) %.0f%%\n",
              speedup, 100 * overhead, 100 * (handler_p50 - kernel_p50) / decode_p50,
              100 * (decode_p50 - handler_p50) / decode_p50);
  std::printf("(a), tensors through shared memory, takes %.2fx the time of (e), tensors in the messages\n",
              decode_p50 / bytes_p50);
  return 0;
}

// The segment files of `dir`, written back and dropped from the page cache,
// so that what reads them next reads the disk. Returns their bytes.
int64_t DropFromPageCache(const std::string& dir) {
  int64_t bytes = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* entry = readdir(d)) {
      if (!absl::EndsWith(entry->d_name, ".tkvl")) continue;
      const int fd = open((dir + "/" + entry->d_name).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      fdatasync(fd);
      posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      struct stat st;
      if (fstat(fd, &st) == 0) bytes += st.st_size;
      close(fd);
    }
    closedir(d);
  }
  return bytes;
}

// Reads every segment file of `dir` front to back, 1 MiB at a time.
int64_t ReadSequentially(const std::string& dir) {
  int64_t bytes = 0;
  std::vector<char> buffer(size_t{1} << 20);
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* entry = readdir(d)) {
      if (!absl::EndsWith(entry->d_name, ".tkvl")) continue;
      const int fd = open((dir + "/" + entry->d_name).c_str(), O_RDONLY | O_CLOEXEC);
      for (ssize_t n; fd >= 0 && (n = read(fd, buffer.data(), buffer.size())) > 0;) bytes += n;
      if (fd >= 0) close(fd);
    }
    closedir(d);
  }
  return bytes;
}

// --spill: the disk tier. (a) Promotion of a demoted session from disk
// (page cache dropped) against a plain sequential read of the segment files,
// round by round; (b) Step p99 on one session while another client prefills
// sessions that are then demoted, against the same prefills deleted instead
// (and alone, and while a session is promoted over and over). redis_url:
// the disk stacked over Redis (every page written to both; promotion reads
// the disk).
int RunSpill(const Shape& shape, long long rounds, long long calls, const SessionOptions& session_options, bool json,
             const std::string& redis_url) {
  const std::string dir = absl::StrCat("/tmp/turbokv-bench-spill-", getpid());
  ServerOptions server_options;
  server_options.device = "cpu";
  server_options.threads = static_cast<int>(shape.threads);
  server_options.metrics_listen = "";
  server_options.tiers.spill_dir = dir;
  server_options.tiers.redis_url = redis_url;
  absl::StatusOr<BenchServer> started = StartBenchServer(server_options);
  if (!started.ok()) {
    std::fprintf(stderr, "turbokv-bench e2e --spill: the server did not start: %s\n",
                 std::string(started.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<Server>& server = started->server;
  std::unique_ptr<Client>& client = started->client;
  const size_t token_values = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  constexpr size_t kSlack = size_t{1} << 20;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  const std::vector<uint16_t> pool = Fp16Pool(shape, kSlack, &rng);
  absl::StatusOr<Session> idle = client->CreateSession(session_options);
  absl::StatusOr<Session> busy = client->CreateSession(session_options);
  if (!idle.ok() || !busy.ok() || Prefill(*idle, shape, pool, kSlack, 1) < 0 || Prefill(*busy, shape, pool, kSlack, 2) < 0) {
    return 1;
  }
  SessionStore& store = server->store();
  auto demote = [&](const Session& session) {
    absl::StatusOr<std::shared_ptr<SessionCache>> found = store.Find(session.id(), "", absl::Now());
    if (!found.ok()) return false;
    std::lock_guard<std::mutex> lock((*found)->mutex());
    return store.residency().Demote(**found).ok();
  };
  // (a) Promotion against a sequential read, alternating.
  std::vector<double> promote_mb_s, read_mb_s;
  int64_t session_bytes = 0;
  for (long long r = 0; r < rounds; ++r) {
    if (!demote(*idle) || !store.residency().tier()->Sync().ok()) return 1;
    session_bytes = idle->Info()->disk_bytes();
    DropFromPageCache(dir);
    auto start = Clock::now();
    absl::StatusOr<std::vector<absl::Status>> prefetched = client->Prefetch({idle->id()});
    const double promote_us = Micros(start);
    if (!prefetched.ok() || !(*prefetched)[0].ok()) return 1;
    promote_mb_s.push_back(session_bytes / promote_us);
    const int64_t file_bytes = DropFromPageCache(dir);
    start = Clock::now();
    const int64_t read = ReadSequentially(dir);
    read_mb_s.push_back(read / Micros(start));
    if (read != file_bytes) return 1;
  }
  // (b) Step p99, alone and with demotion and promotion going on.
  std::vector<float> key(token_values), value(token_values), query(static_cast<size_t>(shape.q_heads) * shape.head_dim);
  for (float& x : query) x = normal(rng);
  int64_t position = shape.tokens;
  auto steps = [&](long long n) {
    std::vector<double> us;
    for (long long i = 0; i < n; ++i, ++position) {
      for (float& x : key) x = normal(rng);
      for (float& x : value) x = normal(rng);
      const auto start = Clock::now();
      if (!busy->Step(0, position, TensorData::F32(key), TensorData::F32(value), TensorData::F32(query)).ok()) return us;
      us.push_back(Micros(start));
    }
    return us;
  };
  const std::vector<double> alone = steps(calls);
  // Step while another client keeps prefilling sessions of an eighth the
  // length, each deleted (`demote` false) or demoted (true) once full, and
  // while another session is promoted from disk over and over.
  Shape background = shape;
  background.tokens = std::max(1LL, shape.tokens / 8);
  auto with_background = [&](int mode, int* cycles) {
    std::atomic<bool> stop{false};
    std::thread worker([&] {
      for (uint64_t salt = 10; !stop.load(); ++salt) {
        if (mode == 2) {
          if (!demote(*idle) || !client->Prefetch({idle->id()}).ok()) return;
        } else {
          absl::StatusOr<Session> other = client->CreateSession(session_options);
          if (!other.ok() || Prefill(*other, background, pool, kSlack, salt) < 0) return;
          if (mode == 1 ? !demote(*other) : !other->Delete().ok()) return;
        }
        ++*cycles;
      }
    });
    std::vector<double> us = steps(calls);
    stop.store(true);
    worker.join();
    return us;
  };
  int prefilled = 0, demoted = 0, promoted = 0;
  const std::vector<double> busy_alone = with_background(0, &prefilled);
  const std::vector<double> demoting = with_background(1, &demoted);
  const std::vector<double> promoting = with_background(2, &promoted);
  server->Shutdown(absl::Seconds(1)).IgnoreError();
  server.reset();
  std::system(("rm -rf " + dir).c_str());
  for (const auto* v : {&alone, &busy_alone, &demoting, &promoting}) {
    if (v->size() != static_cast<size_t>(calls)) return 1;
  }
  const double promote = Percentile(promote_mb_s, 0.5), sequential = Percentile(read_mb_s, 0.5);
  const double p99_alone = Percentile(alone, 0.99), p99_prefill = Percentile(busy_alone, 0.99),
               p99_demoting = Percentile(demoting, 0.99), p99_promoting = Percentile(promoting, 0.99);
  if (json) {
    std::printf("{\"tokens\": %lld, \"layers\": %lld, \"session_bytes\": %lld, \"promote_mb_per_s\": %.0f, "
                "\"sequential_read_mb_per_s\": %.0f, \"step_p99_us\": %.0f, \"step_p99_prefilling_us\": %.0f, "
                "\"step_p99_prefilling_demoting_us\": %.0f, \"step_p99_promoting_us\": %.0f}\n",
                shape.tokens, shape.layers, static_cast<long long>(session_bytes), promote, sequential, p99_alone,
                p99_prefill, p99_demoting, p99_promoting);
    return 0;
  }
  std::printf("disk tier: a %lld-layer, %lld-token session (%s), %lld threads, page cache dropped before each read\n\n",
              shape.layers, shape.tokens, v1::Codec_Name(session_options.key_codec).c_str(), shape.threads);
  std::printf("| measure | value |\n|---|---:|\n");
  std::printf("| promotion from disk, %.1f MB (median of %lld) | %.0f MB/s |\n", session_bytes / 1e6, rounds, promote);
  std::printf("| sequential read of the same segment files | %.0f MB/s |\n", sequential);
  std::printf("| Step p99 (%lld calls), nothing else running | %.0f us |\n", calls, p99_alone);
  std::printf("| Step p99, another client prefilling %lld-token sessions, each deleted (%d) | %.0f us |\n",
              background.tokens, prefilled, p99_prefill);
  std::printf("| Step p99, the same, each demoted to disk once full (%d) | %.0f us |\n", demoted, p99_demoting);
  std::printf("| Step p99, another session promoted from disk over and over (%d) | %.0f us |\n", promoted,
              p99_promoting);
  std::printf("\npromotion / sequential read = %.2f; Step p99 with demotion / without = %.2f (target <= 1.5: %s)\n",
              promote / sequential, p99_demoting / p99_prefill, p99_demoting <= 1.5 * p99_prefill ? "met" : "NOT met");
  return 0;
}

}  // namespace

int RunE2e(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv,
                     {"tokens", "kv-heads", "q-heads", "head-dim", "layers", "threads", "chunk", "calls", "codec",
                      "batch", "steps", "rounds", "device", "redis-url", "cuda-attention"},
                     {"json", "spill"}, &error)) {
    return UsageError(error);
  }
  const bool spill = options.Has("spill");
  if (options.Has("redis-url") && !spill) return UsageError("--redis-url goes with --spill (the disk stacked over Redis)");
  long long tokens, kv_heads, q_heads, head_dim, layers, threads, chunk, calls, batch = 0, steps, rounds;
  if (!options.GetInt("tokens", spill ? 8192 : 32768, &tokens, &error) ||
      !options.GetInt("kv-heads", 8, &kv_heads, &error) || !options.GetInt("q-heads", 32, &q_heads, &error) ||
      !options.GetInt("head-dim", 128, &head_dim, &error) || !options.GetInt("layers", spill ? 32 : 1, &layers, &error) ||
      !options.GetInt("threads", 2, &threads, &error) || !options.GetInt("rounds", 5, &rounds, &error) ||
      !options.GetInt("chunk", DefaultChunk(layers, kv_heads, head_dim), &chunk, &error) ||
      !options.GetInt("calls", 200, &calls, &error) ||
      (options.Has("batch") && !options.GetInt("batch", 1, &batch, &error)) ||
      !options.GetInt("steps", 4, &steps, &error)) {
    return UsageError(error);
  }
  v1::Codec codec = v1::CODEC_UNSPECIFIED;
  if (!v1::Codec_Parse("CODEC_" + absl::AsciiStrToUpper(options.Get("codec", "turbo3")), &codec)) {
    return UsageError("--codec: f16, q8_0, q4_0, turbo2, turbo3 or turbo4");
  }

  SessionOptions session_options;
  session_options.layers = static_cast<int>(layers);
  session_options.kv_heads = static_cast<int>(kv_heads);
  session_options.q_heads = static_cast<int>(q_heads);
  session_options.head_dim = static_cast<int>(head_dim);
  session_options.key_codec = session_options.value_codec = codec;
  if (spill) {
    return RunSpill(Shape{tokens, kv_heads, q_heads, head_dim, layers, threads, chunk}, rounds, calls, session_options,
                    options.Has("json"), options.Get("redis-url", ""));
  }
  ServerOptions server_options;
  server_options.device = options.Get("device", "cpu");
  const std::string attention = options.Get("cuda-attention", "split");
  if (attention != "split" && attention != "tensor-cores") {
    return UsageError("--cuda-attention: split or tensor-cores (turbokvd's flag)");
  }
  server_options.cuda_tensor_cores = attention == "tensor-cores";
  server_options.threads = static_cast<int>(threads);
  server_options.metrics_listen = "";
  absl::StatusOr<BenchServer> started = StartBenchServer(server_options);
  if (!started.ok()) {
    std::fprintf(stderr, "turbokv-bench e2e: the server did not start: %s\n",
                 std::string(started.status().message()).c_str());
    return 1;
  }
  std::unique_ptr<Server>& server = started->server;
  std::unique_ptr<Client>& client = started->client;
  if (batch > 0) {
    const int rc = RunBatch(Shape{tokens, kv_heads, q_heads, head_dim, layers, threads, chunk}, batch, steps,
                            *client, *server, session_options, options.Has("json"));
    server->Shutdown(absl::Seconds(1)).IgnoreError();  // no snapshot dir: nothing to fail
    return rc;
  }
  absl::StatusOr<Session> session = client->CreateSession(session_options);
  if (!session.ok()) {
    std::fprintf(stderr, "turbokv-bench e2e: %s\n", std::string(session.status().message()).c_str());
    return 1;
  }

  const size_t token_values = static_cast<size_t>(kv_heads) * head_dim;
  constexpr size_t kSlack = size_t{1} << 20;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  const Shape shape{tokens, kv_heads, q_heads, head_dim, layers, threads, chunk};
  const std::vector<uint16_t> pool_bits = Fp16Pool(shape, kSlack, &rng);
  const double append_seconds = Prefill(*session, shape, pool_bits, kSlack, 0);
  if (append_seconds < 0) return 1;
  const double token_layers_per_s = tokens * layers / append_seconds;
  const double input_mb_per_s = tokens * layers * token_values * 2 * 2 / append_seconds / 1e6;

  // Step, Attend, the kernel and an empty round trip take turns, a tenth of
  // the calls at a time, so the machine's drift hits them alike.
  std::vector<float> key(token_values), value(token_values), query(static_cast<size_t>(q_heads) * head_dim);
  for (float& x : query) x = normal(rng);
  std::vector<double> step_us, attend_us, kernel_us, rtt_us;
  absl::StatusOr<std::shared_ptr<SessionCache>> stored = server->store().Find(session->id(), "", absl::Now());
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
      const AttentionProblem problem{cache, AttentionQueries{1, query.data(), &last},
                                     AttentionOutput{out.data(), lse.data()}};
      const auto start = Clock::now();
      absl::Status status = server->store().backend().Attend(AttentionBatch{&problem, 1}, params);
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
  server->Shutdown(absl::Seconds(1)).IgnoreError();  // no snapshot dir: nothing to fail

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
  std::printf("turbokvd over a unix socket, %s keys and values, %lld kv heads, %lld q heads, d %lld, %lld threads, %s\n\n",
              v1::Codec_Name(codec).c_str(), kv_heads, q_heads, head_dim, threads, server->device().c_str());
  std::printf("| measure | p50 | p99 |\n|---|---:|---:|\n");
  std::printf("| append, %lld tokens x %lld layers in chunks of %lld (fp16 in) | %.0f token-layers/s, %.0f MB/s | |\n",
              tokens, layers, chunk, token_layers_per_s, input_mb_per_s);
  std::printf("| Step (append 1 token + attend, %lld tokens) | %.0f us | %.0f us |\n", tokens, step_p50,
              Percentile(step_us, 0.99));
  std::printf("| Attend (1 query) | %.0f us | %.0f us |\n", Percentile(attend_us, 0.5), Percentile(attend_us, 0.99));
  std::printf("| attention backend in process, same layer and query | %.0f us | %.0f us |\n", kernel_p50,
              Percentile(kernel_us, 0.99));
  std::printf("| empty gRPC round trip (health check) | %.0f us | %.0f us |\n", rtt_p50, Percentile(rtt_us, 0.99));
  std::printf("\nStep p50 / (kernel p50 + empty round trip p50) = %.2f (target <= 1.5: %s)\n",
              step_p50 / (kernel_p50 + rtt_p50), step_p50 <= budget ? "met" : "NOT met");
  return 0;
}

}  // namespace turbokv::bench
