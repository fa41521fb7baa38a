// turbokv-bench pool: the kernel pool's large calls (a daemon's pool, whose
// workers are SCHED_IDLE and whose caller waits), plain and pinned in turns:
// each call's time against its work spread over the workers, and how many
// calls ran on one core alone.
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench/cli.h"
#include "kernels/cpu/thread_pool.h"

namespace turbokv::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct PoolResult {
  double p50_us = 0, p90_us = 0;
  int one_core = 0;  // calls whose indices all ran on one CPU
};

PoolResult TimeCalls(bool pin, int threads, long long indices, double index_us, long long calls, long long gap_us) {
  ThreadPool pool(threads, /*background_from=*/1, pin);
  std::vector<int> cpu(static_cast<size_t>(indices));
  std::vector<double> took;
  PoolResult result;
  for (long long c = 0; c < calls; ++c) {
    if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    const auto start = Clock::now();
    pool.ParallelFor(indices, [&](int64_t i) {
      cpu[static_cast<size_t>(i)] = sched_getcpu();
      const auto until = Clock::now() + std::chrono::nanoseconds(static_cast<long long>(index_us * 1000));
      while (Clock::now() < until) {
      }
    });
    took.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
    bool one = true;
    for (int x : cpu) one = one && x == cpu[0];
    result.one_core += one;
  }
  result.p50_us = Percentile(took, 0.5);
  result.p90_us = Percentile(took, 0.9);
  return result;
}

}  // namespace

int RunPool(int argc, char** argv) {
  Options options;
  std::string error;
  if (!options.Parse(argc, argv, {"threads", "indices", "index-us", "calls", "gap-us", "rounds"}, {"json"}, &error)) {
    return UsageError(error);
  }
  long long threads, indices, calls, gap_us, rounds;
  if (!options.GetInt("threads", 2, &threads, &error) || !options.GetInt("indices", 32, &indices, &error) ||
      !options.GetInt("calls", 300, &calls, &error) || !options.GetInt("gap-us", 300, &gap_us, &error) ||
      !options.GetInt("rounds", 3, &rounds, &error)) {
    return UsageError(error);
  }
  double index_us = 0;
  if (!absl::SimpleAtod(options.Get("index-us", "2.3"), &index_us) || index_us < 0) {
    return UsageError("--index-us: expected a number of microseconds >= 0");
  }
  if (threads > 256) return UsageError("--threads: at most 256");
  const double ideal = static_cast<double>(indices) * index_us / static_cast<double>(threads);
  if (!options.Has("json")) {
    std::printf("pool: %lld threads (SCHED_IDLE workers, the caller waits), %lld calls of %lld indices of %.1f us "
                "(%.0f us on every thread), %lld us apart\n\n",
                threads, calls, indices, index_us, ideal, gap_us);
    std::printf("| round | workers | p50 | p90 | calls on one core |\n|---:|---|---:|---:|---:|\n");
  }
  for (long long round = 1; round <= rounds; ++round) {
    for (const bool pin : {false, true}) {
      const PoolResult r = TimeCalls(pin, static_cast<int>(threads), indices, index_us, calls, gap_us);
      if (options.Has("json")) {
        std::printf("{\"round\": %lld, \"pinned\": %s, \"threads\": %lld, \"indices\": %lld, \"index_us\": %.3f, "
                    "\"calls\": %lld, \"p50_us\": %.1f, \"p90_us\": %.1f, \"calls_on_one_core\": %d}\n",
                    round, pin ? "true" : "false", threads, indices, index_us, calls, r.p50_us, r.p90_us, r.one_core);
      } else {
        std::printf("| %lld | %s | %.0f us | %.0f us | %d of %lld |\n", round, pin ? "pinned" : "plain", r.p50_us,
                    r.p90_us, r.one_core, calls);
      }
    }
  }
  return 0;
}

}  // namespace turbokv::bench
