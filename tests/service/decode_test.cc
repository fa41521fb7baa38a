// The handler's Decode without a network: a batch equals the same work done
// session by session with Step (to the bit), bad items fail alone and change
// nothing, malformed messages are refused whole, and concurrent batches that
// share sessions in opposite orders do not deadlock.
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "service/metrics.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/handler_testing.h"
#include "tests/service/service_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::MakeAppend;
using ::turbokv::testing::MakeCreate;
using ::turbokv::testing::MakeTensor;
using ::turbokv::testing::TensorFloats;

constexpr int kLayers = 2, kKv = 4, kQ = 8, kDim = 128, kLayer = 1;

class DecodeTestBase : public ::turbokv::testing::HandlerFixture {
 protected:
  // A session (rotation seed 42) with `tokens` tokens in layer kLayer.
  std::string Create(int64_t tokens, uint64_t seed, const std::string& tenant = "") {
    auto created = handler_->CreateSession(MakeCreate(kLayers, kKv, kQ, kDim), tenant);
    EXPECT_TRUE(created.ok()) << created.status();
    const std::string id = created->session_id();
    if (tokens > 0) {
      const auto k = GaussianVectors(tokens * kKv, kDim, seed), v = GaussianVectors(tokens * kKv, kDim, seed + 1);
      EXPECT_TRUE(handler_->Append(MakeAppend(id, kLayer, 0, k, v, {tokens, kKv, kDim}), tenant).ok());
    }
    return id;
  }

  int64_t Tokens(const std::string& id) {
    v1::GetSessionRequest request;
    request.set_session_id(id);
    auto info = handler_->GetSession(request);
    EXPECT_TRUE(info.ok()) << info.status();
    return info->layer_tokens(kLayer);
  }

  // A Decode message for `ids` with k queries each at positions[i][j];
  // with_keys adds k tokens per item. Inputs drawn from `seed`.
  static v1::DecodeRequest MakeDecode(const std::vector<std::string>& ids, int k,
                                      const std::vector<std::vector<int64_t>>& positions, bool with_keys,
                                      uint64_t seed) {
    v1::DecodeRequest request;
    request.set_layer(kLayer);
    const int64_t b = static_cast<int64_t>(ids.size());
    for (const std::string& id : ids) request.add_session_ids(id);
    for (const auto& item : positions) {
      for (int64_t p : item) request.add_positions(p);
    }
    auto shape = [&](int heads) {
      return k == 1 ? std::vector<int64_t>{b, heads, kDim} : std::vector<int64_t>{b, k, heads, kDim};
    };
    *request.mutable_queries() = MakeTensor(GaussianVectors(b * k * kQ, kDim, seed), shape(kQ));
    if (with_keys) {
      *request.mutable_keys() = MakeTensor(GaussianVectors(b * k * kKv, kDim, seed + 1), shape(kKv));
      *request.mutable_values() = MakeTensor(GaussianVectors(b * k * kKv, kDim, seed + 2), shape(kKv));
    }
    return request;
  }

};

// The rows of item i, query j of a Decode message, as a Step request.
v1::StepRequest StepOf(const v1::DecodeRequest& decode, const std::string& id, int64_t i, int64_t j, int k) {
  const auto q = TensorFloats(decode.queries()), keys = TensorFloats(decode.keys()),
             values = TensorFloats(decode.values());
  const size_t row = static_cast<size_t>(i * k + j);
  v1::StepRequest step;
  step.set_session_id(id);
  step.set_layer(decode.layer());
  step.set_position(decode.positions(static_cast<int>(row)));
  auto slice = [&](const std::vector<float>& all, int heads) {
    const size_t n = static_cast<size_t>(heads) * kDim;
    return MakeTensor(std::vector<float>(all.begin() + row * n, all.begin() + (row + 1) * n), {1, heads, kDim});
  };
  *step.mutable_key() = slice(keys, kKv);
  *step.mutable_value() = slice(values, kKv);
  *step.mutable_query() = slice(q, kQ);
  *step.mutable_options() = decode.options();
  return step;
}

class DecodeTest : public DecodeTestBase, public ::testing::WithParamInterface<std::string> {
 protected:
  std::string Device() const override { return GetParam(); }
};

// On a device, B sessions, k draft tokens per item, with and without
// window/softcap.
class DecodeEqualsStepTest : public DecodeTestBase,
                             public ::testing::WithParamInterface<std::tuple<std::string, int, int, bool>> {
 protected:
  std::string Device() const override { return std::get<0>(GetParam()); }
};

