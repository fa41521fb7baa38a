// A handler over a fresh store for the tests that call it without a network:
// pages of 16 tokens, two kernel threads, a one-hour session TTL, on the
// device the test names (backend_testing.h); skips where it cannot serve.
#pragma once

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"
#include "service/handler/handler.h"
#include "tests/service/backend_testing.h"

namespace turbokv::testing {

class HandlerFixture : public ::testing::Test {
 protected:
  // "cpu" or "cuda:N": the leaf fixture's parameter.
  virtual std::string Device() const = 0;

  // A new store with this budget and eviction policy, and a handler over it.
  void Init(size_t budget, EvictionPolicy eviction = EvictionPolicy::kReject) {
    handler_.reset();
    store_.reset();
    absl::StatusOr<std::unique_ptr<Backend>> backend = TestBackend(Device(), &pool_, budget);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    StoreOptions store_options;
    store_options.backend = backend_.get();
    store_options.budget_bytes = budget;
    store_options.eviction = eviction;
    store_options.page_tokens = 16;
    store_ = std::make_unique<SessionStore>(store_options);
    HandlerOptions options;
    options.kernel_pool = &pool_;
    options.max_tokens = 100000;
    options.session_ttl = absl::Hours(1);
    handler_ = std::make_unique<Handler>(store_.get(), options);
  }
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> probe = TestBackend(Device(), &pool_, size_t{1} << 20);
    if (!probe.ok()) GTEST_SKIP() << Device() << " cannot serve here: " << probe.status().message();
    Init(size_t{1} << 30);
  }
  // What a session of this shape costs the budget besides its pages (with
  // the default sink tokens).
  static size_t Meta(int layers, int kv_heads, int head_dim) { return SessionMetadataBytes(Shape(layers, kv_heads, head_dim)); }
  // What a fork past the sink tokens adds: its codecs, sink pages and
  // transforms are its source's.
  static size_t ForkMeta(int layers, int kv_heads, int head_dim) {
    const SessionConfig config = Shape(layers, kv_heads, head_dim);
    return SessionMetadataBytes(config) - SessionSharedMetadataBytes(config);
  }
  static SessionConfig Shape(int layers, int kv_heads, int head_dim) {
    SessionConfig config;
    config.layers = layers;
    config.kv_heads = kv_heads;
    config.head_dim = head_dim;
    config.sink_tokens = kDefaultSinkTokens;
    return config;
  }

  ThreadPool pool_{2};
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<SessionStore> store_;
  std::unique_ptr<Handler> handler_;
};

// A HandlerFixture whose gtest parameter is the device.
class DeviceHandlerFixture : public HandlerFixture, public ::testing::WithParamInterface<std::string> {
 protected:
  std::string Device() const override { return GetParam(); }
};

}  // namespace turbokv::testing
