// The handler without a network: every documented status, all-or-nothing
// writes, idempotent appends, eviction, fork/truncate/read-back, attention
// against a float reference, and concurrent use.
#include "service/handler/handler.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/handler_testing.h"
#include "tests/service/service_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::MakeAppend;
using ::turbokv::testing::MakeCreate;
using ::turbokv::testing::MakeTensor;
using ::turbokv::testing::TensorFloats;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kLayers = 3, kKv = 2, kQ = 8, kDim = 128;

class HandlerTest : public ::turbokv::testing::DeviceHandlerFixture {
 protected:
  std::string Create(v1::Codec key = v1::CODEC_TURBO3, v1::Codec value = v1::CODEC_TURBO3) {
    auto response = handler_->CreateSession(MakeCreate(kLayers, kKv, kQ, kDim, key, value));
    EXPECT_TRUE(response.ok()) << response.status();
    return response->session_id();
  }

  absl::StatusOr<v1::AppendResponse> Append(const std::string& id, int layer, int64_t start, int64_t n,
                                            uint64_t seed) {
    const std::vector<float> k = GaussianVectors(n * kKv, kDim, seed), v = GaussianVectors(n * kKv, kDim, seed + 1);
    return handler_->Append(MakeAppend(id, layer, start, k, v, {n, kKv, kDim}));
  }

  v1::SessionInfo Info(const std::string& id) {
    v1::GetSessionRequest request;
    request.set_session_id(id);
    auto info = handler_->GetSession(request);
    EXPECT_TRUE(info.ok()) << info.status();
    return *info;
  }

  // Every message of a ReadKv call, concatenated.
  absl::StatusOr<std::pair<std::vector<float>, std::vector<float>>> Read(const v1::ReadKvRequest& request) {
    absl::StatusOr<ReadKvCursor> cursor = handler_->StartReadKv(request);
    if (!cursor.ok()) return cursor.status();
    std::pair<std::vector<float>, std::vector<float>> kv;
    for (;;) {
      v1::ReadKvResponse response;
      absl::StatusOr<bool> more = handler_->NextReadKv(*cursor, &response);
      if (!more.ok()) return more.status();
      if (!*more) return kv;
      const auto k = TensorFloats(response.keys()), v = TensorFloats(response.values());
      kv.first.insert(kv.first.end(), k.begin(), k.end());
      kv.second.insert(kv.second.end(), v.begin(), v.end());
    }
  }

};

TEST_P(HandlerTest, CreateFillsDefaultsAndGivesUnguessableIds) {
  v1::CreateSessionRequest request = MakeCreate(kLayers, kKv, kQ, kDim, v1::CODEC_UNSPECIFIED, v1::CODEC_TURBO4);
  request.mutable_config()->clear_rotation_seed();
  auto a = handler_->CreateSession(request);
  auto b = handler_->CreateSession(request);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->session_id().size(), 26u);
  EXPECT_NE(a->session_id(), b->session_id());
  EXPECT_EQ(a->config().key_codec(), v1::CODEC_TURBO3);
  EXPECT_EQ(a->config().value_codec(), v1::CODEC_TURBO4);
  EXPECT_EQ(a->config().max_tokens(), 100000);
  EXPECT_EQ(a->config().idle_ttl().seconds(), 3600);
  EXPECT_NE(a->config().rotation_seed(), b->config().rotation_seed());
}

TEST_P(HandlerTest, CreateRejectsBadConfigsNamingTheField) {
  struct Case {
    const char* field;
    void (*edit)(v1::CreateSessionRequest&);
  };
  const Case cases[] = {
      {"config.shape is not set", [](v1::CreateSessionRequest& r) { r.mutable_config()->clear_shape(); }},
      {"config.shape.layers", [](v1::CreateSessionRequest& r) { r.mutable_config()->mutable_shape()->set_layers(0); }},
      {"config.shape.kv_heads", [](v1::CreateSessionRequest& r) { r.mutable_config()->mutable_shape()->set_kv_heads(-1); }},
      {"config.shape.q_heads", [](v1::CreateSessionRequest& r) { r.mutable_config()->mutable_shape()->set_q_heads(3); }},
      {"config.shape.head_dim", [](v1::CreateSessionRequest& r) { r.mutable_config()->mutable_shape()->set_head_dim(100); }},
      {"config.key_codec", [](v1::CreateSessionRequest& r) { r.mutable_config()->set_key_codec(static_cast<v1::Codec>(99)); }},
      {"config.value_codec", [](v1::CreateSessionRequest& r) { r.mutable_config()->set_value_codec(static_cast<v1::Codec>(-2)); }},
      {"config.max_tokens", [](v1::CreateSessionRequest& r) { r.mutable_config()->set_max_tokens(200000); }},
      {"config.idle_ttl", [](v1::CreateSessionRequest& r) { r.mutable_config()->mutable_idle_ttl()->set_seconds(-5); }},
  };
  for (const Case& c : cases) {
    v1::CreateSessionRequest request = MakeCreate(kLayers, kKv, kQ, kDim);
    c.edit(request);
    auto response = handler_->CreateSession(request);
    EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(c.field));
  }
  EXPECT_EQ(store_->session_count(), 0u);
}

// A session the device cannot attend is refused when it is created, naming
// the limit, not at its first Attend.
TEST_P(HandlerTest, HeadDimsTheDeviceCannotAttendAreRefusedAtCreation) {
  auto mla = handler_->CreateSession(MakeCreate(1, 1, 16, 576));
  EXPECT_TRUE(mla.ok()) << mla.status();
  auto wide = handler_->CreateSession(MakeCreate(1, 1, 1, 1024));
  if (GetParam() == "cpu") {
    EXPECT_TRUE(wide.ok()) << wide.status();
    return;
  }
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(wide.status().message()), HasSubstr("head_dim = 1024: attention on the GPU"));
  EXPECT_THAT(std::string(wide.status().message()), HasSubstr("up to 576"));
}