TEST_P(DecodeEqualsStepTest, BitForBit) {
  const auto [device, b, k, shaped] = GetParam();
  // Two identical groups of sessions of different lengths (across page
  // boundaries): one goes through Decode, the other through Step.
  std::vector<std::string> batched, stepped;
  std::vector<int64_t> lengths;
  for (int i = 0; i < b; ++i) {
    lengths.push_back(13 + 11 * i % 70);
    batched.push_back(Create(lengths.back(), 100 + i));
    stepped.push_back(Create(lengths.back(), 100 + i));
  }
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<int64_t>> positions(b);
    for (int i = 0; i < b; ++i) {
      for (int j = 0; j < k; ++j) positions[i].push_back(lengths[i] + j);
    }
    v1::DecodeRequest decode = MakeDecode(batched, k, positions, /*with_keys=*/true, 1000 + step);
    if (shaped) {
      decode.mutable_options()->set_window(20);
      decode.mutable_options()->set_softcap(30.0f);
      decode.mutable_options()->set_top_k(3);
    }
    auto result = handler_->Decode(decode);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->failed(), 0);
    const auto out = TensorFloats(result->output()), lse = TensorFloats(result->lse());
    for (int i = 0; i < b; ++i) {
      for (int j = 0; j < k; ++j) {
        auto single = handler_->Step(StepOf(decode, stepped[i], i, j, k));
        ASSERT_TRUE(single.ok()) << single.status();
        const auto step_out = TensorFloats(single->result().output()), step_lse = TensorFloats(single->result().lse());
        const size_t row = static_cast<size_t>(i * k + j);
        ASSERT_EQ(0, std::memcmp(step_out.data(), out.data() + row * kQ * kDim, step_out.size() * 4))
            << "item " << i << " query " << j << " step " << step;
        ASSERT_EQ(0, std::memcmp(step_lse.data(), lse.data() + row * kQ, step_lse.size() * 4));
        if (shaped) {
          const auto& tokens = single->result().top_k_tokens();
          for (int t = 0; t < tokens.size(); ++t) {
            EXPECT_EQ(tokens[t], result->top_k_tokens(static_cast<int>(row * kQ * 3) + t));
          }
        }
      }
      EXPECT_EQ(result->tokens(i), lengths[i] + k);
      EXPECT_EQ(result->status(i).code(), 0);
      lengths[i] += k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Batches, DecodeEqualsStepTest,
                         ::testing::Combine(::testing::ValuesIn(testing::TestBackends()), ::testing::Values(1, 3, 32),
                                            ::testing::Values(1, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return testing::DeviceName(std::get<0>(info.param)) + "_b" +
                                  std::to_string(std::get<1>(info.param)) + "_k" +
                                  std::to_string(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_window_softcap" : "");
                         });

INSTANTIATE_TEST_SUITE_P(Devices, DecodeTest, ::testing::ValuesIn(testing::TestBackends()), testing::DeviceTestName);

// Sessions that start empty: Decode's first tokens go to a copy of the sink
// page, which its attention reads before the layer holds it, then past the
// sinks. The same bits as Step.
TEST_P(DecodeTest, FreshSessionsThroughTheSinksEqualStep) {
  constexpr int kItems = 3, kSteps = 7;
  std::vector<std::string> batched, stepped;
  for (int i = 0; i < kItems; ++i) {
    batched.push_back(Create(0, 0));
    stepped.push_back(Create(0, 0));
  }
  for (int64_t position = 0; position < kSteps; ++position) {
    v1::DecodeRequest decode = MakeDecode(batched, 1, std::vector<std::vector<int64_t>>(kItems, {position}),
                                          /*with_keys=*/true, 300 + position);
    auto result = handler_->Decode(decode);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->failed(), 0);
    const auto out = TensorFloats(result->output()), lse = TensorFloats(result->lse());
    for (int i = 0; i < kItems; ++i) {
      auto single = handler_->Step(StepOf(decode, stepped[i], i, 0, 1));
      ASSERT_TRUE(single.ok()) << single.status();
      const auto step_out = TensorFloats(single->result().output()), step_lse = TensorFloats(single->result().lse());
      EXPECT_EQ(0, std::memcmp(step_out.data(), out.data() + i * kQ * kDim, step_out.size() * 4))
          << "item " << i << " position " << position;
      EXPECT_EQ(0, std::memcmp(step_lse.data(), lse.data() + i * kQ, step_lse.size() * 4));
      EXPECT_EQ(result->tokens(i), position + 1);
    }
  }
}

// A Decode message whose tokens are the first past the sinks: they fit the
// key transform, which its attention uses before the layer holds it. The
// same bits as Append (with the same queries) and then Attend.
TEST_P(DecodeTest, TokensThatFitTheKeyTransformAreAttendedThroughIt) {
  constexpr int kItems = 2, kK = 16;  // kMinTransformTokens
  std::vector<std::string> batched, apart;
  std::vector<std::vector<int64_t>> positions;
  for (int i = 0; i < kItems; ++i) {
    batched.push_back(Create(4, 70 + i));  // the sink tokens only
    apart.push_back(Create(4, 70 + i));
    positions.emplace_back();
    for (int64_t p = 4; p < 4 + kK; ++p) positions.back().push_back(p);
  }
  v1::DecodeRequest decode = MakeDecode(batched, kK, positions, /*with_keys=*/true, 400);
  auto result = handler_->Decode(decode);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->failed(), 0);
  const auto out = TensorFloats(result->output()), lse = TensorFloats(result->lse());
  const auto q = TensorFloats(decode.queries()), k = TensorFloats(decode.keys()), v = TensorFloats(decode.values());
  const size_t item_q = kK * kQ * kDim, item_kv = kK * kKv * kDim;
  for (int i = 0; i < kItems; ++i) {
    auto slice = [&](const std::vector<float>& all, size_t n) {
      return std::vector<float>(all.begin() + i * n, all.begin() + (i + 1) * n);
    };
    v1::AppendRequest append = MakeAppend(apart[i], kLayer, 4, slice(k, item_kv), slice(v, item_kv), {kK, kKv, kDim});
    *append.mutable_queries() = MakeTensor(slice(q, item_q), {kK, kQ, kDim});
    ASSERT_TRUE(handler_->Append(append).ok());
    v1::AttendRequest attend;
    attend.set_session_id(apart[i]);
    attend.set_layer(kLayer);
    *attend.mutable_queries() = MakeTensor(slice(q, item_q), {kK, kQ, kDim});
    for (int64_t p : positions[i]) attend.add_positions(p);
    auto attended = handler_->Attend(attend);
    ASSERT_TRUE(attended.ok()) << attended.status();
    const auto expected = TensorFloats(attended->result().output()), expected_lse = TensorFloats(attended->result().lse());
    EXPECT_EQ(0, std::memcmp(expected.data(), out.data() + i * item_q, expected.size() * 4)) << "item " << i;
    EXPECT_EQ(0, std::memcmp(expected_lse.data(), lse.data() + i * kK * kQ, expected_lse.size() * 4));
  }
  v1::GetSessionRequest request;
  request.set_session_id(batched[0]);
  auto info = handler_->GetSession(request);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GT(info->transformed_layers(), 0);
}

