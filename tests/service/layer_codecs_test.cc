// Sessions whose layers use different codecs (config.layer_codecs, presets):
// every call on a mixed session gives, layer by layer, what a single-codec
// session of that layer's codecs gives; the layer table survives fork,
// truncate, snapshots and the spill tier; presets expand to the documented
// table; bad tables are refused naming the field.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/half.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "service/handler/handler.h"
#include "service/records/record_io.h"
#include "service/store/presets.h"
#include "service/store/snapshot.h"
#include "service/store/tiers/disk_tier.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"
#include "tests/service/backend_testing.h"
#include "tests/service/service_testing.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;
using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::MakeAppend;
using ::turbokv::testing::MakeCreate;
using ::turbokv::testing::MakeTensor;
using ::turbokv::testing::TensorFloats;

constexpr int kLayers = 3, kKv = 2, kQ = 4, kDim = 128, kPage = 16;

v1::LayerCodecs Range(int first, int last, v1::Codec key, v1::Codec value) {
  v1::LayerCodecs range;
  range.set_first_layer(first);
  range.set_last_layer(last);
  range.set_key_codec(key);
  range.set_value_codec(value);
  return range;
}

// A handler over a store with a snapshot dir and a spill tier in a fresh
// temporary folder; Reopen starts another store on the same folders.
class LayerCodecsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = testing::TestBackend(GetParam(), &pool_, kBudget);
    if (!backend.ok()) GTEST_SKIP() << GetParam() << " cannot serve here: " << backend.status().message();
    backend_ = *std::move(backend);
    dir_ = absl::StrCat(::testing::TempDir(), "layer-codecs-", getpid(), "-", count_++);
    mkdir(dir_.c_str(), 0755);
    mkdir((dir_ + "/snapshots").c_str(), 0755);
    Reopen(/*spill=*/false);
  }
  // A new store on the snapshot folder, and with spill: on the spill folder
  // too (its segments scanned).
  void Reopen(bool spill) {
    handler_.reset();
    store_.reset();
    StoreOptions options;
    options.backend = backend_.get();
    options.budget_bytes = kBudget;
    options.page_tokens = page_tokens_;
    options.snapshot_dir = dir_ + "/snapshots";
    std::unique_ptr<Tier> tier;
    if (spill) {
      DiskTierOptions disk;
      disk.dir = dir_ + "/spill";
      disk.page_tokens = page_tokens_;
      auto opened = DiskTier::Open(disk);
      ASSERT_TRUE(opened.ok()) << opened.status();
      tier = *std::move(opened);
    }
    store_ = std::make_unique<SessionStore>(options, std::move(tier));
    if (spill) {
      ASSERT_TRUE(store_->LoadTier(absl::Now()).ok());
    }
    HandlerOptions handler_options;
    handler_options.kernel_pool = &pool_;
    handler_options.max_tokens = 100000;
    handler_options.metrics = &metrics_;
    handler_ = std::make_unique<Handler>(store_.get(), handler_options);
  }

  std::string Create(const v1::CreateSessionRequest& request) {
    auto response = handler_->CreateSession(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? response->session_id() : "";
  }

  // The bytes of every page of `layer`, in order.
  std::string PageBytes(const std::string& id, int layer) {
    auto session = store_->Find(id, "", absl::Now());
    EXPECT_TRUE(session.ok()) << session.status();
    std::lock_guard<std::mutex> lock((*session)->mutex());
    const SessionCache* held[] = {session->get()};
    EXPECT_TRUE(store_->residency().Promote(**session, held, &pool_).ok());
    const LayerCache& cache = (*session)->layers()[layer];
    std::string bytes;
    for (const std::shared_ptr<Page>& page : cache.pages()) {
      EXPECT_TRUE(store_->backend()
                      .ReadPage(cache.page_format(), page->data,
                                [&](absl::string_view page_bytes) {
                                  bytes.append(page_bytes.data(), page_bytes.size());
                                  return absl::OkStatus();
                                })
                      .ok());
    }
    return bytes;
  }

  v1::AttendResponse Attend(const std::string& id, int layer, const std::vector<float>& q, int64_t position) {
    v1::AttendRequest request;
    request.set_session_id(id);
    request.set_layer(layer);
    *request.mutable_queries() = MakeTensor(q, {1, kQ, kDim});
    request.add_positions(position);
    auto response = handler_->Attend(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::AttendResponse();
  }

  v1::SessionInfo Info(const std::string& id) {
    v1::GetSessionRequest request;
    request.set_session_id(id);
    auto info = handler_->GetSession(request);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::SessionInfo();
  }

  static constexpr size_t kBudget = size_t{1} << 30;
  static inline int count_ = 0;
  std::string dir_;
  int page_tokens_ = kPage;  // the daemon's is 64: tokens held exact need more than 16 (HoldTokens)
  ThreadPool pool_{2};
  std::unique_ptr<Backend> backend_;
  Metrics metrics_{"cpu"};
  std::unique_ptr<SessionStore> store_;
  std::unique_ptr<Handler> handler_;
};

// Layer 0 in q8_0/q8_0, layer 1 the session's turbo3/turbo3, layer 2
// turbo4/f16: each layer equals, byte for byte and in attention, a
// single-codec session of its codecs fed the same tokens, before and after a
// fork, a truncate, a snapshot round trip and a trip through the spill tier.
TEST_P(LayerCodecsTest, EachLayerOfAMixedSessionIsItsCodecsSingleSession) {
  v1::CreateSessionRequest mixed_request = MakeCreate(kLayers, kKv, kQ, kDim);
  *mixed_request.mutable_config()->add_layer_codecs() = Range(2, 2, v1::CODEC_TURBO4, v1::CODEC_F16);
  *mixed_request.mutable_config()->add_layer_codecs() = Range(0, 0, v1::CODEC_Q8_0, v1::CODEC_Q8_0);
  const std::string mixed = Create(mixed_request);
  const std::vector<std::pair<v1::Codec, v1::Codec>> codecs = {
      {v1::CODEC_Q8_0, v1::CODEC_Q8_0}, {v1::CODEC_TURBO3, v1::CODEC_TURBO3}, {v1::CODEC_TURBO4, v1::CODEC_F16}};
  std::vector<std::string> single;
  for (const auto& [key, value] : codecs) single.push_back(Create(MakeCreate(kLayers, kKv, kQ, kDim, key, value)));

  const int64_t n = 70;
  const auto k = GaussianVectors(kLayers * n * kKv, kDim, 1), v = GaussianVectors(kLayers * n * kKv, kDim, 2);
  ASSERT_TRUE(handler_->Append(MakeAppend(mixed, -1, 0, k, v, {kLayers, n, kKv, kDim})).ok());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(handler_->Append(MakeAppend(single[l], -1, 0, k, v, {kLayers, n, kKv, kDim})).ok());
  }
  const auto q = GaussianVectors(kQ, kDim, 3);
  auto same = [&](const std::string& a, const std::string& b, int l, int64_t position, const char* when) {
    EXPECT_EQ(PageBytes(a, l), PageBytes(b, l)) << when << ", layer " << l;
    const v1::AttendResponse x = Attend(a, l, q, position), y = Attend(b, l, q, position);
    EXPECT_EQ(x.result().output().data(), y.result().output().data()) << when << ", layer " << l;
    EXPECT_EQ(x.result().lse().data(), y.result().lse().data()) << when << ", layer " << l;
  };
  for (int l = 0; l < kLayers; ++l) same(mixed, single[l], l, n - 1, "after the append");

  const v1::SessionInfo info = Info(mixed);
  ASSERT_EQ(info.layers_size(), kLayers);  // no two neighbours alike: one range each
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(info.layers(l).first_layer(), l);
    EXPECT_EQ(info.layers(l).last_layer(), l);
    EXPECT_EQ(info.layers(l).key_codec(), codecs[l].first) << l;
    EXPECT_EQ(info.layers(l).value_codec(), codecs[l].second) << l;
  }
  ASSERT_EQ(info.config().layer_codecs_size(), 2);
  EXPECT_EQ(info.config().layer_codecs(0).first_layer(), 0);  // sorted
  int64_t single_bytes = 0;
  for (int l = 0; l < kLayers; ++l) single_bytes += Info(single[l]).bytes_used() / kLayers;
  EXPECT_NEAR(info.bytes_used(), single_bytes, 3 * kPage * kKv * 256);
  // q8_0 keys and values (8.5 bits), turbo3 (3.125), turbo4 keys (4.125) and f16 values (16).
  EXPECT_NEAR(info.bits_per_value(), (8.5 * 2 + 3.125 * 2 + 4.125 + 16) / 6, 1e-9);

  v1::ForkSessionRequest fork;
  fork.set_source_session_id(mixed);
  fork.set_prefix_tokens(40);
  auto forked = handler_->ForkSession(fork);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->session().config().layer_codecs_size(), 2);
  for (int l = 0; l < kLayers; ++l) {
    const v1::AttendResponse x = Attend(forked->session_id(), l, q, 39), y = Attend(single[l], l, q, 39);
    EXPECT_EQ(x.result().output().data(), y.result().output().data()) << "fork, layer " << l;
  }

  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(mixed);
  truncate.set_tokens(50);
  ASSERT_TRUE(handler_->TruncateSession(truncate).ok());
  for (int l = 0; l < kLayers; ++l) {
    truncate.set_session_id(single[l]);
    ASSERT_TRUE(handler_->TruncateSession(truncate).ok());
    same(mixed, single[l], l, 49, "after the truncate");
  }

  // Decode: one message per layer over the mixed session and that layer's
  // single session, each storing one token at 50 and attending with it.
  for (int l = 0; l < kLayers; ++l) {
    v1::DecodeRequest decode;
    decode.set_layer(l);
    decode.add_session_ids(mixed);
    decode.add_session_ids(single[l]);
    decode.add_positions(50);
    decode.add_positions(50);
    const auto one_q = GaussianVectors(kQ, kDim, 10 + l), one_k = GaussianVectors(kKv, kDim, 20 + l),
               one_v = GaussianVectors(kKv, kDim, 30 + l);
    auto twice = [](std::vector<float> x) {
      x.insert(x.end(), x.begin(), x.end());
      return x;
    };
    *decode.mutable_queries() = MakeTensor(twice(one_q), {2, kQ, kDim});
    *decode.mutable_keys() = MakeTensor(twice(one_k), {2, kKv, kDim});
    *decode.mutable_values() = MakeTensor(twice(one_v), {2, kKv, kDim});
    auto decoded = handler_->Decode(decode);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    const std::string& out = decoded->output().data();
    ASSERT_EQ(out.size(), 2u * kQ * kDim * 4);
    EXPECT_EQ(out.substr(0, out.size() / 2), out.substr(out.size() / 2)) << "decode, layer " << l;
    EXPECT_EQ(PageBytes(mixed, l), PageBytes(single[l], l)) << "decode, layer " << l;
  }

  // Snapshots: written, then loaded by a new store (with a spill tier).
  auto saved = store_->SaveSnapshots();
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->sessions, 5) << (saved->failed.empty() ? "" : saved->failed[0].second.ToString());
  Reopen(/*spill=*/true);
  auto loaded = store_->LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->sessions, 5) << (loaded->failed.empty() ? "" : loaded->failed[0].second.ToString());
  EXPECT_EQ(Info(mixed).layers(2).value_codec(), v1::CODEC_F16);
  EXPECT_EQ(Info(single[1]).layers_size(), 1);  // one range over every layer
  for (int l = 0; l < kLayers; ++l) same(mixed, single[l], l, 50, "after a snapshot round trip");

  // The spill tier: demoted, then brought back by a call.
  for (const std::string& id : {mixed, single[0], single[1], single[2]}) {
    auto session = store_->Find(id, "", absl::Now());
    ASSERT_TRUE(session.ok());
    std::lock_guard<std::mutex> lock((*session)->mutex());
    ASSERT_TRUE(store_->residency().Demote(**session).ok());
  }
  ASSERT_TRUE(store_->residency().Flush(absl::InfiniteFuture()).ok());
  Reopen(/*spill=*/true);  // found again by the new store's scan of the segments
  EXPECT_EQ(Info(mixed).config().layer_codecs_size(), 2);
  for (int l = 0; l < kLayers; ++l) same(mixed, single[l], l, 50, "after the spill tier");
}

