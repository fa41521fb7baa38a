// CUDA attention against the scalar CPU path on the same pages, through
// CudaStream (the daemon's entry): single problems over awkward sizes, whole
// batches of caches of different lengths and codecs, top_k, head_dim 576.
// Skips, saying why, when no usable CUDA device is present. The plan's
// lookups run on the CPU and are tested everywhere.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/cuda/attention_kernels.cuh"
#include "kernels/cuda/attention_plan.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_codec.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/page_layout.h"
#include "kernels/paged_cache.h"
#include "tests/kernels/attention_testing.h"
#include "tests/kernels/codec_testing.h"
#include "tests/kernels/layer_testing.h"

namespace turbokv {
namespace {

using ::turbokv::testing::GaussianVectors;
using ::turbokv::testing::RelativeL2;

// What one problem of a test batch needs on both sides.
struct Problem {
  std::unique_ptr<PagedCacheBuffer> host;
  std::unique_ptr<cuda::DevicePagedCache> device;
  std::vector<int64_t> positions;
  std::vector<float> q;
};

Problem MakeProblem(CodecKind keys, CodecKind values, int d, int kv_heads, int page, int64_t tokens, int q_heads,
                    uint64_t seed, PageOrder order = PageOrder::kCanonical) {
  Problem p;
  auto cache = PagedCacheBuffer::Create({keys, d, seed}, {values, d, seed + 1}, kv_heads, page);
  EXPECT_TRUE(cache.ok()) << cache.status();
  p.host = *std::move(cache);
  const std::vector<float> k = GaussianVectors(tokens * kv_heads, d, seed + 2);
  const std::vector<float> v = GaussianVectors(tokens * kv_heads, d, seed + 3);
  p.host->Append(tokens, k.data(), v.data());
  auto device = cuda::DevicePagedCache::Upload(p.host->descriptor(), 0, order);
  EXPECT_TRUE(device.ok()) << device.status();
  if (device.ok()) p.device = *std::move(device);
  p.positions = {tokens - 1, (tokens - 1) / 2, 0};
  p.q = GaussianVectors(p.positions.size() * q_heads, d, seed + 4);
  for (float& x : p.q) x *= 2.0f;
  return p;
}

// The outputs of one problem.
struct Result {
  std::vector<float> out, lse, top_logits;
  std::vector<int64_t> top_tokens;
  Result(size_t rows, int d, int top_k)
      : out(rows * d, std::nanf("")), lse(rows, std::nanf("")), top_logits(rows * top_k), top_tokens(rows * top_k) {}
  AttentionOutput output(int top_k) {
    return {out.data(), lse.data(), top_k ? top_tokens.data() : nullptr, top_k ? top_logits.data() : nullptr};
  }
};

// How near the GPU's results come to the scalar path's: the CUDA-core
// kernel's within float rounding; the tensor-core kernel's within the fp16
// rounding of its units and the query's hi + lo (kernels/mma_tile.h), the
// bounds its host emulation meets (tests/kernels/mma_tile_test.cc).
struct Tolerance {
  double out;    // relative L2 of the outputs
  float lse;     // relative to max(1, |lse|)
  float logits;  // relative to max(1, |logit|)
};
constexpr Tolerance kCudaCores{2e-5, 1e-4f, 1e-4f};
constexpr Tolerance kTensorCores{5e-4, 1e-3f, 1e-3f};

// gpu against cpu (the scalar path): outputs and lse within `tolerance`,
// top-k logits slot by slot and tokens where the CPU's logits leave no
// near-tie.
void ExpectAgree(const Result& gpu, const Result& cpu, size_t rows, int top_k, const std::string& what,
                 const Tolerance& tolerance = kCudaCores) {
  EXPECT_LT(RelativeL2(gpu.out, cpu.out), tolerance.out) << what;
  for (size_t i = 0; i < rows; ++i) {
    if (std::isinf(cpu.lse[i])) {
      EXPECT_EQ(gpu.lse[i], cpu.lse[i]) << what << " row " << i;
      continue;
    }
    ASSERT_NEAR(gpu.lse[i], cpu.lse[i], tolerance.lse * std::max(1.0f, std::fabs(cpu.lse[i]))) << what << " row " << i;
  }
  for (size_t i = 0; i < rows; ++i) {
    for (int j = 0; j < top_k; ++j) {
      const size_t at = i * top_k + j;
      if (cpu.top_tokens[at] < 0) {
        EXPECT_EQ(gpu.top_tokens[at], -1) << what << " row " << i << " slot " << j;
        EXPECT_EQ(gpu.top_logits[at], -INFINITY) << what;
        continue;
      }
      const float near = tolerance.logits * std::max(1.0f, std::fabs(cpu.top_logits[at]));
      ASSERT_NEAR(gpu.top_logits[at], cpu.top_logits[at], near) << what << " row " << i << " slot " << j;
      const bool apart = (j == 0 || cpu.top_logits[at - 1] - cpu.top_logits[at] > 2 * near) &&
                         (j + 1 == top_k || cpu.top_tokens[at + 1] < 0 ||
                          cpu.top_logits[at] - cpu.top_logits[at + 1] > 2 * near);
      if (apart) {
        EXPECT_EQ(gpu.top_tokens[at], cpu.top_tokens[at]) << what << " row " << i << " slot " << j;
      }
    }
  }
}

// One codec pair, head dim and group against the CPU over awkward lengths,
// a window with a softcap, and top_k, with the device's pages in `order`.
void ExpectShapeAgrees(cuda::CudaStream& stream, std::pair<CodecKind, CodecKind> codecs, int d, int group,
                       PageOrder order, const Tolerance& tolerance) {
  constexpr int kKvHeads = 2, kPage = 64;
  for (int64_t tokens : {int64_t{1}, int64_t{kPage - 1}, int64_t{kPage + 1}, int64_t{10000}}) {
    Problem p = MakeProblem(codecs.first, codecs.second, d, kKvHeads, kPage, tokens, kKvHeads * group, 0x33 + tokens,
                            order);
    ASSERT_NE(p.device, nullptr);
    for (const auto& [window, softcap, top_k] :
         {std::make_tuple(int64_t{0}, 0.0f, 0), std::make_tuple(int64_t{37}, 4.0f, 0), std::make_tuple(int64_t{0}, 0.0f, 5)}) {
      AttentionParams params;
      params.q_heads = kKvHeads * group;
      params.window = window;
      params.softcap = softcap;
      params.top_k = top_k;
      const size_t rows = p.positions.size() * params.q_heads;
      Result cpu(rows, d, top_k), gpu(rows, d, top_k);
      const AttentionQueries queries{static_cast<int64_t>(p.positions.size()), p.q.data(), p.positions.data()};
      ASSERT_TRUE(AttendCpu(p.host->descriptor(), params, queries, cpu.output(top_k), {AttentionPath::kScalar}).ok());
      const AttentionProblem problem{p.device->descriptor(), queries, gpu.output(top_k)};
      const absl::Status s = stream.Attend({&problem, 1}, params);
      ASSERT_TRUE(s.ok()) << s;
      ExpectAgree(gpu, cpu, rows, top_k,
                  std::string(CodecName(codecs.first)) + "/" + CodecName(codecs.second) + " d=" + std::to_string(d) +
                      " group=" + std::to_string(group) + " tokens=" + std::to_string(tokens) +
                      " window=" + std::to_string(window) + " top_k=" + std::to_string(top_k),
                  tolerance);
    }
  }
}

using ShapeParam = std::tuple<std::pair<CodecKind, CodecKind>, int, int>;

std::string ShapeName(const ::testing::TestParamInfo<ShapeParam>& info) {
  const auto& codecs = std::get<0>(info.param);
  return std::string(CodecName(codecs.first)) + "_" + CodecName(codecs.second) + "_d" +
         std::to_string(std::get<1>(info.param)) + "_g" + std::to_string(std::get<2>(info.param));
}

class CudaAttentionTest : public ::testing::TestWithParam<ShapeParam> {
 protected:
  void SetUp() override {
    const absl::Status device = cuda::CheckDevice(0);
    if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
    auto stream = cuda::CudaStream::Create(0);
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = *std::move(stream);
  }
  std::unique_ptr<cuda::CudaStream> stream_;
};

TEST_P(CudaAttentionTest, MatchesTheScalarCpuPath) {
  const auto [codecs, d, group] = GetParam();
  ExpectShapeAgrees(*stream_, codecs, d, group, PageOrder::kCanonical, kCudaCores);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionTest,
    ::testing::Combine(::testing::Values(std::make_pair(CodecKind::kTurbo3, CodecKind::kTurbo3),
                                         std::make_pair(CodecKind::kTurbo2, CodecKind::kTurbo4),
                                         std::make_pair(CodecKind::kF16, CodecKind::kF16),
                                         std::make_pair(CodecKind::kQ8_0, CodecKind::kQ4_0)),
                       ::testing::Values(64, 128, 256, 576), ::testing::Values(1, 4, 8)),
    ShapeName);

// The tensor-core split kernel: caches uploaded in the token-group order,
// every head dim it takes, the pairs with kernels of their own and two that
// run the one reading every codec, groups of one n-tile (up to 8 query
// heads) and of two (12, 16 at head_dim 128 and below).
using CudaTensorCoreTest = CudaAttentionTest;

TEST_P(CudaTensorCoreTest, MatchesTheScalarCpuPath) {
  const auto [codecs, d, group] = GetParam();
  ExpectShapeAgrees(*stream_, codecs, d, group, PageOrder::kTokenGroups, kTensorCores);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaTensorCoreTest,
    ::testing::Combine(::testing::Values(std::make_pair(CodecKind::kTurbo4, CodecKind::kTurbo4),
                                         std::make_pair(CodecKind::kTurbo3, CodecKind::kTurbo3),
                                         std::make_pair(CodecKind::kF16, CodecKind::kF16),
                                         std::make_pair(CodecKind::kTurbo2, CodecKind::kTurbo4),
                                         std::make_pair(CodecKind::kQ8_0, CodecKind::kQ4_0)),
                       ::testing::Values(64, 128, 256), ::testing::Values(1, 4, 8, 12, 16)),
    ShapeName);

// Every compiled variant of the tensor-core kernel gives the scalar path's
// results; one not compiled for the batch is refused before anything runs.
TEST(CudaTensorCoreVariantTest, EveryCompiledVariantAgreesAndOthersAreRefused) {
  const absl::Status device = cuda::CheckDevice(0);
  if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  auto stream = cuda::CudaStream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  constexpr int kKvHeads = 2, kGroup = 4, kDim = 128, kPage = 64;
  AttentionParams params;
  params.q_heads = kKvHeads * kGroup;
  for (CodecKind kind : {CodecKind::kTurbo4, CodecKind::kTurbo3, CodecKind::kF16}) {
    Problem p = MakeProblem(kind, kind, kDim, kKvHeads, kPage, 3000, params.q_heads, 0x91, PageOrder::kTokenGroups);
    ASSERT_NE(p.device, nullptr);
    const size_t rows = p.positions.size() * params.q_heads;
    const AttentionQueries queries{static_cast<int64_t>(p.positions.size()), p.q.data(), p.positions.data()};
    Result cpu(rows, kDim, 0);
    ASSERT_TRUE(AttendCpu(p.host->descriptor(), params, queries, cpu.output(0), {AttentionPath::kScalar}).ok());
    for (const cuda::TensorCoreVariant variant : {cuda::TensorCoreVariant{4, 2}, cuda::TensorCoreVariant{4, 3},
                                                  cuda::TensorCoreVariant{8, 2}, cuda::TensorCoreVariant{2, 4}}) {
      ASSERT_TRUE(cuda::TensorCoreVariantCompiled(kDim, 8, kind, kind, variant));
      Result gpu(rows, kDim, 0);
      const AttentionProblem problem{p.device->descriptor(), queries, gpu.output(0)};
      const absl::Status s = (*stream)->Attend({&problem, 1}, params, variant);
      ASSERT_TRUE(s.ok()) << s;
      ExpectAgree(gpu, cpu, rows, 0,
                  std::string(CodecName(kind)) + " in " + std::to_string(variant.warps) + " warps, " +
                      std::to_string(variant.stages) + " stages",
                  kTensorCores);
    }
  }
  // {8, 2} is compiled for the pairs of their own at head_dim 128 only.
  Problem mixed = MakeProblem(CodecKind::kTurbo2, CodecKind::kTurbo4, kDim, kKvHeads, kPage, 100, params.q_heads, 0x92,
                              PageOrder::kTokenGroups);
  Problem canonical = MakeProblem(CodecKind::kTurbo4, CodecKind::kTurbo4, kDim, kKvHeads, kPage, 100, params.q_heads,
                                  0x93);
  for (Problem* p : {&mixed, &canonical}) {
    Result gpu(p->positions.size() * params.q_heads, kDim, 0);
    const AttentionProblem problem{p->device->descriptor(),
                                   {static_cast<int64_t>(p->positions.size()), p->q.data(), p->positions.data()},
                                   gpu.output(0)};
    const absl::Status s = (*stream)->Attend({&problem, 1}, params, cuda::TensorCoreVariant{8, 2});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("not compiled"), std::string::npos) << s;
  }
}

// The variants on the host: what the GPU run's sweep may name.
TEST(TensorCoreVariantTest, TheSweptVariantsAreCompiledForTheirShapesOnly) {
  const cuda::TensorCoreVariant kDefault{}, kSwept{8, 2}, kOther{3, 3};
  for (int d : {64, 128, 256}) {
    EXPECT_TRUE(cuda::TensorCoreVariantCompiled(d, 16, CodecKind::kQ8_0, CodecKind::kQ4_0, kDefault));
    EXPECT_TRUE(cuda::TensorCoreVariantCompiled(d, 8, CodecKind::kTurbo2, CodecKind::kTurbo4, {4, 2}));
    EXPECT_EQ(cuda::TensorCoreVariantCompiled(d, 8, CodecKind::kTurbo4, CodecKind::kTurbo4, kSwept), d == 128);
  }
  EXPECT_FALSE(cuda::TensorCoreVariantCompiled(128, 16, CodecKind::kTurbo4, CodecKind::kTurbo4, kSwept));
  EXPECT_FALSE(cuda::TensorCoreVariantCompiled(128, 8, CodecKind::kTurbo2, CodecKind::kTurbo4, kSwept));
  EXPECT_FALSE(cuda::TensorCoreVariantCompiled(128, 8, CodecKind::kTurbo4, CodecKind::kTurbo4, kOther));
}

// A decode step of many sessions of different lengths and codecs is one
// batch: every problem's result equals the same problem on the CPU alone,
// with the pages in either order (the token groups run the tensor-core
// kernel that reads every codec).
class CudaAttentionBatchTest : public ::testing::TestWithParam<PageOrder> {};

TEST_P(CudaAttentionBatchTest, EveryProblemOfABatchMatchesItsOwnCpuResult) {
  const PageOrder order = GetParam();
  const Tolerance& tolerance = order == PageOrder::kTokenGroups ? kTensorCores : kCudaCores;
  const absl::Status device = cuda::CheckDevice(0);
  if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  auto stream = cuda::CudaStream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  constexpr int kKvHeads = 4, kQHeads = 16, kDim = 128, kPage = 64;
  const std::vector<std::pair<CodecKind, CodecKind>> codecs = {
      {CodecKind::kTurbo3, CodecKind::kTurbo3}, {CodecKind::kTurbo4, CodecKind::kTurbo2},
      {CodecKind::kF16, CodecKind::kQ8_0}, {CodecKind::kQ4_0, CodecKind::kTurbo3}};
  std::vector<Problem> problems;
  const std::vector<int64_t> lengths = {1, 63, 64, 65, 500, 4097, 20000, 7};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const auto& [k, v] = codecs[i % codecs.size()];
    problems.push_back(MakeProblem(k, v, kDim, kKvHeads, kPage, lengths[i], kQHeads, 100 + 10 * i, order));
    ASSERT_NE(problems.back().device, nullptr);
  }
  for (const int top_k : {0, 3}) {
    AttentionParams params;
    params.q_heads = kQHeads;
    params.window = 300;
    params.top_k = top_k;
    std::vector<Result> cpu, gpu;
    std::vector<AttentionProblem> batch;
    for (Problem& p : problems) {
      const size_t rows = p.positions.size() * kQHeads;
      cpu.emplace_back(rows, kDim, top_k);
      gpu.emplace_back(rows, kDim, top_k);
    }
    for (size_t i = 0; i < problems.size(); ++i) {
      Problem& p = problems[i];
      const AttentionQueries queries{static_cast<int64_t>(p.positions.size()), p.q.data(), p.positions.data()};
      ASSERT_TRUE(AttendCpu(p.host->descriptor(), params, queries, cpu[i].output(top_k), {AttentionPath::kScalar}).ok());
      batch.push_back(AttentionProblem{p.device->descriptor(), queries, gpu[i].output(top_k)});
    }
    const absl::Status s = (*stream)->Attend({batch.data(), static_cast<int64_t>(batch.size())}, params);
    ASSERT_TRUE(s.ok()) << s;
    for (size_t i = 0; i < problems.size(); ++i) {
      ExpectAgree(gpu[i], cpu[i], problems[i].positions.size() * kQHeads, top_k,
                  "problem " + std::to_string(i) + " (" + std::to_string(lengths[i]) + " tokens) top_k=" +
                      std::to_string(top_k),
                  tolerance);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Orders, CudaAttentionBatchTest,
                         ::testing::Values(PageOrder::kCanonical, PageOrder::kTokenGroups),
                         [](const auto& info) { return testing::PageOrderParamName(info.param); });

TEST(CudaAttentionLimitsTest, WhatTheKernelsDoNotTakeIsUnimplementedOrInvalid) {
  const absl::Status device = cuda::CheckDevice(0);
  if (!device.ok()) GTEST_SKIP() << "CUDA tests skipped: " << device.message();
  auto stream = cuda::CudaStream::Create(0);
  ASSERT_TRUE(stream.ok());
  Problem wide = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 640, 1, 16, 4, 1, 1);
  AttentionParams params;
  params.q_heads = 1;
  Result out(3, 640, 0);
  const AttentionProblem problem{wide.device->descriptor(), {3, wide.q.data(), wide.positions.data()}, out.output(0)};
  absl::Status s = (*stream)->Attend({&problem, 1}, params);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(std::string(s.message()).find("576"), std::string::npos) << s;

  Problem a = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 1, 16, 4, 2, 2);
  Problem b = MakeProblem(CodecKind::kTurbo3, CodecKind::kTurbo3, 128, 2, 16, 4, 2, 3);
  params.q_heads = 2;
  Result ra(6, 128, 0), rb(6, 128, 0);
  const AttentionProblem mixed[] = {{a.device->descriptor(), {3, a.q.data(), a.positions.data()}, ra.output(0)},
                                    {b.device->descriptor(), {3, b.q.data(), b.positions.data()}, rb.output(0)}};
  s = (*stream)->Attend({mixed, 2}, params);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // Pages of 24 tokens hold no whole 16-token groups.
  auto odd = PagedCacheBuffer::Create({CodecKind::kTurbo4, 128, 1}, {CodecKind::kTurbo4, 128, 2}, 1, 24);
  ASSERT_TRUE(odd.ok()) << odd.status();
  auto grouped = cuda::DevicePagedCache::Upload((*odd)->descriptor(), 0, PageOrder::kTokenGroups);
  EXPECT_EQ(grouped.status().code(), absl::StatusCode::kInvalidArgument) << grouped.status();
}