// Forks share their source's partly filled last page: the Decode token of
// each of two forks in one message goes into its own copy of it, which its
// attention reads before the layer holds it. The same bits as Step on twin
// forks, each fork holding its own token after, and the source unchanged.
TEST_P(DecodeTest, ForksFirstTokensGoIntoCopiesOfTheirSharedLastPage) {
  constexpr int64_t kTokens = 37;  // pages of 16: the third partly filled
  const std::string source = Create(kTokens, 90);
  ASSERT_TRUE(handler_
                  ->Append(MakeAppend(source, 0, 0, GaussianVectors(kTokens * kKv, kDim, 91),
                                      GaussianVectors(kTokens * kKv, kDim, 92), {kTokens, kKv, kDim}))
                  .ok());
  auto attend = [&](const std::string& id) {
    v1::AttendRequest request;
    request.set_session_id(id);
    request.set_layer(kLayer);
    *request.mutable_queries() = MakeTensor(GaussianVectors(kQ, kDim, 93), {1, kQ, kDim});
    auto attended = handler_->Attend(request);
    EXPECT_TRUE(attended.ok()) << attended.status();
    return attended.ok() ? TensorFloats(attended->result().output()) : std::vector<float>();
  };
  const std::vector<float> source_before = attend(source);
  std::vector<std::string> forks;  // two decoded together, their twins stepped
  for (int i = 0; i < 4; ++i) {
    v1::ForkSessionRequest fork;
    fork.set_source_session_id(source);
    fork.set_prefix_tokens(kTokens);
    auto forked = handler_->ForkSession(fork);
    ASSERT_TRUE(forked.ok()) << forked.status();
    forks.push_back(forked->session_id());
  }
  v1::DecodeRequest decode = MakeDecode({forks[0], forks[1]}, 1, {{kTokens}, {kTokens}}, /*with_keys=*/true, 94);
  auto result = handler_->Decode(decode);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->failed(), 0);
  const auto out = TensorFloats(result->output());
  for (int i = 0; i < 2; ++i) {
    auto single = handler_->Step(StepOf(decode, forks[2 + i], i, 0, 1));
    ASSERT_TRUE(single.ok()) << single.status();
    const auto step_out = TensorFloats(single->result().output());
    EXPECT_EQ(0, std::memcmp(step_out.data(), out.data() + i * kQ * kDim, step_out.size() * 4)) << "item " << i;
    EXPECT_EQ(attend(forks[i]), attend(forks[2 + i])) << "fork " << i;
  }
  EXPECT_NE(attend(forks[0]), attend(forks[1]));
  EXPECT_EQ(attend(source), source_before);
  EXPECT_EQ(Tokens(source), kTokens);
}