// Snapshots of format versions 1 (before per-layer codecs: no preset or
// ranges in its header) and 2 (before key transforms and sink tokens: no
// storage fields, no per-layer extras) still load, their sessions with the
// codecs they name, stored as given; a version this turbokvd does not know
// is DATA_LOSS naming the versions read.
TEST_P(LayerCodecsTest, SnapshotsOfVersionsOneAndTwoStillLoad) {
  v1::CreateSessionRequest create = MakeCreate(kLayers, kKv, kQ, kDim, v1::CODEC_Q8_0, v1::CODEC_TURBO4);
  // What those versions could hold: no transform, no sinks.
  create.mutable_config()->set_key_transform(v1::KEY_TRANSFORM_NONE);
  create.mutable_config()->set_sink_tokens(0);
  const std::string id = Create(create);
  const int64_t n = 40;
  const auto k = GaussianVectors(kLayers * n * kKv, kDim, 1), v = GaussianVectors(kLayers * n * kKv, kDim, 2);
  ASSERT_TRUE(handler_->Append(MakeAppend(id, -1, 0, k, v, {kLayers, n, kKv, kDim})).ok());
  const auto q = GaussianVectors(kQ, kDim, 3);
  const std::string before = Attend(id, 1, q, n - 1).result().output().data();
  ASSERT_TRUE(store_->SaveSnapshots().ok());
  const std::string path = dir_ + "/snapshots/" + id + kSnapshotSuffix;
  std::string file;
  {
    std::ifstream in(path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    file = bytes.str();
  }
  std::string header;
  {
    // Not held past this block: the session must go before its store does.
    auto session = store_->Find(id, "", absl::Now());
    ASSERT_TRUE(session.ok());
    PutSessionHeader(&header, SessionHeader{id, "", (*session)->config(), (*session)->created(), kPage});
  }
  ASSERT_EQ(file.substr(16, header.size()), header);
  // Version 3's session header ends in the storage fields (u8 transform, u8
  // center_values, i32 sink_tokens, u8 sink_codec: 7 bytes) and each layer's
  // extras follow the token counts (here u8 flags, i64 0 sinks, u32 0 bytes);
  // version 2 is without them, and version 1 also without the u16 0 (no
  // preset) and u32 0 (no ranges) before them.
  const size_t extras = kLayers * (1 + 8 + 4);
  auto older = [&](size_t header_cut, size_t at) {
    std::string out = file;
    uint32_t header_bytes = 0;
    std::memcpy(&header_bytes, &out[12], 4);
    out.erase(16 + header_bytes - extras, extras);
    out.erase(16 + at, header_cut);
    header_bytes -= static_cast<uint32_t>(header_cut + extras);
    std::memcpy(&out[12], &header_bytes, 4);
    return out;
  };
  auto write = [&](uint32_t version, const std::string& bytes) {
    std::string out = bytes;
    std::memcpy(&out[8], &version, 4);
    const uint32_t crc = Crc32c(absl::string_view(out.data(), out.size() - 4));
    std::memcpy(&out[out.size() - 4], &crc, 4);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  };
  for (uint32_t version : {1u, 2u}) {
    write(version, version == 2 ? older(7, header.size() - 7) : older(13, header.size() - 13));
    unlink((dir_ + "/snapshots/" + kManifestName).c_str());
    Reopen(/*spill=*/false);
    auto loaded = store_->LoadSnapshots(absl::Now());
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ASSERT_EQ(loaded->sessions, 1) << (loaded->failed.empty() ? "" : loaded->failed[0].second.ToString());
    const v1::SessionInfo info = Info(id);
    EXPECT_EQ(info.config().key_codec(), v1::CODEC_Q8_0) << version;
    EXPECT_EQ(info.config().value_codec(), v1::CODEC_TURBO4) << version;
    EXPECT_EQ(info.config().preset(), "") << version;
    EXPECT_EQ(info.config().layer_codecs_size(), 0) << version;
    EXPECT_EQ(info.config().key_transform(), v1::KEY_TRANSFORM_NONE) << version;
    EXPECT_EQ(info.config().sink_tokens(), 0) << version;
    EXPECT_EQ(Attend(id, 1, q, n - 1).result().output().data(), before) << version;
  }

  write(6, file);
  Reopen(/*spill=*/false);
  auto loaded = store_->LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->failed.size(), 1u);
  EXPECT_THAT(std::string(loaded->failed[0].second.message()), HasSubstr("snapshot format version 6, this turbokvd reads 1 to 5"));
}