TEST_P(HandlerTest, AppendIsIdempotentByPositionAndRejectsGaps) {
  const std::string id = Create();
  auto first = Append(id, 1, 0, 40, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->tokens(), 40);
  EXPECT_EQ(first->stored(), 40);
  auto repeat = Append(id, 1, 20, 30, 2);  // 20..39 repeated, 40..49 new
  ASSERT_TRUE(repeat.ok());
  EXPECT_EQ(repeat->tokens(), 50);
  EXPECT_EQ(repeat->stored(), 10);
  auto again = Append(id, 1, 0, 10, 3);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->stored(), 0);
  auto gap = Append(id, 1, 51, 5, 4);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(gap.status().message()), HasSubstr("positions 50 to 50 are missing"));
  EXPECT_EQ(Info(id).layer_tokens(1), 50);
  EXPECT_EQ(Info(id).layer_tokens(0), 0);
}

TEST_P(HandlerTest, AllLayersAppendStoresEveryLayer) {
  const std::string id = Create();
  const int64_t n = 20;
  const auto k = GaussianVectors(kLayers * n * kKv, kDim, 5), v = GaussianVectors(kLayers * n * kKv, kDim, 6);
  auto response = handler_->Append(MakeAppend(id, -1, 0, k, v, {kLayers, n, kKv, kDim}));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->tokens(), n);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(Info(id).layer_tokens(l), n);
  // Layer 2's slice landed in layer 2.
  v1::ReadKvRequest read;
  read.set_session_id(id);
  read.add_layers(2);
  auto kv = Read(read);
  ASSERT_TRUE(kv.ok());
  const std::vector<float> layer2(k.begin() + 2 * n * kKv * kDim, k.end());
  EXPECT_LT(testing::RelativeL2(kv->first, layer2), 0.25);
}

TEST_P(HandlerTest, BadAppendsAreRejectedNamingTheFieldAndChangeNothing) {
  const std::string id = Create();
  ASSERT_TRUE(Append(id, 0, 0, 8, 1).ok());
  const auto k = GaussianVectors(4 * kKv, kDim, 9), v = GaussianVectors(4 * kKv, kDim, 10);
  struct Case {
    const char* expect;
    absl::StatusCode code;
    void (*edit)(v1::AppendRequest&);
  };
  const Case cases[] = {
      {"no session", absl::StatusCode::kNotFound, [](v1::AppendRequest& r) { r.set_session_id("nope"); }},
      {"session_id is empty", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.clear_session_id(); }},
      {"layer = 7", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.set_layer(7); }},
      {"neither layer nor all_layers", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.clear_target(); }},
      {"start = -1", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.set_start(-1); }},
      {"keys.shape has 2", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_keys()->mutable_shape()->RemoveLast(); }},
      {"keys.shape is [4, 2, 64]", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_keys()->set_shape(2, 64); }},
      {"values.shape is [4, 1, 128]", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_values()->set_shape(1, 1); }},
      {"keys.dtype", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_keys()->set_dtype(v1::DTYPE_UNSPECIFIED); }},
      {"values.data holds", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_values()->mutable_data()->pop_back(); }},
      {"keys.data holds", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_keys()->set_dtype(v1::DTYPE_F16); }},
      {"keys.data value 5 is not finite", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) {
         const float nan = NAN;
         std::memcpy(&(*r.mutable_keys()->mutable_data())[20], &nan, 4);
       }},
      {"values.data value 3 is not finite", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) {
         const float inf = INFINITY;
         std::memcpy(&(*r.mutable_values()->mutable_data())[12], &inf, 4);
       }},
      {"expected at least 1", absl::StatusCode::kInvalidArgument, [](v1::AppendRequest& r) { r.mutable_keys()->set_shape(0, 0); }},
      {"positions 8 to 9 are missing", absl::StatusCode::kFailedPrecondition, [](v1::AppendRequest& r) { r.set_start(10); }},
      {"max_tokens = 100000", absl::StatusCode::kResourceExhausted, [](v1::AppendRequest& r) { r.set_start(99998); }},
      {"a chunk of 4 tokens at start = 9223372036854775806 goes past", absl::StatusCode::kResourceExhausted,
       [](v1::AppendRequest& r) { r.set_start(INT64_MAX - 1); }},
  };
  for (const Case& c : cases) {
    v1::AppendRequest request = MakeAppend(id, 0, 8, k, v, {4, kKv, kDim});
    c.edit(request);
    auto response = handler_->Append(request);
    EXPECT_EQ(response.status().code(), c.code) << c.expect << ": " << response.status();
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(c.expect));
    EXPECT_EQ(Info(id).layer_tokens(0), 8) << c.expect;
  }
}

TEST_P(HandlerTest, BudgetRejectNamesTheNumbersAndAllLayersIsAllOrNothing) {
  // One page: 16 tokens x 2 heads x (50 + 50 bytes) = 3200 bytes (turbo3, d 128).
  const size_t meta = Meta(kLayers, kKv, kDim);
  Init(3200 * 5 + 2 * meta);  // room for two sessions' metadata
  const std::string id = Create();
  const std::string other = Create();
  ASSERT_TRUE(Append(id, 0, 0, 32, 1).ok());  // 2 pages
  ASSERT_TRUE(Append(id, 1, 0, 32, 2).ok());  // 2 pages: 4 used, 1 left
  const int64_t n = 16;
  const auto k = GaussianVectors(kLayers * n * kKv, kDim, 3), v = GaussianVectors(kLayers * n * kKv, kDim, 4);
  // Layer 2 would need 2 pages for 0..31, layers 0/1 one each for 32..47: too many.
  auto over = handler_->Append(MakeAppend(id, -1, 32, k, v, {kLayers, n, kKv, kDim}));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kFailedPrecondition);  // layer 2 has a gap
  auto over2 = Append(id, 0, 32, 48, 5);  // 3 more pages
  EXPECT_EQ(over2.status().code(), absl::StatusCode::kResourceExhausted);
  const size_t used = 12800 + 2 * meta;
  EXPECT_THAT(std::string(over2.status().message()),
              HasSubstr(absl::StrCat(used, " bytes used, 9600 needed, budget ", 16000 + 2 * meta, " bytes")));
  EXPECT_EQ(Info(id).layer_tokens(0), 32);
  EXPECT_EQ(store_->pool().used_bytes(), used);

  // All layers at once that fits for two layers but not the third: nothing stored.
  const auto k2 = GaussianVectors(kLayers * 16 * kKv, kDim, 7), v2 = GaussianVectors(kLayers * 16 * kKv, kDim, 8);
  auto partial = handler_->Append(MakeAppend(other, -1, 0, k2, v2, {kLayers, 16, kKv, kDim}));
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kResourceExhausted);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(Info(other).layer_tokens(l), 0);
  EXPECT_EQ(store_->pool().used_bytes(), used);
}

