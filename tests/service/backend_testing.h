// The devices the service tests run on, once each: "cpu", and "cuda:0",
// which skips, saying why, where this build or machine has no GPU that can
// serve. A test parameterized by device (INSTANTIATE_TEST_SUITE_P(Devices,
// X, ::testing::ValuesIn(TestDevices()), DeviceTestName)) gets its backend from
// TestBackend.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "service/backend/make_backend.h"

namespace turbokv::testing {

inline std::vector<std::string> TestDevices() { return {"cpu", "cuda:0"}; }
// The same, and GPU 0 with its pages in token groups and attention on the
// tensor-core kernel (TestBackend's "cuda:0+tensor-cores").
inline std::vector<std::string> TestBackends() { return {"cpu", "cuda:0", "cuda:0+tensor-cores"}; }

// "cpu", "cuda_0": the device as a test name.
inline std::string DeviceName(const std::string& device) {
  std::string name = device;
  for (char& c : name) {
    if (c == ':' || c == '+' || c == '-') c = '_';
  }
  return name;
}
inline std::string DeviceTestName(const ::testing::TestParamInfo<std::string>& info) { return DeviceName(info.param); }

// The backend of `device` for a store of `budget` bytes (a GPU's arena of
// the same size), two calls at once on a GPU.
inline absl::StatusOr<std::unique_ptr<Backend>> TestBackend(const std::string& device, ThreadPool* pool,
                                                            size_t budget) {
  const std::string suffix = "+tensor-cores";
  const bool tensor_cores = device.size() > suffix.size() && device.compare(device.size() - suffix.size(), suffix.size(), suffix) == 0;
  const std::string name = tensor_cores ? device.substr(0, device.size() - suffix.size()) : device;
  return MakeBackend(name, pool, name == "cpu" ? 0 : budget, 2, tensor_cores);
}

}  // namespace turbokv::testing