TEST_P(LayerCodecsTest, TheLiveErrorIsTheErrorOfWhatIsStored) {
  const v1::Codec codecs[] = {v1::CODEC_F16,    v1::CODEC_Q8_0,   v1::CODEC_Q4_0,
                              v1::CODEC_TURBO2, v1::CODEC_TURBO3, v1::CODEC_TURBO4};
  const int layers = 6;
  for (int d : {64, 128}) {
    v1::CreateSessionRequest request = MakeCreate(layers, kKv, kQ, d);
    for (int l = 0; l < layers; ++l) *request.mutable_config()->add_layer_codecs() = Range(l, l, codecs[l], codecs[l]);
    // The encoders measure what the pages store: here the vectors as given.
    request.mutable_config()->set_key_transform(v1::KEY_TRANSFORM_NONE);
    request.mutable_config()->set_sink_tokens(0);
    const std::string id = Create(request);
    const int64_t n = 50;
    auto k = GaussianVectors(layers * n * kKv, d, 1), v = GaussianVectors(layers * n * kKv, d, 2);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 3.0f * v[i] + 0.5f;  // values off zero and larger
    ASSERT_TRUE(handler_->Append(MakeAppend(id, -1, 0, k, v, {layers, n, kKv, d})).ok());
    const v1::SessionInfo info = Info(id);
    ASSERT_EQ(info.key_errors_size(), layers);
    for (int l = 0; l < layers; ++l) {
      v1::ReadKvRequest read;
      read.set_session_id(id);
      read.add_layers(l);
      auto cursor = handler_->StartReadKv(read);
      ASSERT_TRUE(cursor.ok()) << cursor.status();
      std::vector<float> keys, values;
      v1::ReadKvResponse response;
      while (*handler_->NextReadKv(*cursor, &response)) {
        const auto rk = TensorFloats(response.keys()), rv = TensorFloats(response.values());
        keys.insert(keys.end(), rk.begin(), rk.end());
        values.insert(values.end(), rv.begin(), rv.end());
      }
      auto mean_error = [&](const std::vector<float>& stored, const std::vector<float>& original) {
        double sum = 0;
        const size_t vectors = stored.size() / d;
        for (size_t i = 0; i < vectors; ++i) {
          double diff = 0, norm = 0;
          for (int x = 0; x < d; ++x) {
            const double o = original[(l * vectors + i) * d + x];
            diff += (stored[i * d + x] - o) * (stored[i * d + x] - o);
            norm += o * o;
          }
          sum += std::sqrt(diff / norm);
        }
        return sum / vectors;
      };
      const double key_error = mean_error(keys, k), value_error = mean_error(values, v);
      EXPECT_NEAR(info.key_errors(l), key_error, 1e-4 * key_error + 1e-7) << CodecName(static_cast<CodecKind>(codecs[l])) << " d " << d;
      EXPECT_NEAR(info.value_errors(l), value_error, 1e-4 * value_error + 1e-7) << CodecName(static_cast<CodecKind>(codecs[l])) << " d " << d;
      EXPECT_GT(info.key_errors(l), 0);
    }
    EXPECT_EQ(info.fp16_saturated_fraction(), 0);
  }
  // Each codec's histogram counted every vector: keys and values, 2 sessions x 50 tokens x 2 kv heads.
  for (const prometheus::MetricFamily& family : metrics_.registry()->Collect()) {
    if (family.name != "turbokv_quantization_relative_error") continue;
    for (const prometheus::ClientMetric& metric : family.metric) EXPECT_EQ(metric.histogram.sample_count, 200u);
  }
}

