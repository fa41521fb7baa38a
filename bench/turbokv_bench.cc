// turbokv-bench: measures what users ask about, each number next to its
// baseline from the same run.
//
//   turbokv-bench codec ...    codec fidelity and encode/decode speed (codec_cmd.cc)
//   turbokv-bench attend ...   attention on the compressed cache vs f16 and memory speed (attend_cmd.cc)
//   turbokv-bench e2e ...      the service over a unix socket vs its kernel and an empty round trip (e2e_cmd.cc)
//   turbokv-bench quality ...  each codec preset's attention error against float attention, and its bits (quality_cmd.cc)
//   turbokv-bench takeover ... the Redis tier: a session taken over by another daemon vs plain GETs (takeover_cmd.cc)
//   turbokv-bench prefix ...   sessions sharing a prefix by content: memory and start time vs appending it (prefix_cmd.cc)
#include <cstdio>
#include <string>

#include "bench/cli.h"

namespace turbokv::bench {

int RunCodec(int argc, char** argv);
int RunAttend(int argc, char** argv);
int RunE2e(int argc, char** argv);
int RunQuality(int argc, char** argv);
int RunTakeover(int argc, char** argv);
int RunPrefix(int argc, char** argv);
int RunPool(int argc, char** argv);

constexpr char kUsage[] =
    "usage: turbokv-bench codec --codec NAME --head-dim D --vectors N [--impl simd|scalar|cuda] [--target AVX2|SSE4|...] [--json]\n"
    "         NAME: f16, q8_0, q4_0, turbo2, turbo3, turbo4, or all (a table of every codec)\n"
    "       turbokv-bench attend --k-codec C --v-codec C --tokens T --kv-heads H --q-heads Q\n"
    "                            --head-dim D [--queries N] [--threads N] [--page-tokens N]\n"
    "                            [--impl cpu|cuda] [--target AVX2|SSE4|...] [--chunk-tokens N] [--json]\n"
    "                            [--sessions S]  (S sessions' caches attended in one batched call)\n"
    "                            [--kernel split|tensor-cores [--variant WARPS,STAGES]]  (with --impl cuda)\n"
    "                            [--few-tokens]  (as a layer's sinks: AttendFewCpu, at most 64 tokens, f16/q8_0/q4_0)\n"
    "       turbokv-bench e2e [--tokens T] [--layers L] [--kv-heads H] [--q-heads Q] [--head-dim D]\n"
    "                         [--threads N] [--chunk N] [--calls N] [--codec C] [--batch B [--steps S]]\n"
    "                         [--device cpu|cuda:N [--cuda-attention split|tensor-cores]] [--json]\n"
    "       turbokv-bench e2e --spill [--redis-url URL] [--tokens 8192] [--layers 32] [--rounds 5] [--calls N] ...\n"
    "                         the disk tier: promotion MB/s against a sequential read, Step p99 while demoting\n"
    "       turbokv-bench quality [--layers 32] [--kv-heads 8] [--q-heads 32] [--head-dim 128]\n"
    "                             [--tokens 4096,32768] [--queries 4] [--sample-layers 2] [--threads 2] [--max-bits 3.7] [--json]\n"
    "                         each preset's attention error on model-shaped data, and its bits per value\n"
    "       turbokv-bench takeover [--layers 32] [--tokens 8192] [--kv-heads 8] [--q-heads 32] [--head-dim 128]\n"
    "                              [--threads 2] [--repeats 3] [--seconds 3] [--acknowledge written|queued]\n"
    "                              [--cluster N] [--json]\n"
    "                         the Redis tier, on a redis-server (a Redis Cluster of N masters with --cluster)\n"
    "                         and turbokvd daemons it starts: a session handed\n"
    "                         over and taken over (OpenSession through the first Attend) against GETs of its\n"
    "                         pages, and Step p99 while Redis answers, is paused and is stopped\n"
    "       turbokv-bench prefix [--sessions 32] [--tokens 4096] [--layers 32] [--kv-heads 8] [--q-heads 32]\n"
    "                            [--head-dim 128] [--threads 2] [--preset NAME] [--json]\n"
    "                         one session appends a prefix and names its blocks, the others start from it:\n"
    "                         memory held against one session's, and start time against appending\n"
    "       turbokv-bench pool [--threads 2] [--indices 32] [--index-us 2.3] [--calls 300] [--gap-us 300]\n"
    "                          [--rounds 3] [--json]\n"
    "                         the kernel pool's large calls, its workers plain and pinned (--pin-threads) in turns\n";

int UsageError(const std::string& message) {
  std::fprintf(stderr, "turbokv-bench: %s\n%s", message.c_str(), kUsage);
  return 2;
}

}  // namespace turbokv::bench

int main(int argc, char** argv) {
  using namespace turbokv::bench;
  if (argc < 2) return UsageError("missing subcommand");
  const std::string command = argv[1];
  if (command == "codec") return RunCodec(argc - 2, argv + 2);
  if (command == "attend") return RunAttend(argc - 2, argv + 2);
  if (command == "e2e") return RunE2e(argc - 2, argv + 2);
  if (command == "quality") return RunQuality(argc - 2, argv + 2);
  if (command == "takeover") return RunTakeover(argc - 2, argv + 2);
  if (command == "prefix") return RunPrefix(argc - 2, argv + 2);
  if (command == "pool") return RunPool(argc - 2, argv + 2);
  if (command == "-h" || command == "--help" || command == "help") {
    std::printf("%s", kUsage);
    return 0;
  }
  return UsageError("unknown subcommand \"" + command + "\"");
}