// The plan, run on the CPU: every (problem, query, row chunk, kv head,
// split) is one unit, the splits of a problem cover its tokens, and the
// lookups find what the numbering put there.
TEST(AttentionPlanTest, UnitsAndRowsNumberEveryProblemOnce) {
  constexpr int kKvHeads = 2, kQHeads = 12;  // group 6: two row chunks
  std::vector<cuda::DeviceProblem> problems(5);
  const int64_t tokens[] = {1, 300, 128 * 1000, 77, 5};
  const int64_t queries[] = {1, 2, 1, 3, 1};
  for (size_t i = 0; i < problems.size(); ++i) {
    problems[i].cache.kv_heads = kKvHeads;
    problems[i].cache.tokens = tokens[i];
    problems[i].n = queries[i];
  }
  const cuda::AttentionPlan plan = cuda::PlanAttention(problems.data(), 5, kQHeads, 4);
  EXPECT_EQ(plan.row_chunks, 2);
  int64_t units = 0, rows = 0, partials = 0, logits = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const cuda::DeviceProblem& p = problems[i];
    EXPECT_EQ(p.first_unit, units);
    EXPECT_EQ(p.first_row, rows);
    EXPECT_EQ(p.first_partial, partials);
    EXPECT_EQ(p.first_logit, logits);
    EXPECT_GE(p.splits, 1);
    EXPECT_LE(p.splits, cuda::kMaxSplits);
    EXPECT_GE(p.chunk * p.splits, p.cache.tokens) << i;
    EXPECT_LT(p.chunk * (p.splits - 1), p.cache.tokens) << i;  // no empty split
    units += p.n * plan.row_chunks * kKvHeads * p.splits;
    rows += p.n * kQHeads;
    partials += p.n * kQHeads * p.splits;
    logits += p.n * kQHeads * p.cache.tokens;
  }
  EXPECT_EQ(plan.units, units);
  EXPECT_EQ(plan.rows, rows);
  EXPECT_EQ(plan.partials, partials);
  EXPECT_EQ(plan.logits, logits);
  EXPECT_GT(problems[2].splits, 1);  // the long cache is split
  EXPECT_EQ(problems[0].splits, 1);
  std::vector<int> seen(static_cast<size_t>(plan.units), 0);
  for (int64_t unit = 0; unit < plan.units; ++unit) {
    const int64_t i = cuda::ProblemOfUnit(problems.data(), 5, unit);
    const cuda::Unit u = cuda::UnitOf(problems[i], unit, plan.row_chunks);
    ASSERT_LT(u.query, problems[i].n);
    ASSERT_LT(u.split, problems[i].splits);
    const int64_t back =
        problems[i].first_unit + ((u.query * plan.row_chunks + u.row_chunk) * kKvHeads + u.head) * problems[i].splits + u.split;
    ASSERT_EQ(back, unit);
    ++seen[unit];
  }
  for (int64_t row = 0; row < plan.rows; ++row) {
    const int64_t i = cuda::ProblemOfRow(problems.data(), 5, row);
    ASSERT_GE(row, problems[i].first_row);
    ASSERT_LT(row - problems[i].first_row, problems[i].n * kQHeads);
  }
  const cuda::AttentionPlan none = cuda::PlanAttention(nullptr, 0, kQHeads, 0);
  EXPECT_EQ(none.workspace_bytes(128), 0u);
  // A problem's splits are its own: the same alone as in the batch.
  for (size_t i = 0; i < problems.size(); ++i) {
    cuda::DeviceProblem alone = problems[i];
    cuda::PlanAttention(&alone, 1, kQHeads, 4);
    EXPECT_EQ(alone.splits, problems[i].splits) << i;
    EXPECT_EQ(alone.chunk, problems[i].chunk) << i;
  }
}