// Each preset expands to its documented table, and is echoed by name.
TEST_P(LayerCodecsTest, PresetsExpandToTheirTables) {
  struct Expected {
    const char* preset;
    v1::Codec key, value;
    int boundary;  // layers at each end
    v1::Codec boundary_key, boundary_value;
    double bits;   // at 32 layers, d = 128
  };
  const Expected expected[] = {
      {"k8v4", v1::CODEC_Q8_0, v1::CODEC_TURBO4, 0, v1::CODEC_UNSPECIFIED, v1::CODEC_UNSPECIFIED, (8.5 + 4.125) / 2},
      {"k4v4", v1::CODEC_TURBO4, v1::CODEC_TURBO4, 0, v1::CODEC_UNSPECIFIED, v1::CODEC_UNSPECIFIED, 4.125},
      {"k4v3", v1::CODEC_TURBO4, v1::CODEC_TURBO3, 2, v1::CODEC_TURBO4, v1::CODEC_TURBO4,
       (28 * 3.625 + 4 * 4.125) / 32},
      {"k3v4", v1::CODEC_TURBO3, v1::CODEC_TURBO4, 2, v1::CODEC_TURBO4, v1::CODEC_TURBO4,
       (28 * 3.625 + 4 * 4.125) / 32},
      {"k3v3", v1::CODEC_TURBO3, v1::CODEC_TURBO3, 2, v1::CODEC_TURBO4, v1::CODEC_TURBO4,
       (28 * 3.125 + 4 * 4.125) / 32},
      {"k2v2", v1::CODEC_TURBO2, v1::CODEC_TURBO2, 2, v1::CODEC_TURBO4, v1::CODEC_TURBO4,
       (28 * 2.125 + 4 * 4.125) / 32},
  };
  ASSERT_EQ(Presets().size(), std::size(expected));
  for (const Expected& e : expected) {
    v1::CreateSessionRequest request = MakeCreate(32, 1, 1, kDim, v1::CODEC_UNSPECIFIED, v1::CODEC_UNSPECIFIED);
    request.mutable_config()->set_preset(e.preset);
    auto created = handler_->CreateSession(request);
    ASSERT_TRUE(created.ok()) << e.preset << ": " << created.status();
    const v1::SessionConfig& config = created->config();
    EXPECT_EQ(config.preset(), e.preset);
    EXPECT_EQ(config.key_codec(), e.key) << e.preset;
    EXPECT_EQ(config.value_codec(), e.value) << e.preset;
    ASSERT_EQ(config.layer_codecs_size(), e.boundary == 0 ? 0 : 2) << e.preset;
    if (e.boundary > 0) {
      EXPECT_EQ(config.layer_codecs(0).first_layer(), 0);
      EXPECT_EQ(config.layer_codecs(0).last_layer(), e.boundary - 1);
      EXPECT_EQ(config.layer_codecs(1).first_layer(), 32 - e.boundary);
      EXPECT_EQ(config.layer_codecs(1).last_layer(), 31);
      for (const v1::LayerCodecs& range : config.layer_codecs()) {
        EXPECT_EQ(range.key_codec(), e.boundary_key) << e.preset;
        EXPECT_EQ(range.value_codec(), e.boundary_value) << e.preset;
      }
    }
    EXPECT_NEAR(Info(created->session_id()).bits_per_value(), e.bits, 1e-9) << e.preset;
    // The returned config makes the same session again.
    v1::CreateSessionRequest again;
    *again.mutable_config() = config;
    auto remade = handler_->CreateSession(again);
    ASSERT_TRUE(remade.ok()) << e.preset << ": " << remade.status();
    EXPECT_EQ(remade->config().SerializeAsString(), config.SerializeAsString()) << e.preset;
  }
  // Fewer than 4 x boundary layers: none (the whole session in the preset's codecs).
  v1::CreateSessionRequest small = MakeCreate(kLayers, kKv, kQ, kDim, v1::CODEC_UNSPECIFIED, v1::CODEC_UNSPECIFIED);
  small.mutable_config()->set_preset("k3v3");
  auto created = handler_->CreateSession(small);
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->config().layer_codecs_size(), 0);
  // Neither codecs nor a preset: the default preset.
  v1::CreateSessionRequest plain = MakeCreate(32, 1, 1, kDim, v1::CODEC_UNSPECIFIED, v1::CODEC_UNSPECIFIED);
  created = handler_->CreateSession(plain);
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->config().preset(), kDefaultPreset);
  // A preset with layer_codecs: they replace its boundary layers.
  plain.mutable_config()->set_preset("k3v3");
  *plain.mutable_config()->add_layer_codecs() = Range(0, 0, v1::CODEC_F16, v1::CODEC_F16);
  created = handler_->CreateSession(plain);
  ASSERT_TRUE(created.ok());
  ASSERT_EQ(created->config().layer_codecs_size(), 1);
  EXPECT_EQ(created->config().layer_codecs(0).key_codec(), v1::CODEC_F16);
}

