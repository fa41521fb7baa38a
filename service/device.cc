#include "service/device.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "service/backend/cpu_backend.h"
#include "service/backend/make_backend.h"
#include "service/text_file.h"

namespace turbokv {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::optional<std::string> text = ReadTextFile(path);
  if (text.has_value()) *text = std::string(absl::StripAsciiWhitespace(*text));
  return text;
}

// The quota, in CPUs, of one cgroup directory; nullopt when it has none.
std::optional<double> QuotaOf(const std::string& dir, bool v2) {
  double quota = 0, period = 0;
  if (v2) {
    const std::optional<std::string> max = ReadFile(dir + "/cpu.max");  // "QUOTA PERIOD" or "max PERIOD"
    if (!max.has_value()) return std::nullopt;
    const std::vector<std::string> parts = absl::StrSplit(*max, ' ', absl::SkipEmpty());
    if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &quota) || !absl::SimpleAtod(parts[1], &period)) {
      return std::nullopt;
    }
  } else {
    const std::optional<std::string> q = ReadFile(dir + "/cpu.cfs_quota_us");  // -1: none
    const std::optional<std::string> p = ReadFile(dir + "/cpu.cfs_period_us");
    if (!q.has_value() || !p.has_value() || !absl::SimpleAtod(*q, &quota) || !absl::SimpleAtod(*p, &period)) {
      return std::nullopt;
    }
  }
  if (!(quota > 0) || !(period > 0)) return std::nullopt;
  return quota / period;
}

// The tightest quota from `path` up to the root of the hierarchy at `mount`.
std::optional<double> TightestQuota(const std::string& mount, std::string path, bool v2) {
  std::optional<double> tightest;
  for (;;) {
    const std::optional<double> quota = QuotaOf(mount + path, v2);
    if (quota.has_value() && (!tightest.has_value() || *quota < *tightest)) tightest = quota;
    if (path.empty() || path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == std::string::npos ? "" : path.substr(0, slash);
  }
  return tightest;
}

// The CPU quota of this process's cgroups (v2 and v1 alike), or nullopt.
std::optional<double> CgroupQuota(const std::string& cgroup_root, const std::string& proc_cgroup) {
  const std::optional<std::string> lines = ReadFile(proc_cgroup);
  if (!lines.has_value()) return std::nullopt;
  std::optional<double> tightest;
  for (absl::string_view line : absl::StrSplit(*lines, '\n', absl::SkipEmpty())) {
    // "ID:CONTROLLERS:PATH"; v2 is "0::PATH".
    const std::vector<std::string> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    std::optional<double> quota;
    if (fields[0] == "0" && fields[1].empty()) {
      quota = TightestQuota(cgroup_root, fields[2], true);
      if (!quota.has_value()) quota = TightestQuota(cgroup_root + "/unified", fields[2], true);
    } else {
      const std::vector<std::string> controllers = absl::StrSplit(fields[1], ',');
      if (std::find(controllers.begin(), controllers.end(), "cpu") == controllers.end()) continue;
      quota = TightestQuota(absl::StrCat(cgroup_root, "/", fields[1]), fields[2], false);
    }
    if (quota.has_value() && (!tightest.has_value() || *quota < *tightest)) tightest = quota;
  }
  return tightest;
}

}  // namespace

CoreAllowance AvailableCores(const std::string& cgroup_root, const std::string& proc_cgroup) {
  CoreAllowance allowance;
  cpu_set_t mask;
  int cpus = 0;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cpus = CPU_COUNT(&mask);
  // A mask that does not fit cpu_set_t (more than 1024 CPUs): every core.
  if (cpus < 1) cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  allowance.cores = cpus;
  allowance.why = absl::StrCat(cpus, " CPU", cpus == 1 ? "" : "s", " in the affinity mask");
  if (const std::optional<double> quota = CgroupQuota(cgroup_root, proc_cgroup); quota.has_value()) {
    const int cores = std::max(1, static_cast<int>(std::ceil(*quota - 1e-9)));
    absl::StrAppend(&allowance.why, absl::StrFormat(", cgroup CPU quota %.2f", *quota));
    if (cores < allowance.cores) allowance.cores = cores;
  }
  return allowance;
}

absl::StatusOr<DeviceChoice> ChooseDevice(absl::string_view flag, ThreadPool* pool, size_t memory_budget,
                                          int streams, bool tensor_cores) {
  DeviceChoice choice;
  if (flag == "auto") {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeBackend("cuda:0", pool, memory_budget, streams, tensor_cores);
    if (gpu.ok()) {
      choice.backend = *std::move(gpu);
      choice.why = "--device=auto: CUDA device 0 can serve";
      return choice;
    }
    choice.backend = std::make_unique<CpuBackend>(pool);
    choice.why = absl::StrCat("--device=auto: no GPU (", gpu.status().message(),
                              "); sessions in host memory, kernels on the CPU");
    return choice;
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(flag, pool, memory_budget, streams, tensor_cores);
  if (absl::IsInvalidArgument(backend.status())) {
    return absl::InvalidArgumentError(absl::StrCat("--device=", flag, ": expected auto, cpu or cuda:N"));
  }
  if (!backend.ok()) {
    return absl::Status(backend.status().code(), absl::StrCat("--device=", flag, ": ", backend.status().message(),
                                                              "; use --device=cpu, or auto to fall back to it"));
  }
  choice.backend = *std::move(backend);
  choice.why = absl::StrCat("--device=", flag);
  return choice;
}

}  // namespace turbokv
