// Which device holds the sessions and runs the kernels, from --device.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace turbokv {

struct DeviceChoice {
  std::string name;  // e.g. "cpu (simd:AVX3_DL, 2 threads)"
  std::string why;   // for the start-up log
};

// flag: "auto", "cpu" or "cuda:N". This version keeps sessions in host memory
// and computes on the CPU: "auto" says what it found on the GPU side and
// picks the CPU; "cuda:N" is refused with FAILED_PRECONDITION saying so.
// INVALID_ARGUMENT for anything else.
absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag, int threads);

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