TEST_P(HandlerTest, LruEvictsTheLeastRecentlyUsedIdleSession) {
  Init(3200 * 6 + 3 * Meta(kLayers, kKv, kDim), EvictionPolicy::kLru);
  const std::string old_one = Create(), recent = Create(), writer = Create();
  ASSERT_TRUE(Append(old_one, 0, 0, 32, 1).ok());  // 2 pages
  ASSERT_TRUE(Append(recent, 0, 0, 32, 2).ok());   // 2 pages
  Info(recent);                                    // used after old_one
  ASSERT_TRUE(Append(writer, 0, 0, 48, 3).ok());   // 3 pages: old_one must go
  v1::GetSessionRequest get;
  get.set_session_id(old_one);
  auto gone = handler_->GetSession(get);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("evicted"));
  EXPECT_EQ(Info(recent).layer_tokens(0), 32);
  EXPECT_EQ(store_->evictions(), 1);
  // Too big even with everything else evicted: refused, the writer keeps its tokens.
  auto huge = Append(writer, 1, 0, 2000, 4);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Info(writer).layer_tokens(0), 48);
}

TEST_P(HandlerTest, IdleSessionsExpireAfterTheirTtl) {
  v1::CreateSessionRequest request = MakeCreate(kLayers, kKv, kQ, kDim);
  request.mutable_config()->mutable_idle_ttl()->set_seconds(5);
  auto created = handler_->CreateSession(request);
  ASSERT_TRUE(created.ok());
  const std::string keeps = Create();  // the default ttl, an hour
  EXPECT_EQ(store_->ExpireIdle(absl::Now() + absl::Seconds(1)), 0);
  EXPECT_EQ(store_->ExpireIdle(absl::Now() + absl::Seconds(6)), 1);
  v1::GetSessionRequest get;
  get.set_session_id(created->session_id());
  auto gone = handler_->GetSession(get);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("expired after 5s idle"));
  EXPECT_EQ(Info(keeps).layer_tokens(0), 0);
}

TEST_P(HandlerTest, AttentionMatchesAFloatReferenceOverTheDecodedCache) {
  for (v1::Codec codec : {v1::CODEC_TURBO3, v1::CODEC_Q8_0, v1::CODEC_F16}) {
    const std::string id = Create(codec, v1::CODEC_TURBO4);
    const int64_t n = 300;
    ASSERT_TRUE(Append(id, 2, 0, n, 11).ok());
    v1::ReadKvRequest read;
    read.set_session_id(id);
    read.add_layers(2);
    auto kv = Read(read);
    ASSERT_TRUE(kv.ok()) << kv.status();

    const std::vector<float> q = GaussianVectors(3 * kQ, kDim, 12);
    v1::AttendRequest request;
    request.set_session_id(id);
    request.set_layer(2);
    *request.mutable_queries() = MakeTensor(q, {3, kQ, kDim});
    for (int64_t p : {0, 150, 299}) request.add_positions(p);
    request.mutable_options()->set_top_k(4);
    auto response = handler_->Attend(request);
    ASSERT_TRUE(response.ok()) << response.status();

    AttentionParams params;
    params.q_heads = kQ;
    const auto reference =
        testing::ReferenceAttention(kv->first, kv->second, kKv, kDim, q, {0, 150, 299}, params);
    EXPECT_LT(testing::RelativeL2(TensorFloats(response->result().output()), reference.out), 1e-3) << codec;
    EXPECT_LT(testing::RelativeL2(TensorFloats(response->result().lse()), reference.lse), 1e-4) << codec;
    ASSERT_EQ(response->result().top_k_tokens_size(), 3 * kQ * 4);
    EXPECT_EQ(response->result().top_k_tokens(0), 0);   // the first query sees only token 0
    EXPECT_EQ(response->result().top_k_tokens(1), -1);
    EXPECT_EQ(response->result().top_k_tokens(2 * kQ * 4), reference.logits[2 * kQ][0].second);
  }
}