TEST_P(LayerCodecsTest, BadTablesAreRefusedNamingTheField) {
  struct Case {
    const char* message;
    void (*edit)(v1::SessionConfig&);
  };
  const Case cases[] = {
      {"config.preset = 'k5v5' is not a preset: use one of k8v4, k4v4, k4v3, k3v4, k3v3, k2v2",
       [](v1::SessionConfig& c) {
         c.clear_key_codec();
         c.clear_value_codec();
         c.set_preset("k5v5");
       }},
      {"config.preset = 'k3v3' sets the codecs",
       [](v1::SessionConfig& c) {
         c.clear_value_codec();
         c.set_preset("k3v3");
         c.set_key_codec(v1::CODEC_TURBO4);
       }},
      {"config.layer_codecs[0] names layers 1 to 3",
       [](v1::SessionConfig& c) { *c.add_layer_codecs() = Range(1, 3, v1::CODEC_Q8_0, v1::CODEC_Q8_0); }},
      {"config.layer_codecs[1] names layers 2 to 1",
       [](v1::SessionConfig& c) {
         *c.add_layer_codecs() = Range(0, 0, v1::CODEC_Q8_0, v1::CODEC_Q8_0);
         *c.add_layer_codecs() = Range(2, 1, v1::CODEC_Q8_0, v1::CODEC_Q8_0);
       }},
      {"config.layer_codecs: layers 0-1 and 1-2 overlap",
       [](v1::SessionConfig& c) {
         *c.add_layer_codecs() = Range(1, 2, v1::CODEC_Q8_0, v1::CODEC_Q8_0);
         *c.add_layer_codecs() = Range(0, 1, v1::CODEC_F16, v1::CODEC_F16);
       }},
      {"config.layer_codecs[0].value_codec = 99",
       [](v1::SessionConfig& c) { *c.add_layer_codecs() = Range(0, 0, v1::CODEC_Q8_0, static_cast<v1::Codec>(99)); }},
      {"config.key_transform = 9 is not a KeyTransform",
       [](v1::SessionConfig& c) { c.set_key_transform(static_cast<v1::KeyTransform>(9)); }},
      {"config.sink_tokens = 65 must be in [0, 64]", [](v1::SessionConfig& c) { c.set_sink_tokens(65); }},
      {"config.sink_tokens = -1", [](v1::SessionConfig& c) { c.set_sink_tokens(-1); }},
      {"config.sink_codec = 5 is not CODEC_F16 or CODEC_Q8_0",
       [](v1::SessionConfig& c) { c.set_sink_codec(v1::CODEC_TURBO3); }},
  };
  for (const Case& c : cases) {
    v1::CreateSessionRequest request = MakeCreate(kLayers, kKv, kQ, kDim);
    c.edit(*request.mutable_config());
    auto response = handler_->CreateSession(request);
    EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(response.status().message()), HasSubstr(c.message));
  }
  EXPECT_EQ(store_->session_count(), 0u);
}

