#include "kernels/paged_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/thread_pool.h"

namespace turbokv {

absl::StatusOr<std::unique_ptr<PagedCacheBuffer>> PagedCacheBuffer::Create(
    const CodecSpec& key_spec, const CodecSpec& value_spec, int kv_heads, int page_tokens) {
  if (key_spec.head_dim != value_spec.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("key head_dim ", key_spec.head_dim,
                                                   " differs from value head_dim ",
                                                   value_spec.head_dim));
  }
  if (kv_heads <= 0) return absl::InvalidArgumentError("kv_heads must be positive");
  if (page_tokens <= 0) return absl::InvalidArgumentError("page_tokens must be positive");
  auto keys = MakeCpuCodec(key_spec);
  if (!keys.ok()) return keys.status();
  auto values = MakeCpuCodec(value_spec);
  if (!values.ok()) return values.status();
  std::unique_ptr<PagedCacheBuffer> buffer(new PagedCacheBuffer());
  buffer->key_codec_ = *std::move(keys);
  buffer->value_codec_ = *std::move(values);
  PagedKvCache& d = buffer->descriptor_;
  d.key_layout = buffer->key_codec_->layout();
  d.value_layout = buffer->value_codec_->layout();
  d.key_seed = key_spec.seed;
  d.value_seed = value_spec.seed;
  d.kv_heads = kv_heads;
  d.page_tokens = page_tokens;
  return buffer;
}

void PagedCacheBuffer::Append(int64_t n, const float* keys, const float* values) {
  const int64_t end = tokens_ + n;
  while (static_cast<int64_t>(pages_.size()) * descriptor_.page_tokens < end) {
    pages_.emplace_back(new uint8_t[descriptor_.page_bytes()]());
    page_pointers_.push_back(pages_.back().get());
  }
  descriptor_.pages = page_pointers_.data();
  EncodeChunk chunk;
  chunk.key_codec = key_codec_.get();
  chunk.value_codec = value_codec_.get();
  chunk.cache = descriptor_;
  chunk.cache.tokens = end;
  chunk.first = tokens_;
  chunk.keys = keys;
  chunk.values = values;
  EncodeChunkCpu(chunk, nullptr);
  tokens_ = end;
  descriptor_.tokens = end;
}

namespace {

// A run of consecutive slots of one page and kv head that a chunk writes:
// the unit of work of an encode.
struct Run {
  int64_t token;  // the first
  int64_t length;
  int head;
};

std::vector<Run> Runs(const PagedKvCache& cache, int64_t first, int64_t end) {
  std::vector<Run> runs;
  for (int64_t t = first; t < end;) {
    const int64_t length = std::min<int64_t>(end - t, cache.page_tokens - t % cache.page_tokens);
    for (int h = 0; h < cache.kv_heads; ++h) runs.push_back(Run{t, length, h});
    t += length;
  }
  return runs;
}

// The chunk's pages are the caller's to write (EncodeChunk): new pages, or
// the copy of a shared one.
uint8_t* Writable(const PagedKvCache& cache, int64_t token) {
  return const_cast<uint8_t*>(cache.pages[token / cache.page_tokens]);
}

// Encodes one run: keys and values of its head gathered from the chunk's
// [tokens][kv_heads][head_dim] input into buffers kept per thread, or read
// where they are when the run is one token (a Decode message's appends).
void EncodeRun(const EncodeChunk& chunk, const Run& run, EncodeStats* key_errors, EncodeStats* value_errors) {
  const PagedKvCache& c = chunk.cache;
  const size_t dim = static_cast<size_t>(c.key_layout.head_dim);
  const size_t first = (static_cast<size_t>(run.token - chunk.first) * c.kv_heads + run.head) * dim;
  const float* keys = chunk.keys + first;
  const float* values = chunk.values + first;
  if (run.length > 1) {
    thread_local std::vector<float> key_rows, value_rows;
    key_rows.resize(static_cast<size_t>(run.length) * dim);
    value_rows.resize(key_rows.size());
    for (int64_t j = 0; j < run.length; ++j) {
      const size_t src = first + static_cast<size_t>(j) * c.kv_heads * dim;
      std::memcpy(&key_rows[j * dim], chunk.keys + src, dim * sizeof(float));
      std::memcpy(&value_rows[j * dim], chunk.values + src, dim * sizeof(float));
    }
    keys = key_rows.data();
    values = value_rows.data();
  }
  uint8_t* page = Writable(c, run.token);
  const int64_t slot = run.token % c.page_tokens;
  chunk.key_codec->Encode(run.length, keys, page + c.key_offset(run.head, slot), key_errors);
  chunk.value_codec->Encode(run.length, values, page + c.value_offset(run.head, slot), value_errors);
}

}  // namespace

void EncodeChunkCpu(const EncodeChunk& chunk, ThreadPool* pool) {
  const PagedKvCache& c = chunk.cache;
  if (chunk.first >= c.tokens) return;
  if (chunk.copy_from != nullptr) std::memcpy(Writable(c, chunk.first), chunk.copy_from, c.page_bytes());
  const std::vector<Run> runs = Runs(c, chunk.first, c.tokens);
  // Each run's errors apart (runs encode in parallel), summed after.
  const bool errors = chunk.key_errors != nullptr || chunk.value_errors != nullptr;
  std::vector<EncodeStats> run_errors(errors ? 2 * runs.size() : 0);
  auto encode = [&](int64_t i) {
    EncodeRun(chunk, runs[static_cast<size_t>(i)], errors ? &run_errors[2 * i] : nullptr,
              errors ? &run_errors[2 * i + 1] : nullptr);
  };
  if (pool != nullptr && runs.size() > 1) {
    pool->ParallelFor(static_cast<int64_t>(runs.size()), encode);
  } else {
    for (size_t i = 0; i < runs.size(); ++i) encode(static_cast<int64_t>(i));
  }
  for (size_t i = 0; i < run_errors.size(); i += 2) {
    if (chunk.key_errors != nullptr) chunk.key_errors->Add(run_errors[i]);
    if (chunk.value_errors != nullptr) chunk.value_errors->Add(run_errors[i + 1]);
  }
}

void DecodeCpu(const Codec& key_codec, const Codec& value_codec, const PagedKvCache& cache, int64_t first, int64_t n,
               float* keys, float* values) {
  const size_t dim = static_cast<size_t>(cache.key_layout.head_dim);
  for (int64_t t = first; t < first + n;) {
    const int64_t slot = t % cache.page_tokens;
    const int64_t run = std::min<int64_t>(first + n - t, cache.page_tokens - slot);
    const uint8_t* page = cache.pages[t / cache.page_tokens];
    std::vector<float> k_run(static_cast<size_t>(run) * dim), v_run(k_run.size());
    for (int h = 0; h < cache.kv_heads; ++h) {
      key_codec.Decode(run, page + cache.key_offset(h, slot), k_run.data());
      value_codec.Decode(run, page + cache.value_offset(h, slot), v_run.data());
      for (int64_t i = 0; i < run; ++i) {
        const size_t dst = (static_cast<size_t>(t - first + i) * cache.kv_heads + h) * dim;
        std::memcpy(keys + dst, &k_run[i * dim], dim * sizeof(float));
        std::memcpy(values + dst, &v_run[i * dim], dim * sizeof(float));
      }
    }
    t += run;
  }
}

}  // namespace turbokv