TEST_P(DecodeTest, AttentionOnlyMessagesLeaveTheSessionsAsTheyAre) {
  const std::vector<std::string> ids = {Create(40, 1), Create(75, 2)};
  v1::DecodeRequest decode = MakeDecode(ids, 2, {{10, 39}, {0, 74}}, /*with_keys=*/false, 5);
  auto result = handler_->Decode(decode);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->failed(), 0);
  EXPECT_THAT(result->tokens(), ::testing::ElementsAre(40, 75));
  EXPECT_THAT(result->output().shape(), ::testing::ElementsAre(2, 2, kQ, kDim));
  EXPECT_THAT(result->lse().shape(), ::testing::ElementsAre(2, 2, kQ));
  // The same as Attend on each session.
  const auto out = TensorFloats(result->output());
  for (int i = 0; i < 2; ++i) {
    v1::AttendRequest attend;
    attend.set_session_id(ids[i]);
    attend.set_layer(kLayer);
    const auto q = TensorFloats(decode.queries());
    *attend.mutable_queries() =
        MakeTensor(std::vector<float>(q.begin() + i * 2 * kQ * kDim, q.begin() + (i + 1) * 2 * kQ * kDim), {2, kQ, kDim});
    attend.add_positions(decode.positions(2 * i));
    attend.add_positions(decode.positions(2 * i + 1));
    auto attended = handler_->Attend(attend);
    ASSERT_TRUE(attended.ok()) << attended.status();
    const auto expected = TensorFloats(attended->result().output());
    EXPECT_EQ(0, std::memcmp(expected.data(), out.data() + i * 2 * kQ * kDim, expected.size() * 4));
  }
  EXPECT_EQ(Tokens(ids[0]), 40);
  EXPECT_EQ(Tokens(ids[1]), 75);
}