// Keys made safe (docs/API.md): a layer's first tokens kept apart as sinks
// and the rest stored through a key transform come back through ReadKv as
// the vectors sent (the sinks to f16, the rest far closer than without the
// transform), attention equals float attention over what ReadKv gives, and
// both survive fork, truncate, a snapshot and the spill tier unchanged.
class StorageTest : public LayerCodecsTest {
 protected:
  // Every layer's tokens [0, n): keys [layers][n][kv][d] and values.
  std::pair<std::vector<float>, std::vector<float>> Read(const std::string& id, int layers) {
    std::vector<float> keys, values;
    for (int l = 0; l < layers; ++l) {
      v1::ReadKvRequest read;
      read.set_session_id(id);
      read.add_layers(l);
      auto cursor = handler_->StartReadKv(read);
      EXPECT_TRUE(cursor.ok()) << cursor.status();
      if (!cursor.ok()) break;
      v1::ReadKvResponse response;
      while (*handler_->NextReadKv(*cursor, &response)) {
        const auto k = TensorFloats(response.keys()), v = TensorFloats(response.values());
        keys.insert(keys.end(), k.begin(), k.end());
        values.insert(values.end(), v.begin(), v.end());
      }
    }
    return {keys, values};
  }
  v1::AttendResponse AttendWith(const std::string& id, int layer, const std::vector<float>& q,
                                const std::vector<int64_t>& positions, const v1::AttentionOptions& options) {
    v1::AttendRequest request;
    request.set_session_id(id);
    request.set_layer(layer);
    *request.mutable_queries() = MakeTensor(q, {static_cast<int64_t>(positions.size()), kQ, kDim});
    for (int64_t p : positions) request.add_positions(p);
    *request.mutable_options() = options;
    auto response = handler_->Attend(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::AttendResponse();
  }
  std::string CreateWith(v1::Codec codec, v1::KeyTransform transform, int sinks) {
    v1::CreateSessionRequest request = MakeCreate(kLayers, kKv, kQ, kDim, codec, codec);
    request.mutable_config()->set_key_transform(transform);
    request.mutable_config()->set_sink_tokens(sinks);
    return Create(request);
  }
};

double RelativeError(const std::vector<float>& x, const std::vector<float>& reference, size_t from, size_t to) {
  double err = 0, norm = 0;
  for (size_t i = from; i < to; ++i) {
    err += (double(x[i]) - reference[i]) * (double(x[i]) - reference[i]);
    norm += double(reference[i]) * reference[i];
  }
  return std::sqrt(err / norm);
}

TEST_P(StorageTest, SinksAndTransformGiveBackTheVectorsAndExactAttention) {
  constexpr int64_t n = 200, kSinks = 4;
  const size_t row = static_cast<size_t>(kKv) * kDim;
  const auto k = testing::SharedComponentVectors(kLayers * n, kKv, kDim, 300.0f, 1);
  const auto v = testing::SharedComponentVectors(kLayers * n, kKv, kDim, 3.0f, 2);
  const auto q_fit = testing::SharedComponentVectors(kLayers * n * (kQ / kKv), kKv, kDim, 6.0f, 3);
  const std::string safe = CreateWith(v1::CODEC_TURBO3, v1::KEY_TRANSFORM_UNSPECIFIED, kSinks);
  const std::string plain = CreateWith(v1::CODEC_TURBO3, v1::KEY_TRANSFORM_NONE, 0);
  for (const std::string& id : {safe, plain}) {
    v1::AppendRequest append = MakeAppend(id, -1, 0, k, v, {kLayers, n, kKv, kDim});
    *append.mutable_queries() = MakeTensor(q_fit, {kLayers, n, kQ, kDim});
    ASSERT_TRUE(handler_->Append(append).ok());
  }
  const v1::SessionInfo info = Info(safe);
  EXPECT_EQ(info.config().key_transform(), v1::KEY_TRANSFORM_CENTER_SCALE);
  EXPECT_EQ(info.config().sink_tokens(), kSinks);
  EXPECT_EQ(info.transformed_layers(), kLayers);
  EXPECT_EQ(Info(plain).transformed_layers(), 0);

  const auto [safe_k, safe_v] = Read(safe, kLayers);
  const auto [plain_k, plain_v] = Read(plain, kLayers);
  ASSERT_EQ(safe_k.size(), k.size());
  for (int l = 0; l < kLayers; ++l) {
    const size_t layer = static_cast<size_t>(l) * n * row;
    // The sinks as f16 holds them.
    for (size_t i = layer; i < layer + kSinks * row; ++i) {
      ASSERT_EQ(safe_k[i], HalfBitsToFloat(FloatToHalfBits(k[i]))) << "layer " << l << " value " << i - layer;
      ASSERT_EQ(safe_v[i], HalfBitsToFloat(FloatToHalfBits(v[i]))) << "layer " << l << " value " << i - layer;
    }
    // The rest: the transform's error is a small part of the plain codec's.
    const double with = RelativeError(safe_k, k, layer + kSinks * row, layer + n * row);
    const double without = RelativeError(plain_k, k, layer + kSinks * row, layer + n * row);
    EXPECT_LT(with, 0.3 * without) << "layer " << l;
    EXPECT_LT(RelativeError(safe_v, v, layer + kSinks * row, layer + n * row), 0.25) << "layer " << l;
  }

  // Attention equals float attention over what ReadKv gives (the held data).
  const auto q = testing::SharedComponentVectors(4 * (kQ / kKv), kKv, kDim, 6.0f, 4);
  const std::vector<int64_t> positions = {n - 1, 2, kSinks, 120};
  for (int variant = 0; variant < 2; ++variant) {
    v1::AttentionOptions options;
    AttentionParams params;
    params.q_heads = kQ;
    if (variant == 1) {
      options.set_softcap(30.0f);
      options.set_window(50);
      params.softcap = 30.0f;
      params.window = 50;
    }
    for (int l = 0; l < kLayers; ++l) {
      const size_t layer = static_cast<size_t>(l) * n * row;
      const std::vector<float> held_k(safe_k.begin() + layer, safe_k.begin() + layer + n * row);
      const std::vector<float> held_v(safe_v.begin() + layer, safe_v.begin() + layer + n * row);
      const testing::ReferenceResult ref =
          testing::ReferenceAttention(held_k, held_v, kKv, kDim, q, positions, params);
      const v1::AttendResponse got = AttendWith(safe, l, q, positions, options);
      EXPECT_LT(testing::RelativeL2(TensorFloats(got.result().output()), ref.out), 1e-3) << l << " " << variant;
      const auto lse = TensorFloats(got.result().lse());
      for (size_t i = 0; i < lse.size(); ++i) {
        EXPECT_NEAR(lse[i], ref.lse[i], 2e-3 * std::max(1.0, std::fabs(ref.lse[i]))) << l << " " << variant;
      }
    }
  }
}

TEST_P(StorageTest, SinksAndTransformSurviveForkTruncateSnapshotsAndTheSpillTier) {
  constexpr int64_t n = 100;
  const size_t row = static_cast<size_t>(kKv) * kDim;
  const auto k = testing::SharedComponentVectors(kLayers * n, kKv, kDim, 300.0f, 5);
  const auto v = testing::SharedComponentVectors(kLayers * n, kKv, kDim, 3.0f, 6);
  const std::string id = CreateWith(v1::CODEC_TURBO4, v1::KEY_TRANSFORM_UNSPECIFIED, 4);
  ASSERT_TRUE(handler_->Append(MakeAppend(id, -1, 0, k, v, {kLayers, n, kKv, kDim})).ok());
  const auto before = Read(id, kLayers);
  const auto q = GaussianVectors(kQ, kDim, 7);
  std::vector<std::string> outputs;
  for (int l = 0; l < kLayers; ++l) outputs.push_back(Attend(id, l, q, n - 1).result().output().data());

  // A fork into the sinks holds their first tokens and fits its own
  // transform from its next chunk; a truncate into them does the same.
  v1::ForkSessionRequest fork;
  fork.set_source_session_id(id);
  fork.set_prefix_tokens(2);
  auto forked = handler_->ForkSession(fork);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(Info(forked->session_id()).transformed_layers(), 0);
  const auto k2 = testing::SharedComponentVectors(kLayers * 60, kKv, kDim, 300.0f, 8);
  const auto v2 = testing::SharedComponentVectors(kLayers * 60, kKv, kDim, 3.0f, 9);
  ASSERT_TRUE(handler_->Append(MakeAppend(forked->session_id(), -1, 2, k2, v2, {kLayers, 60, kKv, kDim})).ok());
  EXPECT_EQ(Info(forked->session_id()).transformed_layers(), kLayers);
  const auto fork_read = Read(forked->session_id(), kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < 2 * row; ++i) {
      ASSERT_EQ(fork_read.first[l * 62 * row + i], before.first[l * n * row + i]) << "the fork's sinks, layer " << l;
    }
    double err = 0, norm = 0;
    for (size_t i = 4 * row; i < 62 * row; ++i) {
      const double x = k2[l * 60 * row + i - 2 * row], y = fork_read.first[l * 62 * row + i];
      err += (x - y) * (x - y);
      norm += x * x;
    }
    EXPECT_LT(std::sqrt(err / norm), 0.02) << "the fork's own tokens, layer " << l;
  }
  // The source is untouched by its fork.
  EXPECT_EQ(Read(id, kLayers), before);