TEST_P(HandlerTest, AttendChecksPositionsAndOptions) {
  const std::string id = Create();
  const std::vector<float> q = GaussianVectors(2 * kQ, kDim, 1);
  v1::AttendRequest request;
  request.set_session_id(id);
  request.set_layer(0);
  *request.mutable_queries() = MakeTensor(q, {2, kQ, kDim});
  EXPECT_EQ(handler_->Attend(request).status().code(), absl::StatusCode::kFailedPrecondition);  // empty layer
  ASSERT_TRUE(Append(id, 0, 0, 10, 2).ok());
  EXPECT_TRUE(handler_->Attend(request).ok());  // no positions: both see all 10
  struct Case {
    const char* expect;
    absl::StatusCode code;
    void (*edit)(v1::AttendRequest&);
  };
  const Case cases[] = {
      {"positions has 1 entries for 2 queries", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.add_positions(3); }},
      {"positions[1] = 10 is past the 10 tokens", absl::StatusCode::kFailedPrecondition, [](v1::AttendRequest& r) { r.add_positions(3); r.add_positions(10); }},
      {"positions[0] = -1", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.add_positions(-1); r.add_positions(1); }},
      {"options.softmax_scale", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.mutable_options()->set_softmax_scale(NAN); }},
      {"options.softcap", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.mutable_options()->set_softcap(-1); }},
      {"options.window", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.mutable_options()->set_window(-3); }},
      {"options.top_k", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.mutable_options()->set_top_k(5000); }},
      {"queries.shape is [2, 4, 128]", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.mutable_queries()->set_shape(1, 4); }},
      {"queries.data value", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) {
         const float nan = NAN;
         std::memcpy(&(*r.mutable_queries()->mutable_data())[0], &nan, 4);
       }},
      {"layer = 3", absl::StatusCode::kInvalidArgument, [](v1::AttendRequest& r) { r.set_layer(3); }},
      {"over the 67108864-byte message limit", absl::StatusCode::kResourceExhausted, [](v1::AttendRequest& r) {
         // 1000 queries with top_k 1024: about 100 MB of results.
         *r.mutable_queries() = MakeTensor(std::vector<float>(1000 * kQ * kDim, 0.5f), {1000, kQ, kDim});
         r.mutable_options()->set_top_k(1024);
       }},
  };
  for (const Case& c : cases) {
    v1::AttendRequest bad = request;
    c.edit(bad);
    auto response = handler_->Attend(bad);
    EXPECT_EQ(response.status().code(), c.code) << c.expect << ": " << response.status();
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(c.expect));
  }
}

// Every other request type, field by field: the status, the field named in
// the message, and the session unchanged afterwards.
TEST_P(HandlerTest, EveryRequestTypeRejectsBadFieldsAndChangesNothing) {
  const std::string id = Create();
  ASSERT_TRUE(Append(id, 0, 0, 40, 1).ok());
  ASSERT_TRUE(Append(id, 1, 0, 30, 2).ok());
  const size_t used = store_->pool().used_bytes();
  auto unchanged = [&](const std::string& what) {
    const v1::SessionInfo info = Info(id);
    EXPECT_EQ(info.layer_tokens(0), 40) << what;
    EXPECT_EQ(info.layer_tokens(1), 30) << what;
    EXPECT_EQ(info.layer_tokens(2), 0) << what;
    EXPECT_EQ(store_->pool().used_bytes(), used) << what;
    EXPECT_EQ(store_->session_count(), 1u) << what;
  };
  auto expect = [&](const absl::Status& status, absl::StatusCode code, const std::string& words) {
    EXPECT_EQ(status.code(), code) << words << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(words));
    unchanged(words);
  };

  // Step
  const auto k = GaussianVectors(kKv, kDim, 3), q = GaussianVectors(kQ, kDim, 4);
  v1::StepRequest step;
  step.set_session_id(id);
  step.set_layer(0);
  step.set_position(40);
  *step.mutable_key() = MakeTensor(k, {1, kKv, kDim});
  *step.mutable_value() = MakeTensor(k, {1, kKv, kDim});
  *step.mutable_query() = MakeTensor(q, {1, kQ, kDim});
  const std::vector<std::tuple<std::string, absl::StatusCode, std::function<void(v1::StepRequest&)>>> steps = {
      {"no session", absl::StatusCode::kNotFound, [](v1::StepRequest& r) { r.set_session_id("x"); }},
      {"layer = -1", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.set_layer(-1); }},
      {"position = -2", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.set_position(-2); }},
      {"positions 40 to 40 are missing", absl::StatusCode::kFailedPrecondition, [](v1::StepRequest& r) { r.set_position(41); }},
      {"position = 100000 is past the session's max_tokens", absl::StatusCode::kResourceExhausted, [](v1::StepRequest& r) { r.set_position(100000); }},
      {"key.shape is [2, 2, 128]", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.mutable_key()->set_shape(0, 2); }},
      {"value.dtype", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.mutable_value()->set_dtype(static_cast<v1::DType>(9)); }},
      {"query.shape is []", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.mutable_query()->clear_shape(); }},
      {"query.data value 1 is not finite", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) {
         const float inf = -INFINITY;
         std::memcpy(&(*r.mutable_query()->mutable_data())[4], &inf, 4);
       }},
      {"key.data value 0 is not finite", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) {
         const float nan = NAN;
         std::memcpy(&(*r.mutable_key()->mutable_data())[0], &nan, 4);
       }},
      {"options.top_k", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.mutable_options()->set_top_k(-1); }},
      {"options.softmax_scale", absl::StatusCode::kInvalidArgument, [](v1::StepRequest& r) { r.mutable_options()->set_softmax_scale(-1); }},
  };
  for (const auto& [words, code, edit] : steps) {
    v1::StepRequest bad = step;
    edit(bad);
    expect(handler_->Step(bad).status(), code, words);
  }

  // ReadKv
  v1::ReadKvRequest read;
  read.set_session_id(id);
  const std::vector<std::tuple<std::string, absl::StatusCode, std::function<void(v1::ReadKvRequest&)>>> reads = {
      {"session_id is empty", absl::StatusCode::kInvalidArgument, [](v1::ReadKvRequest& r) { r.clear_session_id(); }},
      {"layers[1] = 9", absl::StatusCode::kInvalidArgument, [](v1::ReadKvRequest& r) { r.add_layers(0); r.add_layers(9); }},
      {"start = -1", absl::StatusCode::kInvalidArgument, [](v1::ReadKvRequest& r) { r.set_start(-1); }},
      {"end = -4", absl::StatusCode::kInvalidArgument, [](v1::ReadKvRequest& r) { r.set_end(-4); }},
      {"range [0, 35) is past the 30 tokens of layer 1", absl::StatusCode::kFailedPrecondition, [](v1::ReadKvRequest& r) { r.set_end(35); }},
      {"range [31, 30) is past the 30 tokens of layer 1", absl::StatusCode::kFailedPrecondition, [](v1::ReadKvRequest& r) { r.set_start(31); }},
      {"dtype = 7", absl::StatusCode::kInvalidArgument, [](v1::ReadKvRequest& r) { r.set_dtype(static_cast<v1::DType>(7)); }},
      {"max_tokens_per_message = -1", absl::StatusCode::kInvalidArgument, [](v1::ReadKvRequest& r) { r.set_max_tokens_per_message(-1); }},
  };
  for (const auto& [words, code, edit] : reads) {
    v1::ReadKvRequest bad = read;
    edit(bad);
    expect(handler_->StartReadKv(bad).status(), code, words);
  }

  // Fork, Truncate, Get, Delete
  v1::ForkSessionRequest fork;
  fork.set_source_session_id(id);
  fork.set_prefix_tokens(-1);
  expect(handler_->ForkSession(fork).status(), absl::StatusCode::kInvalidArgument, "prefix_tokens = -1");
  fork.set_prefix_tokens(31);
  expect(handler_->ForkSession(fork).status(), absl::StatusCode::kFailedPrecondition, "prefix_tokens = 31 is past the 30 tokens of layer 1");
  fork.clear_source_session_id();
  expect(handler_->ForkSession(fork).status(), absl::StatusCode::kInvalidArgument, "session_id is empty");
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(id);
  truncate.set_tokens(-5);
  expect(handler_->TruncateSession(truncate).status(), absl::StatusCode::kInvalidArgument, "tokens = -5");
  truncate.set_session_id(id + "x");
  truncate.set_tokens(0);
  expect(handler_->TruncateSession(truncate).status(), absl::StatusCode::kNotFound, "no session");
  v1::GetSessionRequest get;
  expect(handler_->GetSession(get).status(), absl::StatusCode::kInvalidArgument, "session_id is empty");
  v1::DeleteSessionRequest del;
  expect(handler_->DeleteSession(del).status(), absl::StatusCode::kInvalidArgument, "session_id is empty");
  del.set_session_id(std::string(1000, 'z'));
  expect(handler_->DeleteSession(del).status(), absl::StatusCode::kNotFound, "no session");
  // Another tenant's calls find nothing.
  get.set_session_id(id);
  expect(handler_->GetSession(get, "other-tenant").status(), absl::StatusCode::kNotFound, "no session " + id);
}