TEST_P(DecodeTest, BadItemsFailAloneAndChangeNothing) {
  const std::string good_a = Create(30, 1), good_b = Create(50, 2), gap = Create(20, 3), repeat = Create(20, 4),
                    other_tenant = Create(20, 5, "tenant-b");
  // A session of another shape.
  auto odd = handler_->CreateSession(MakeCreate(kLayers, 2, kQ, kDim));
  ASSERT_TRUE(odd.ok());
  const std::vector<std::string> ids = {good_a,   "no-such-session", gap,   other_tenant,
                                        good_b,   odd->session_id(), good_a, repeat};
  // positions: the gap item starts past its layer's end; the repeat item
  // repeats stored position 10.
  v1::DecodeRequest decode =
      MakeDecode(ids, 1, {{30}, {0}, {25}, {20}, {50}, {0}, {31}, {10}}, /*with_keys=*/true, 9);
  auto result = handler_->Decode(decode);
  ASSERT_TRUE(result.ok()) << result.status();
  auto code = [&](int i) { return static_cast<absl::StatusCode>(result->status(i).code()); };
  EXPECT_EQ(code(0), absl::StatusCode::kOk);
  EXPECT_EQ(code(1), absl::StatusCode::kNotFound);
  EXPECT_EQ(code(2), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(result->status(2).message(), HasSubstr("missing"));
  EXPECT_EQ(code(3), absl::StatusCode::kNotFound);  // another tenant's session is unknown here
  EXPECT_EQ(code(4), absl::StatusCode::kOk);
  EXPECT_EQ(code(5), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result->status(5).message(), HasSubstr("share their shape"));
  EXPECT_EQ(code(6), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result->status(6).message(), HasSubstr("repeats session_ids[0]"));
  EXPECT_EQ(code(7), absl::StatusCode::kOk);  // a repeat is acknowledged, not stored twice
  EXPECT_EQ(result->failed(), 5);
  EXPECT_THAT(result->tokens(), ::testing::ElementsAre(31, 0, 20, 0, 51, 0, 0, 20));
  // Failed items left their sessions unchanged; their outputs are zeros.
  EXPECT_EQ(Tokens(gap), 20);
  EXPECT_EQ(Tokens(repeat), 20);
  v1::GetSessionRequest get;
  get.set_session_id(other_tenant);
  EXPECT_EQ(handler_->GetSession(get, "tenant-b")->layer_tokens(kLayer), 20);
  const auto out = TensorFloats(result->output()), lse = TensorFloats(result->lse());
  for (int i : {1, 2, 3, 5, 6}) {
    for (int x = 0; x < kQ * kDim; ++x) ASSERT_EQ(out[i * kQ * kDim + x], 0.0f);
    EXPECT_EQ(lse[i * kQ], -INFINITY);
  }

  // The good items equal a run without the bad ones, on twin sessions.
  const std::string twin_a = Create(30, 1), twin_b = Create(50, 2), twin_repeat = Create(20, 4);
  v1::DecodeRequest clean = MakeDecode({twin_a, twin_b, twin_repeat}, 1, {{30}, {50}, {10}}, true, 9);
  // The same inputs as items 0, 4 and 7 of the first message.
  const auto q = TensorFloats(decode.queries()), k = TensorFloats(decode.keys()), v = TensorFloats(decode.values());
  auto pick = [](const std::vector<float>& all, int heads, std::initializer_list<int> items) {
    std::vector<float> picked;
    for (int i : items) picked.insert(picked.end(), all.begin() + i * heads * kDim, all.begin() + (i + 1) * heads * kDim);
    return picked;
  };
  *clean.mutable_queries() = MakeTensor(pick(q, kQ, {0, 4, 7}), {3, kQ, kDim});
  *clean.mutable_keys() = MakeTensor(pick(k, kKv, {0, 4, 7}), {3, kKv, kDim});
  *clean.mutable_values() = MakeTensor(pick(v, kKv, {0, 4, 7}), {3, kKv, kDim});
  auto expected = handler_->Decode(clean);
  ASSERT_TRUE(expected.ok());
  const auto clean_out = TensorFloats(expected->output());
  const int kept[] = {0, 4, 7};
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(0, std::memcmp(clean_out.data() + c * kQ * kDim, out.data() + kept[c] * kQ * kDim, kQ * kDim * 4));
  }
}

TEST_P(DecodeTest, NonFiniteValuesFailTheirItemAlone) {
  const std::vector<std::string> ids = {Create(20, 1), Create(20, 2), Create(20, 3)};
  v1::DecodeRequest decode = MakeDecode(ids, 1, {{20}, {20}, {20}}, true, 4);
  std::vector<float> keys = TensorFloats(decode.keys());
  keys[kKv * kDim + 5] = NAN;  // item 1
  *decode.mutable_keys() = MakeTensor(keys, {3, kKv, kDim});
  std::vector<float> queries = TensorFloats(decode.queries());
  queries[2 * kQ * kDim] = INFINITY;  // item 2
  *decode.mutable_queries() = MakeTensor(queries, {3, kQ, kDim});
  auto result = handler_->Decode(decode);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->status(0).code(), 0);
  EXPECT_THAT(result->status(1).message(), HasSubstr("keys[1] value 5 is not finite"));
  EXPECT_THAT(result->status(2).message(), HasSubstr("queries[2] value 0 is not finite"));
  EXPECT_EQ(Tokens(ids[0]), 21);
  EXPECT_EQ(Tokens(ids[1]), 20);
  EXPECT_EQ(Tokens(ids[2]), 20);
}

