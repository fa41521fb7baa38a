// Which device holds the sessions and runs the kernels, from --device.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/backend/backend.h"

namespace turbokv {

class ThreadPool;

struct DeviceChoice {
  std::unique_ptr<Backend> backend;  // its name() says what it is, e.g. "cpu (simd:AVX3_DL, 2 threads)"
  std::string why;                   // for the start-up log
};

// flag: "auto", "cpu" or "cuda:N".
//   cpu: host memory, kernels on the CPU over `pool`.
//   cuda:N: GPU N, its page arena memory_budget bytes (0: the CUDA backend's
//     default share of the GPU's free memory), `streams` calls at once on it;
//     FAILED_PRECONDITION naming why when it cannot serve (a build without
//     CUDA, no driver or device, too old a GPU, too little free memory).
//   auto: GPU 0 when it can serve, the CPU otherwise; `why` says what was
//     found.
// INVALID_ARGUMENT for anything else.
absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag, ThreadPool* pool, size_t memory_budget,
                                          int streams, bool tensor_cores = false);

// The cores this process may keep busy, for --threads=0: the CPUs of its
// affinity mask, capped by the CPU quota of its cgroup (v2 cpu.max, v1
// cpu.cfs_quota_us over cpu.cfs_period_us, rounded up; the tightest along
// the cgroup's path), at least 1. A container's CPU limit is such a quota;
// std::thread::hardware_concurrency counts every core of the node.
struct CoreAllowance {
  int cores = 1;
  std::string why;  // for the start-up log, e.g. "2 CPUs in the affinity mask, cgroup CPU quota 1.5"
};
// cgroup_root and proc_cgroup: /sys/fs/cgroup and /proc/self/cgroup, other
// trees in tests.
CoreAllowance AvailableCores(const std::string& cgroup_root = "/sys/fs/cgroup",
                             const std::string& proc_cgroup = "/proc/self/cgroup");

}  // namespace turbokv