  // Snapshot, then the spill tier: the same bytes come back and attend alike.
  ASSERT_TRUE(store_->SaveSnapshots().ok());
  Reopen(/*spill=*/true);
  auto loaded = store_->LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->sessions, 2) << (loaded->failed.empty() ? "" : loaded->failed[0].second.ToString());
  EXPECT_EQ(Read(id, kLayers), before);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(Attend(id, l, q, n - 1).result().output().data(), outputs[l]);
  {
    auto session = store_->Find(id, "", absl::Now());
    ASSERT_TRUE(session.ok());
    std::lock_guard<std::mutex> lock((*session)->mutex());
    ASSERT_TRUE(store_->residency().Demote(**session).ok());
  }
  EXPECT_EQ(Info(id).transformed_layers(), kLayers);  // said while on disk
  ASSERT_TRUE(store_->residency().Flush(absl::InfiniteFuture()).ok());
  Reopen(/*spill=*/true);
  EXPECT_EQ(Read(id, kLayers), before);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(Attend(id, l, q, n - 1).result().output().data(), outputs[l]);

  // Truncated into the sinks: the transform goes, the next chunk fits anew.
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(id);
  truncate.set_tokens(3);
  ASSERT_TRUE(handler_->TruncateSession(truncate).ok());
  EXPECT_EQ(Info(id).transformed_layers(), 0);
  ASSERT_TRUE(handler_->Append(MakeAppend(id, -1, 3, k2, v2, {kLayers, 60, kKv, kDim})).ok());
  EXPECT_EQ(Info(id).transformed_layers(), kLayers);
  const auto again = Read(id, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < 3 * row; ++i) ASSERT_EQ(again.first[l * 63 * row + i], before.first[l * n * row + i]);
  }
}

// A layer's first chunk past its sinks fits the transform only with 16 tokens
// or more: decoding from the first token leaves layers as given.
TEST_P(StorageTest, ShortFirstChunksLeaveTheLayerAsGiven) {
  const std::string id = CreateWith(v1::CODEC_TURBO3, v1::KEY_TRANSFORM_CENTER, 1);
  for (int64_t p = 0; p < 3; ++p) {
    v1::DecodeRequest decode;
    decode.set_layer(0);
    decode.add_session_ids(id);
    decode.add_positions(p);
    *decode.mutable_queries() = MakeTensor(GaussianVectors(kQ, kDim, 40 + p), {1, kQ, kDim});
    *decode.mutable_keys() = MakeTensor(GaussianVectors(kKv, kDim, 50 + p), {1, kKv, kDim});
    *decode.mutable_values() = MakeTensor(GaussianVectors(kKv, kDim, 60 + p), {1, kKv, kDim});
    auto decoded = handler_->Decode(decode);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_EQ(decoded->failed(), 0) << decoded->status(0).message();
  }
  EXPECT_EQ(Info(id).transformed_layers(), 0);
  // A prefill of 40 tokens fits one (layer 1), from its keys alone.
  const auto k = testing::SharedComponentVectors(40, kKv, kDim, 300.0f, 70), v = GaussianVectors(40 * kKv, kDim, 71);
  ASSERT_TRUE(handler_->Append(MakeAppend(id, 1, 0, k, v, {40, kKv, kDim})).ok());
  EXPECT_EQ(Info(id).transformed_layers(), 1);
  // Queries of the wrong shape are refused naming them.
  v1::AppendRequest bad = MakeAppend(id, 2, 0, k, v, {40, kKv, kDim});
  *bad.mutable_queries() = MakeTensor(GaussianVectors(40 * kKv, kDim, 72), {40, kKv, kDim});
  auto refused = handler_->Append(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("queries"));
}