TEST_P(DecodeTest, AnItemPastTheBudgetFailsAloneWithResourceExhausted) {
  // Pages of 16 tokens x 4 kv heads x (50 + 50) bytes (turbo3, d 128): the
  // budget holds exactly two, and the sessions' metadata.
  Init(2 * 16 * kKv * 100 + 2 * Meta(kLayers, kKv, kDim));
  const std::string full = Create(16, 1);     // its last page is full: the next token needs a new one
  const std::string partial = Create(10, 2);  // room left in its last page
  auto result = handler_->Decode(MakeDecode({full, partial}, 1, {{16}, {10}}, true, 3));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->failed(), 1);
  EXPECT_EQ(static_cast<absl::StatusCode>(result->status(0).code()), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(result->status(0).message(), HasSubstr("budget"));
  EXPECT_EQ(result->status(1).code(), 0);
  EXPECT_EQ(Tokens(full), 16);
  EXPECT_EQ(Tokens(partial), 11);
}

TEST_P(DecodeTest, MalformedMessagesAreRefusedWhole) {
  const std::vector<std::string> ids = {Create(20, 1), Create(20, 2)};
  auto refused = [&](v1::DecodeRequest request, const std::string& what) {
    auto result = handler_->Decode(request);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << what << ": " << result.status();
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(what));
  };
  const v1::DecodeRequest good = MakeDecode(ids, 1, {{20}, {20}}, true, 4);
  const std::vector<std::pair<std::function<void(v1::DecodeRequest*)>, std::string>> cases = {
      {[](v1::DecodeRequest* r) { r->clear_session_ids(); }, "session_ids"},
      {[](v1::DecodeRequest* r) { r->mutable_queries()->set_shape(0, 3); }, "queries.shape"},
      {[](v1::DecodeRequest* r) { r->add_positions(21); }, "positions"},
      {[](v1::DecodeRequest* r) { r->clear_values(); }, "keys are set without values"},
      {[](v1::DecodeRequest* r) { r->mutable_keys()->set_shape(0, 1); }, "keys.shape"},
      {[](v1::DecodeRequest* r) { r->mutable_options()->set_softcap(-1); }, "options.softcap"},
      {[](v1::DecodeRequest* r) { r->mutable_queries()->mutable_data()->resize(8); }, "queries"},
      {[](v1::DecodeRequest* r) { r->set_layer(-1); }, "layer"},
  };
  for (const auto& [mutate, what] : cases) {
    v1::DecodeRequest request = good;
    mutate(&request);
    refused(request, what);
  }
  EXPECT_EQ(Tokens(ids[0]), 20);
  EXPECT_EQ(Tokens(ids[1]), 20);
  // A layer past a session's layers fails that item only.
  v1::DecodeRequest past = good;
  past.set_layer(kLayers);
  auto result = handler_->Decode(past);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->failed(), 2);
  EXPECT_THAT(result->status(0).message(), HasSubstr("layer"));
}

TEST_P(DecodeTest, MetricsCountTheBatchAndEachFailedItemByCode) {
  Metrics metrics("cpu");
  HandlerOptions options;
  options.kernel_pool = &pool_;
  options.metrics = &metrics;
  Handler handler(store_.get(), options);
  const std::string id = Create(20, 1);
  ASSERT_TRUE(handler.Decode(MakeDecode({id, "no-such-session", "other"}, 1, {{20}, {0}, {0}}, true, 2)).ok());
  double batches = -1, not_found = -1, invalid = -1;
  for (const prometheus::MetricFamily& family : metrics.registry()->Collect()) {
    for (const prometheus::ClientMetric& metric : family.metric) {
      if (family.name == "turbokv_decode_batch_sessions") batches = metric.histogram.sample_count;
      if (family.name != "turbokv_decode_item_failures_total") continue;
      if (metric.label[0].value == "NOT_FOUND") not_found = metric.counter.value;
      if (metric.label[0].value == "INVALID_ARGUMENT") invalid = metric.counter.value;
    }
  }
  EXPECT_EQ(batches, 1);
  EXPECT_EQ(not_found, 2);
  EXPECT_EQ(invalid, 0);
}

TEST_P(DecodeTest, ConcurrentBatchesSharingSessionsInOppositeOrdersDoNotDeadlock) {
  std::vector<std::string> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(Create(20, i));
  const std::vector<std::string> reversed(ids.rbegin(), ids.rend());
  std::atomic<int> failures{0};
  auto run = [&](const std::vector<std::string>& order, uint64_t seed) {
    for (int step = 0; step < 40; ++step) {
      std::vector<std::vector<int64_t>> positions(order.size(), {5});
      auto result = handler_->Decode(MakeDecode(order, 1, positions, /*with_keys=*/false, seed + step));
      if (!result.ok() || result->failed() != 0) failures.fetch_add(1);
    }
  };
  std::thread a(run, ids, 1), b(run, reversed, 2);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace turbokv
