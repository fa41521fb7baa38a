// Sessions filled over the client, fp16 in, for the subcommands that
// measure the service (e2e_cmd.cc, takeover_cmd.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cpp/client.h"
#include "service/server.h"

namespace turbokv::bench {

struct Shape {
  long long tokens, kv_heads, q_heads, head_dim, layers, threads, chunk;
};

// Prefill chunk: 512 tokens, or fewer when every layer's fp16 keys and
// values of 512 would not fit in a 32 MiB message.
long long DefaultChunk(long long layers, long long kv_heads, long long head_dim);

// fp16 input for Prefill, made before the clock starts: chunks are windows
// at pseudo-random offsets into a pool one chunk plus `slack` values long.
std::vector<uint16_t> Fp16Pool(const Shape& shape, size_t slack, std::mt19937* rng);

// Appends `tokens` tokens to every layer of `session` in chunks, fp16 in,
// from windows of `pool`. Returns the seconds it took, or < 0 on error
// (reported on stderr).
double Prefill(const Session& session, const Shape& shape, const std::vector<uint16_t>& pool, size_t slack,
               uint64_t salt);

// An in-process turbokvd started with `options` on a unix socket of this
// process (16 GiB of memory, no metrics unless set) and a client of it,
// serving.
struct BenchServer {
  std::unique_ptr<Server> server;
  std::unique_ptr<Client> client;
};
absl::StatusOr<BenchServer> StartBenchServer(ServerOptions options);

}  // namespace turbokv::bench