// With the daemon's pages of 64 tokens, a layer whose transform is not
// fitted yet holds its tokens exact (up to 63): a short prompt or tokens
// decoded one at a time come back through ReadKv as f16 holds them, attend
// as float attention over them, survive a snapshot (format version 5 while
// a layer holds them) and the spill tier, and the chunk that takes a layer
// past them fits the transform on them all.
TEST_P(StorageTest, ShortPromptsAreHeldExactUntilTheFirstPageFills) {
  page_tokens_ = 64;
  Reopen(/*spill=*/false);
  const size_t row = static_cast<size_t>(kKv) * kDim;
  const std::string id = CreateWith(v1::CODEC_TURBO3, v1::KEY_TRANSFORM_UNSPECIFIED, 4);
  auto f16 = [](std::vector<float> x) {
    for (float& f : x) f = HalfBitsToFloat(FloatToHalfBits(f));
    return x;
  };
  // Layer 0: 5 tokens decoded one at a time; layer 1: a 20-token prompt;
  // layer 2: a 70-token prompt (fitted at once).
  const auto k = f16(testing::SharedComponentVectors(70, kKv, kDim, 300.0f, 80));
  const auto v = f16(GaussianVectors(70 * kKv, kDim, 81));
  for (int64_t p = 0; p < 5; ++p) {
    v1::DecodeRequest decode;
    decode.set_layer(0);
    decode.add_session_ids(id);
    decode.add_positions(p);
    *decode.mutable_queries() = MakeTensor(GaussianVectors(kQ, kDim, 82 + p), {1, kQ, kDim});
    *decode.mutable_keys() =
        MakeTensor(std::vector<float>(k.begin() + p * row, k.begin() + (p + 1) * row), {1, kKv, kDim});
    *decode.mutable_values() =
        MakeTensor(std::vector<float>(v.begin() + p * row, v.begin() + (p + 1) * row), {1, kKv, kDim});
    auto decoded = handler_->Decode(decode);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_EQ(decoded->failed(), 0) << decoded->status(0).message();
  }
  auto first = [&](const std::vector<float>& x, int64_t n) { return std::vector<float>(x.begin(), x.begin() + n * row); };
  ASSERT_TRUE(handler_->Append(MakeAppend(id, 1, 0, first(k, 20), first(v, 20), {20, kKv, kDim})).ok());
  ASSERT_TRUE(handler_->Append(MakeAppend(id, 2, 0, k, v, {70, kKv, kDim})).ok());
  EXPECT_EQ(Info(id).transformed_layers(), 1);
  auto check = [&](const char* when) {
    const auto read = Read(id, 2);
    ASSERT_EQ(read.first.size(), 25 * row) << when;
    EXPECT_EQ(std::vector<float>(read.first.begin(), read.first.begin() + 5 * row), first(k, 5)) << when;
    EXPECT_EQ(std::vector<float>(read.first.begin() + 5 * row, read.first.end()), first(k, 20)) << when;
    EXPECT_EQ(std::vector<float>(read.second.begin() + 5 * row, read.second.end()), first(v, 20)) << when;
  };
  check("in memory");
  // Attention over the 20 held tokens: float attention over them.
  const auto q = GaussianVectors(kQ, kDim, 90);
  const auto out = TensorFloats(Attend(id, 1, q, 19).result().output());
  for (int h = 0; h < kQ; ++h) {
    const int kv = h / (kQ / kKv);
    std::vector<double> logit(20);
    double top = -1e30, sum = 0;
    for (int t = 0; t < 20; ++t) {
      double dot = 0;
      for (int c = 0; c < kDim; ++c) dot += q[h * kDim + c] * k[t * row + kv * kDim + c];
      logit[t] = dot / std::sqrt(double{kDim});
      top = std::max(top, logit[t]);
    }
    std::vector<double> expected(kDim, 0.0);
    for (int t = 0; t < 20; ++t) {
      const double p = std::exp(logit[t] - top);
      sum += p;
      for (int c = 0; c < kDim; ++c) expected[c] += p * v[t * row + kv * kDim + c];
    }
    for (int c = 0; c < kDim; ++c) ASSERT_NEAR(out[h * kDim + c], expected[c] / sum, 1e-3) << "head " << h;
  }

  // A snapshot of a session holding tokens past its sinks is version 5.
  ASSERT_TRUE(store_->SaveSnapshots().ok());
  {
    std::ifstream in(dir_ + "/snapshots/" + id + kSnapshotSuffix, std::ios::binary);
    char start[12] = {};
    in.read(start, sizeof(start));
    uint32_t version = 0;
    std::memcpy(&version, start + 8, 4);
    EXPECT_EQ(version, 5u);
  }
  Reopen(/*spill=*/true);
  auto loaded = store_->LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->sessions, 1) << (loaded->failed.empty() ? "" : loaded->failed[0].second.ToString());
  check("from the snapshot");
  {
    auto session = store_->Find(id, "", absl::Now());
    ASSERT_TRUE(session.ok());
    std::lock_guard<std::mutex> lock((*session)->mutex());
    ASSERT_TRUE(store_->residency().Demote(**session).ok());
  }
  ASSERT_TRUE(store_->residency().Flush(absl::InfiniteFuture()).ok());
  Reopen(/*spill=*/true);
  check("from the spill tier");

  // Layer 1 past 63 tokens: fitted on its 66 tokens past the sinks, which
  // the pages now hold through the transform.
  const auto k2 = f16(testing::SharedComponentVectors(50, kKv, kDim, 300.0f, 80));
  ASSERT_TRUE(handler_->Append(MakeAppend(id, 1, 20, k2, first(v, 50), {50, kKv, kDim})).ok());
  EXPECT_EQ(Info(id).transformed_layers(), 2);
  v1::ReadKvRequest read;
  read.set_session_id(id);
  read.add_layers(1);
  auto cursor = handler_->StartReadKv(read);
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  std::vector<float> keys;
  v1::ReadKvResponse response;
  while (*handler_->NextReadKv(*cursor, &response)) {
    const auto part = TensorFloats(response.keys());
    keys.insert(keys.end(), part.begin(), part.end());
  }
  ASSERT_EQ(keys.size(), 70 * row);
  EXPECT_EQ(std::vector<float>(keys.begin(), keys.begin() + 4 * row), first(k, 4));  // the sinks
  std::vector<float> sent = first(k, 20);
  sent.insert(sent.end(), k2.begin(), k2.end());
  EXPECT_LT(RelativeError(keys, sent, 4 * row, 70 * row), 0.02);
}

INSTANTIATE_TEST_SUITE_P(Devices, StorageTest, ::testing::ValuesIn(testing::TestBackends()), testing::DeviceTestName);

INSTANTIATE_TEST_SUITE_P(Devices, LayerCodecsTest, ::testing::ValuesIn(testing::TestBackends()), testing::DeviceTestName);

}  // namespace
}  // namespace turbokv