TEST_P(HandlerTest, StepAppendsOneTokenAndAttendsWithIt) {
  const std::string id = Create();
  ASSERT_TRUE(Append(id, 1, 0, 50, 1).ok());
  const auto k = GaussianVectors(kKv, kDim, 2), v = GaussianVectors(kKv, kDim, 3), q = GaussianVectors(kQ, kDim, 4);
  v1::StepRequest step;
  step.set_session_id(id);
  step.set_layer(1);
  step.set_position(50);
  *step.mutable_key() = MakeTensor(k, {1, kKv, kDim});
  *step.mutable_value() = MakeTensor(v, {1, kKv, kDim});
  *step.mutable_query() = MakeTensor(q, {1, kQ, kDim});
  auto stepped = handler_->Step(step);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(stepped->tokens(), 51);
  // The same attention through Attend.
  v1::AttendRequest attend;
  attend.set_session_id(id);
  attend.set_layer(1);
  *attend.mutable_queries() = MakeTensor(q, {1, kQ, kDim});
  auto attended = handler_->Attend(attend);
  ASSERT_TRUE(attended.ok());
  EXPECT_EQ(attended->result().output().data(), stepped->result().output().data());
  // A repeated step is acknowledged without storing twice; a gap is refused
  // before anything is stored.
  EXPECT_EQ(handler_->Step(step)->tokens(), 51);
  step.set_position(53);
  EXPECT_EQ(handler_->Step(step).status().code(), absl::StatusCode::kFailedPrecondition);
  step.set_position(51);
  step.mutable_query()->set_shape(1, 3);
  EXPECT_EQ(handler_->Step(step).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Info(id).layer_tokens(1), 51);
}