// Calls whose scratch would pass the budget go in passes of queries: each
// query of each problem once, in order, with its own outputs; a pass within
// the budget unless one query alone passes it.
TEST(AttentionPlanTest, PassesCoverEveryQueryOnceWithinTheScratchBudget) {
  AttentionParams params;
  params.q_heads = 8;
  params.top_k = 2;
  constexpr int kDim = 128;
  const int64_t tokens[] = {100, 70000, 1 << 20, 5};
  const int64_t queries[] = {3, 40, 2, 1000};
  std::vector<AttentionProblem> problems(4);
  std::vector<std::vector<float>> q(4), out(4), lse(4), logits(4);
  std::vector<std::vector<int64_t>> positions(4), top(4);
  for (size_t i = 0; i < 4; ++i) {
    problems[i].cache.key_layout.head_dim = kDim;
    problems[i].cache.kv_heads = 2;
    problems[i].cache.tokens = tokens[i];
    q[i].resize(queries[i] * params.q_heads * kDim);
    out[i].resize(q[i].size());
    lse[i].resize(queries[i] * params.q_heads);
    logits[i].resize(lse[i].size() * params.top_k);
    top[i].resize(logits[i].size());
    positions[i].resize(queries[i]);
    problems[i].queries = {queries[i], q[i].data(), positions[i].data()};
    problems[i].output = {out[i].data(), lse[i].data(), top[i].data(), logits[i].data()};
  }
  const size_t budget = size_t{16} << 20;
  const auto passes = cuda::CutIntoPasses(problems.data(), 4, params, budget);
  EXPECT_GT(passes.size(), 1u);
  std::vector<int64_t> next(4, 0);
  for (const auto& pass : passes) {
    size_t bytes = 0;
    int64_t pass_queries = 0;
    for (const AttentionProblem& p : pass) {
      const size_t i = std::find(std::begin(tokens), std::end(tokens), p.cache.tokens) - std::begin(tokens);
      ASSERT_LT(i, 4u);
      EXPECT_EQ(p.queries.q, q[i].data() + next[i] * params.q_heads * kDim);
      EXPECT_EQ(p.queries.positions, positions[i].data() + next[i]);
      EXPECT_EQ(p.output.out, out[i].data() + next[i] * params.q_heads * kDim);
      EXPECT_EQ(p.output.lse, lse[i].data() + next[i] * params.q_heads);
      EXPECT_EQ(p.output.topk_tokens, top[i].data() + next[i] * params.q_heads * params.top_k);
      EXPECT_EQ(p.output.topk_logits, logits[i].data() + next[i] * params.q_heads * params.top_k);
      next[i] += p.queries.n;
      pass_queries += p.queries.n;
      bytes += p.queries.n * cuda::ScratchPerQuery(p.cache, params);
    }
    EXPECT_TRUE(bytes <= budget || pass_queries == 1) << bytes;
  }
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(next[i], queries[i]) << i;
  // A decode step of 32 sessions of 128K tokens, no top_k, is one launch.
  params.top_k = 0;
  std::vector<AttentionProblem> decode(32, problems[0]);
  for (AttentionProblem& p : decode) {
    p.cache.tokens = 131072;
    p.queries.n = 1;
  }
  EXPECT_EQ(cuda::CutIntoPasses(decode.data(), decode.size(), params, cuda::CudaStream::kScratchBytes).size(), 1u);
}

