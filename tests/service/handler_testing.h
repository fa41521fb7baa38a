// A handler over a fresh store for the tests that call it without a network:
// pages of 16 tokens, two kernel threads, a one-hour session TTL.
#pragma once

#include <memory>

#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"
#include "service/handler/handler.h"

namespace turbokv::testing {

class HandlerFixture : public ::testing::Test {
 protected:
  // A new store with this budget and eviction policy, and a handler over it.
  void Init(size_t budget, EvictionPolicy eviction = EvictionPolicy::kReject) {
    StoreOptions store_options;
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
  void SetUp() override { Init(size_t{1} << 30); }
  // What a session of `layers` layers costs the budget besides its pages.
  static size_t Meta(int layers) {
    SessionConfig config;
    config.layers = layers;
    return SessionMetadataBytes(config);
  }

  ThreadPool pool_{2};
  std::unique_ptr<SessionStore> store_;
  std::unique_ptr<Handler> handler_;
};

}  // namespace turbokv::testing