TEST_P(HandlerTest, ReadKvRoundTripsWithinCodecToleranceInAnyDtypeAndMessageSize) {
  const std::string id = Create(v1::CODEC_F16, v1::CODEC_TURBO3);
  const int64_t n = 70;
  const auto k = GaussianVectors(n * kKv, kDim, 1), v = GaussianVectors(n * kKv, kDim, 2);
  ASSERT_TRUE(handler_->Append(MakeAppend(id, 0, 0, k, v, {n, kKv, kDim})).ok());
  v1::ReadKvRequest read;
  read.set_session_id(id);
  read.add_layers(0);
  read.set_max_tokens_per_message(16);
  absl::StatusOr<ReadKvCursor> cursor = handler_->StartReadKv(read);
  ASSERT_TRUE(cursor.ok());
  int messages = 0;
  v1::ReadKvResponse response;
  while (*handler_->NextReadKv(*cursor, &response)) ++messages;
  EXPECT_EQ(messages, 5);  // 16 + 16 + 16 + 16 + 6
  auto kv = Read(read);
  ASSERT_TRUE(kv.ok());
  EXPECT_LT(testing::RelativeL2(kv->first, k), 5e-4);   // f16 keys
  EXPECT_LT(testing::RelativeL2(kv->second, v), 0.2);   // turbo3 values: rel MSE ~0.034
  EXPECT_GT(testing::RelativeL2(kv->second, v), 0.1);

  // A sub-range, in bf16.
  read.set_start(10);
  read.set_end(20);
  read.set_dtype(v1::DTYPE_BF16);
  cursor = handler_->StartReadKv(read);
  ASSERT_TRUE(cursor.ok());
  ASSERT_TRUE(*handler_->NextReadKv(*cursor, &response));
  EXPECT_EQ(response.start(), 10);
  EXPECT_EQ(response.keys().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(response.keys().shape(0), 10);
  EXPECT_EQ(response.keys().data().size(), 10u * kKv * kDim * 2);

  read.set_end(71);
  EXPECT_EQ(handler_->StartReadKv(read).status().code(), absl::StatusCode::kFailedPrecondition);
  read.set_end(5);
  EXPECT_EQ(handler_->StartReadKv(read).status().code(), absl::StatusCode::kInvalidArgument);
  read.set_end(0);
  read.set_dtype(static_cast<v1::DType>(17));
  EXPECT_EQ(handler_->StartReadKv(read).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(HandlerTest, ForkSharesPagesAndDivergesAfterAppends) {
  const std::string source = Create();
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(Append(source, l, 0, 200, 10 + l).ok());
  const size_t before = store_->pool().used_bytes();
  v1::ForkSessionRequest fork_request;
  fork_request.set_source_session_id(source);
  fork_request.set_prefix_tokens(150);
  auto fork = handler_->ForkSession(fork_request);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(store_->pool().used_bytes(), before + ForkMeta(kLayers, kKv, kDim));  // no page copied
  EXPECT_EQ(fork->session().layer_tokens(2), 150);

  // Both append their own token 150 (the source's was already stored; the
  // fork writes a different one into a copy of the shared page).
  ASSERT_TRUE(Append(fork->session_id(), 0, 150, 10, 99).ok());
  const size_t page = 16 * kKv * 100;
  EXPECT_LE(store_->pool().used_bytes(), before + ForkMeta(kLayers, kKv, kDim) + page);  // one copied page
  v1::ReadKvRequest read;
  read.set_session_id(fork->session_id());
  read.add_layers(0);
  read.set_start(140);
  auto forked = Read(read);
  read.set_session_id(source);
  read.set_end(160);
  auto original = Read(read);
  ASSERT_TRUE(forked.ok() && original.ok());
  const size_t token = kKv * kDim;
  // Tokens 140..149 equal, 150..159 differ.
  EXPECT_TRUE(std::equal(forked->first.begin(), forked->first.begin() + 10 * token, original->first.begin()));
  EXPECT_FALSE(std::equal(forked->first.begin() + 10 * token, forked->first.end(), original->first.begin() + 10 * token));
  EXPECT_EQ(Info(source).layer_tokens(0), 200);

  fork_request.set_prefix_tokens(201);
  EXPECT_EQ(handler_->ForkSession(fork_request).status().code(), absl::StatusCode::kFailedPrecondition);
  fork_request.set_source_session_id("missing");
  EXPECT_EQ(handler_->ForkSession(fork_request).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(HandlerTest, TruncateAndDeleteReturnMemory) {
  const std::string id = Create();
  ASSERT_TRUE(Append(id, 0, 0, 100, 1).ok());
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(id);
  truncate.set_tokens(20);
  auto truncated = handler_->TruncateSession(truncate);
  ASSERT_TRUE(truncated.ok());
  EXPECT_EQ(truncated->layer_tokens(0), 20);
  EXPECT_EQ(store_->pool().used_bytes(), 2u * 3200 + Meta(kLayers, kKv, kDim));
  ASSERT_TRUE(Append(id, 0, 20, 5, 2).ok());  // rewrites after the rollback
  truncate.set_tokens(-1);
  EXPECT_EQ(handler_->TruncateSession(truncate).status().code(), absl::StatusCode::kInvalidArgument);

  v1::DeleteSessionRequest del;
  del.set_session_id(id);
  EXPECT_TRUE(handler_->DeleteSession(del).ok());
  EXPECT_EQ(store_->pool().used_bytes(), 0u);
  EXPECT_EQ(handler_->DeleteSession(del).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Append(id, 0, 25, 1, 3).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(HandlerTest, StatsCountSharedPagesOnce) {
  const std::string id = Create();
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(Append(id, l, 0, 64, l).ok());  // 4 pages each
  v1::ForkSessionRequest fork;
  fork.set_source_session_id(id);
  fork.set_prefix_tokens(64);
  auto forked = handler_->ForkSession(fork);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->session().bytes_used(), kLayers * 4 * 3200);  // the fork holds the same pages
  auto stats = handler_->Stats(v1::StatsRequest());
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions(), 2);
  EXPECT_EQ(stats->tokens(), 2 * kLayers * 64);
  // Pages once, each session's metadata, and what the fork shares of it once.
  const size_t used = kLayers * 4 * 3200 + Meta(kLayers, kKv, kDim) + ForkMeta(kLayers, kKv, kDim);
  EXPECT_EQ(stats->bytes_used(), used);
  EXPECT_EQ(stats->fp16_bytes(), 2 * kLayers * 64 * kKv * kDim * 4);
  EXPECT_NEAR(stats->compression_ratio(), 2.0 * kLayers * 64 * kKv * kDim * 4 / used, 1e-9);
}

TEST_P(HandlerTest, ManySessionsFromManyThreads) {
  constexpr int kThreads = 6, kRounds = 8;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  const std::string shared = Create();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string id = Create();
      for (int r = 0; r < kRounds; ++r) {
        if (!Append(id, r % kLayers, (r / kLayers) * 32, 32, t * 100 + r).ok()) ++failures;
        // Everyone appends the same positions to the shared session: each is stored once.
        if (!Append(shared, 0, r * 8, 8, r).ok()) ++failures;
        v1::AttendRequest attend;
        attend.set_session_id(id);
        attend.set_layer(r % kLayers);
        *attend.mutable_queries() = MakeTensor(GaussianVectors(kQ, kDim, r), {1, kQ, kDim});
        if (!handler_->Attend(attend).ok()) ++failures;
      }
      v1::ForkSessionRequest fork;
      fork.set_source_session_id(id);
      fork.set_prefix_tokens(32);
      auto forked = handler_->ForkSession(fork);
      if (!forked.ok()) ++failures;
      for (const std::string& gone : {id, forked.ok() ? forked->session_id() : std::string()}) {
        v1::DeleteSessionRequest del;
        del.set_session_id(gone);
        if (!handler_->DeleteSession(del).ok()) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(Info(shared).layer_tokens(0), kRounds * 8);
  EXPECT_EQ(store_->session_count(), 1u);
  EXPECT_EQ(store_->pool().used_bytes(), 4u * 3200 + Meta(kLayers, kKv, kDim));  // the shared session's 64 tokens
}

TEST_P(HandlerTest, LruEvictsNothingWhenEvictingCannotMakeRoom) {
  // Eight idle sessions of 2 pages each, and a writer.
  const size_t meta = Meta(kLayers, kKv, kDim);
  Init(3200 * 20 + 9 * meta, EvictionPolicy::kLru);
  std::vector<std::string> idle;
  for (int s = 0; s < 8; ++s) {
    idle.push_back(Create());
    ASSERT_TRUE(Append(idle.back(), 0, 0, 32, s).ok());
  }
  const std::string writer = Create();
  // More than the whole budget: refused at once, nobody evicted.
  auto huge = Append(writer, 0, 0, static_cast<int64_t>(16 * (21 + 9 * meta / 3200)), 100);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("nothing was evicted"));
  for (const std::string& id : idle) EXPECT_EQ(Info(id).layer_tokens(0), 32) << id;
  EXPECT_EQ(store_->evictions(), 0);

  // Forks of a writer share its pages: evicting them frees only their
  // metadata, not the pages an append needs.
  Init(3200 * 17 + 5 * meta, EvictionPolicy::kLru);
  const std::string source = Create();
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(Append(source, l, 0, 16 * 5, 102 + l).ok());  // 15 pages, 2 left
  std::vector<std::string> forks;
  for (int f = 0; f < 4; ++f) {
    v1::ForkSessionRequest fork;
    fork.set_source_session_id(source);
    fork.set_prefix_tokens(16 * 5);
    auto forked = handler_->ForkSession(fork);
    ASSERT_TRUE(forked.ok()) << forked.status();
    forks.push_back(forked->session_id());
  }
  // More pages than the 2 left and the forks' metadata hold, less than the budget.
  const int64_t pages = static_cast<int64_t>((4 * meta + 2 * 3200) / 3200) + 2;
  auto more = Append(source, 0, 16 * 5, 16 * pages, 110);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(more.status().message()), HasSubstr("so none was evicted"));
  for (const std::string& id : forks) EXPECT_EQ(Info(id).layer_tokens(0), 16 * 5) << id;
  EXPECT_EQ(store_->evictions(), 0);
}

TEST_P(HandlerTest, ValuesACodecWouldSaturateAreRefusedNamingWhere) {
  const std::string turbo = Create(), f16 = Create(v1::CODEC_F16, v1::CODEC_Q8_0);
  ASSERT_TRUE(Append(turbo, 0, 0, 8, 1).ok());
  const int64_t n = 4;
  // Valid f16 input (|x| < 65504) whose 128-value blocks have norms near
  // 1e5: a turbo block scale past fp16.
  std::vector<float> k = GaussianVectors(n * kKv, kDim, 2), v = GaussianVectors(n * kKv, kDim, 3);
  for (size_t i = kKv * kDim * 2; i < kKv * kDim * 3; ++i) k[i] *= 1e4f;  // position 10 (the third token)
  auto refused = handler_->Append(MakeAppend(turbo, 0, 8, k, v, {n, kKv, kDim}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("keys of layer 0, position 10, kv head 0"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("norm"));
  EXPECT_EQ(Info(turbo).layer_tokens(0), 8);
  // At the bound the check row by row decides (the SIMD one leaves it a
  // margin): a block norm of 32769 is refused, one of 32767 stored.
  std::vector<float> edge(static_cast<size_t>(kKv) * kDim, 0.0f), zeros(edge.size(), 0.0f);
  edge[kDim + 5] = 32769.0f;
  refused = handler_->Append(MakeAppend(turbo, 0, 8, edge, zeros, {1, kKv, kDim}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("position 8, kv head 1: a block of 128 values has norm 32769"));
  edge[kDim + 5] = 32767.0f;
  EXPECT_TRUE(handler_->Append(MakeAppend(turbo, 0, 8, edge, zeros, {1, kKv, kDim})).ok());
  EXPECT_EQ(Info(turbo).layer_tokens(0), 9);
  // Every layer at once: layer 0 passes whole, the fault is named in layer 1.
  const std::string all = Create();
  std::vector<float> layers_k = GaussianVectors(kLayers * 2 * kKv, kDim, 5);
  const std::vector<float> layers_v = GaussianVectors(kLayers * 2 * kKv, kDim, 6);
  // Layer 1, position 1, kv head 1: [layers][tokens][kv heads][head_dim].
  for (int i = 0; i < kDim; ++i) layers_k[((1 * 2 + 1) * kKv + 1) * kDim + i] *= 1e4f;
  refused = handler_->Append(MakeAppend(all, -1, 0, layers_k, layers_v, {kLayers, 2, kKv, kDim}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("keys of layer 1, position 1, kv head 1: a block"));
  EXPECT_EQ(Info(all).layer_tokens(0), 0);
  // The same values in f16 keys are fine; past fp16's range they are not.
  EXPECT_TRUE(handler_->Append(MakeAppend(f16, 0, 0, k, v, {n, kKv, kDim})).ok());
  v[5] = 3e38f;
  refused = handler_->Append(MakeAppend(f16, 0, 4, k, v, {n, kKv, kDim}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("values of layer 0, position 4, kv head 0 holds"));
  EXPECT_EQ(Info(f16).layer_tokens(0), 4);

  // A softmax scale that would overflow the scores.
  v1::AttendRequest attend;
  attend.set_session_id(turbo);
  *attend.mutable_queries() = MakeTensor(GaussianVectors(kQ, kDim, 4), {1, kQ, kDim});
  attend.mutable_options()->set_softmax_scale(3e38f);
  auto overflow = handler_->Attend(attend);
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(overflow.status().message()), HasSubstr("options.softmax_scale"));
  attend.mutable_options()->set_softmax_scale(0.5f);
  auto fine = handler_->Attend(attend);
  ASSERT_TRUE(fine.ok()) << fine.status();
  for (float x : TensorFloats(fine->result().output())) ASSERT_TRUE(std::isfinite(x));
}

TEST_P(HandlerTest, ReadKvRefusesRepeatedLayersKeepsItsSessionAndSaysWhyItWent) {
  Init(3200 * 4 + 2 * Meta(kLayers, kKv, kDim), EvictionPolicy::kLru);
  const std::string id = Create();
  ASSERT_TRUE(Append(id, 0, 0, 32, 1).ok());
  v1::ReadKvRequest read;
  read.set_session_id(id);
  read.add_layers(0);
  read.add_layers(0);
  auto twice = handler_->StartReadKv(read);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("listed twice"));
  read.clear_layers();
  read.set_max_tokens_per_message(16);
  auto cursor = handler_->StartReadKv(read);
  ASSERT_TRUE(cursor.ok());
  // A session being read is in a call: another session's write that would
  // need its room is refused, not given it.
  const std::string other = Create();
  const absl::Status refused = Append(other, 0, 0, 48, 2).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  v1::ReadKvResponse response;
  auto next = handler_->NextReadKv(*cursor, &response);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(*next);
  // Deleted while being read: the next message says so.
  v1::DeleteSessionRequest del;
  del.set_session_id(id);
  ASSERT_TRUE(handler_->DeleteSession(del).ok());
  next = handler_->NextReadKv(*cursor, &response);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("while being read"));
}

TEST_P(HandlerTest, AReadKvTokenLargerThanAReplyIsRefused) {
  HandlerOptions options;
  options.max_message_bytes = 1024;  // one f32 token of 2 kv heads x 128 is 2,048 bytes of keys and values
  handler_ = std::make_unique<Handler>(store_.get(), options);
  const std::string id = Create();
  ASSERT_TRUE(Append(id, 0, 0, 4, 1).ok());
  v1::ReadKvRequest read;
  read.set_session_id(id);
  auto refused = handler_->StartReadKv(read);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("more than a reply may carry"));
}

TEST_P(HandlerTest, SessionsAreCappedPerDaemonAndPerTenant) {
  StoreOptions store_options;
  store_options.backend = backend_.get();
  store_options.page_tokens = 16;
  store_options.max_sessions = 3;
  store_options.max_tenant_sessions = 2;
  store_ = std::make_unique<SessionStore>(store_options);
  handler_ = std::make_unique<Handler>(store_.get(), HandlerOptions());
  const v1::CreateSessionRequest create = MakeCreate(kLayers, kKv, kQ, kDim);
  ASSERT_TRUE(handler_->CreateSession(create, "a").ok());
  ASSERT_TRUE(handler_->CreateSession(create, "a").ok());
  auto third = handler_->CreateSession(create, "a");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("--max-tenant-sessions"));
  ASSERT_TRUE(handler_->CreateSession(create, "b").ok());
  auto fourth = handler_->CreateSession(create, "c");
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(fourth.status().message()), HasSubstr("--max-sessions"));
}

TEST_P(HandlerTest, SnapshotIsForTheAdminTenantOnly) {
  StoreOptions store_options;
  store_options.backend = backend_.get();
  store_options.snapshot_dir = ::testing::TempDir();
  store_ = std::make_unique<SessionStore>(store_options);
  HandlerOptions options;
  options.snapshot_tenant = "ops";
  handler_ = std::make_unique<Handler>(store_.get(), options);
  auto refused = handler_->Snapshot(v1::SnapshotRequest(), "tenant-b");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(refused.status().message()), Not(HasSubstr(store_options.snapshot_dir)));
  EXPECT_TRUE(handler_->Snapshot(v1::SnapshotRequest(), "ops").ok());
  options.snapshot_tenant = "";
  handler_ = std::make_unique<Handler>(store_.get(), options);
  EXPECT_EQ(handler_->Snapshot(v1::SnapshotRequest(), "ops").status().code(), absl::StatusCode::kPermissionDenied);
}

INSTANTIATE_TEST_SUITE_P(Devices, HandlerTest, ::testing::ValuesIn(testing::TestBackends()), testing::DeviceTestName);

// The reply a call will produce counts against the tenant's in-flight bound
// from its admission: queries x heads x (4 x head_dim + 4 + 12 x top_k)
// bytes, and for Decode a line a session. Results that go to the caller's
// shared memory (output_to) do not travel in the reply: only the top-k
// lists count.
TEST(ReplyBytesTest, ResultsInSharedMemoryCountOnlyWhatTravelsInTheReply) {
  constexpr int64_t kN = 3, kQ = 8, kD = 128, kTopK = 5;
  for (const bool shared : {false, true}) {
    v1::AttendRequest attend;
    for (int64_t dim : {kN, kQ, kD}) attend.mutable_queries()->add_shape(dim);
    attend.mutable_options()->set_top_k(kTopK);
    if (shared) attend.mutable_output_to()->set_region("r");
    const int64_t results = shared ? 0 : kN * kQ * (4 * kD + 4);
    EXPECT_EQ(Handler::ReplyBytes(attend), results + kN * kQ * 12 * kTopK) << shared;

    v1::DecodeRequest decode;
    for (int i = 0; i < kN; ++i) decode.add_session_ids("s");
    for (int64_t dim : {kN, int64_t{1}, kQ, kD}) decode.mutable_queries()->add_shape(dim);
    if (shared) decode.mutable_output_to()->set_region("r");
    EXPECT_EQ(Handler::ReplyBytes(decode), results + kN * 160) << shared;
  }
}

}  // namespace
}  // namespace turbokv