TEST(AttentionPlanTest, SplitsAreAGridByPositionThatDoublesOnlyForLongCaches) {
  EXPECT_EQ(cuda::SplitTokens(1), cuda::kSplitTokens);
  EXPECT_EQ(cuda::SplitTokens(cuda::kSplitTokens * cuda::kMaxSplits), cuda::kSplitTokens);
  EXPECT_EQ(cuda::SplitTokens(cuda::kSplitTokens * cuda::kMaxSplits + 1), 2 * cuda::kSplitTokens);
  EXPECT_EQ(cuda::SplitTokens(int64_t{1} << 20), 4096);  // 1M tokens: 256 splits of 4096
}

TEST(AttentionPlanTest, VisibleTokensFollowTheWindowTheFirstTokenAndTheEnd) {
  PagedKvCache cache;
  cache.tokens = 20;
  EXPECT_EQ(cuda::Visible(10, 0, cache).first, 0);
  EXPECT_EQ(cuda::Visible(10, 0, cache).last, 10);
  EXPECT_EQ(cuda::Visible(10, 4, cache).first, 7);
  EXPECT_EQ(cuda::Visible(2, 4, cache).first, 0);
  EXPECT_EQ(cuda::Visible(3, 4, cache).first, 0);
  EXPECT_EQ(cuda::Visible(4, 4, cache).first, 1);
  EXPECT_EQ(cuda::Visible(30, 0, cache).last, 19);  // past the stored tokens: up to the last
  cache.first_token = 4;                            // sink tokens, attended apart
  EXPECT_EQ(cuda::Visible(10, 0, cache).first, 4);
  EXPECT_EQ(cuda::Visible(10, 4, cache).first, 7);
  const cuda::VisibleTokens none = cuda::Visible(2, 0, cache);
  EXPECT_GT(none.first, none.last);
}

}  // namespace
}  // namespace turbokv
