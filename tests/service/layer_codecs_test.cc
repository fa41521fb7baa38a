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
#include "tests/service/backend_testing.h"
#include "kernels/cpu/thread_pool.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "service/handler/handler.h"
#include "service/store/presets.h"
#include "service/store/record_io.h"
#include "service/store/snapshot.h"
#include "service/store/tiers/disk_tier.h"
#include "tests/kernels/codec_testing.h"
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
    options.page_tokens = kPage;
    options.snapshot_dir = dir_ + "/snapshots";
    std::unique_ptr<Tier> tier;
    if (spill) {
      DiskTierOptions disk;
      disk.dir = dir_ + "/spill";
      disk.page_tokens = kPage;
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
    EXPECT_TRUE(store_->Promote(**session, held, &pool_).ok());
    const LayerCache& cache = (*session)->layers()[layer];
    std::string bytes;
    for (const std::shared_ptr<Page>& page : cache.pages()) {
      EXPECT_TRUE(store_->backend()
                      .ReadPage(page->data, cache.page_bytes(),
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
    ASSERT_TRUE(store_->Demote(**session).ok());
  }
  ASSERT_TRUE(store_->FlushTier(absl::InfiniteFuture()).ok());
  Reopen(/*spill=*/true);  // found again by the new store's scan of the segments
  EXPECT_EQ(Info(mixed).config().layer_codecs_size(), 2);
  for (int l = 0; l < kLayers; ++l) same(mixed, single[l], l, 50, "after the spill tier");
}

// A snapshot of format version 1 (before per-layer codecs: no preset or
// ranges in its header) still loads, its session with the codecs it names;
// a version this turbokvd does not know is DATA_LOSS naming the versions read.
TEST_P(LayerCodecsTest, SnapshotsOfVersionOneStillLoad) {
  const std::string id = Create(MakeCreate(kLayers, kKv, kQ, kDim, v1::CODEC_Q8_0, v1::CODEC_TURBO4));
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
  // Version 2's session header ends in u16 0 (no preset) and u32 0 (no
  // ranges): version 1 is the same without those 6 bytes.
  std::string header;
  {
    // Not held past this block: the session must go before its store does.
    auto session = store_->Find(id, "", absl::Now());
    ASSERT_TRUE(session.ok());
    PutSessionHeader(&header, SessionHeader{id, "", (*session)->config(), (*session)->created(), kPage});
  }
  ASSERT_EQ(file.substr(16, header.size()), header);
  auto write = [&](uint32_t version, const std::string& bytes) {
    std::string out = bytes;
    std::memcpy(&out[8], &version, 4);
    const uint32_t crc = Crc32c(absl::string_view(out.data(), out.size() - 4));
    std::memcpy(&out[out.size() - 4], &crc, 4);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << out;
  };
  std::string v1_file = file;
  v1_file.erase(16 + header.size() - 6, 6);
  uint32_t header_bytes = 0;
  std::memcpy(&header_bytes, &v1_file[12], 4);
  header_bytes -= 6;
  std::memcpy(&v1_file[12], &header_bytes, 4);
  write(1, v1_file);
  unlink((dir_ + "/snapshots/" + kManifestName).c_str());
  Reopen(/*spill=*/false);
  auto loaded = store_->LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->sessions, 1) << (loaded->failed.empty() ? "" : loaded->failed[0].second.ToString());
  const v1::SessionInfo info = Info(id);
  EXPECT_EQ(info.config().key_codec(), v1::CODEC_Q8_0);
  EXPECT_EQ(info.config().value_codec(), v1::CODEC_TURBO4);
  EXPECT_EQ(info.config().preset(), "");
  EXPECT_EQ(info.config().layer_codecs_size(), 0);
  EXPECT_EQ(Attend(id, 1, q, n - 1).result().output().data(), before);

  write(3, file);
  Reopen(/*spill=*/false);
  loaded = store_->LoadSnapshots(absl::Now());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->failed.size(), 1u);
  EXPECT_THAT(std::string(loaded->failed[0].second.message()), HasSubstr("snapshot format version 3, this turbokvd reads 1 to 2"));
}

// The quantization error each layer reports (SessionInfo, and the metrics'
// histogram) is the error of what ReadKv gives back, for every codec and both
// rotation block sizes (d = 64 and 128).
TEST_P(LayerCodecsTest, TheLiveErrorIsTheErrorOfWhatIsStored) {
  const v1::Codec codecs[] = {v1::CODEC_F16,    v1::CODEC_Q8_0,   v1::CODEC_Q4_0,
                              v1::CODEC_TURBO2, v1::CODEC_TURBO3, v1::CODEC_TURBO4};
  const int layers = 6;
  for (int d : {64, 128}) {
    v1::CreateSessionRequest request = MakeCreate(layers, kKv, kQ, d);
    for (int l = 0; l < layers; ++l) *request.mutable_config()->add_layer_codecs() = Range(l, l, codecs[l], codecs[l]);
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
      {"k4v4", v1::CODEC_TURBO4, v1::CODEC_TURBO4, 2, v1::CODEC_Q8_0, v1::CODEC_Q8_0, (28 * 4.125 + 4 * 8.5) / 32},
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

INSTANTIATE_TEST_SUITE_P(Devices, LayerCodecsTest, ::testing::ValuesIn(testing::TestDevices()), testing::DeviceTestName);

}  // namespace
}  // namespace turbokv
