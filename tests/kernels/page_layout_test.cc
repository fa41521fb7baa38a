// The page layout's owner (kernels/page_layout.h): the token-group order is
// a permutation of the canonical bytes that puts every field where its
// offset function says, with the alignment the GPU kernels load at, and
// the translation goes both ways for every codec pair, head dim and page
// size.
#include "kernels/page_layout.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/codec.h"

namespace turbokv {
namespace {

constexpr CodecKind kKinds[] = {CodecKind::kF16,    CodecKind::kQ8_0,   CodecKind::kQ4_0,
                                CodecKind::kTurbo2, CodecKind::kTurbo3, CodecKind::kTurbo4};

std::string Name(const CodecLayout& k, const CodecLayout& v, int page_tokens) {
  return std::to_string(static_cast<int>(k.kind)) + "/" + std::to_string(static_cast<int>(v.kind)) +
         " d=" + std::to_string(k.head_dim) + " page=" + std::to_string(page_tokens);
}

TEST(PageLayoutTest, TokenGroupsAreAPermutationThatRoundTrips) {
  for (int d : {64, 128, 256}) {
    for (CodecKind key : kKinds) {
      for (CodecKind value : kKinds) {
        for (int page_tokens : {16, 64}) {
          const PageFormat format{MakeCodecLayout(key, d), MakeCodecLayout(value, d), 3, page_tokens,
                                  PageOrder::kTokenGroups};
          const std::string what = Name(format.key_layout, format.value_layout, page_tokens);
          ASSERT_TRUE(TokenGroupsApply(format.key_layout, format.value_layout, page_tokens)) << what;
          const size_t bytes = format.page_bytes();
          std::vector<uint8_t> canonical(bytes), ordered(bytes), back(bytes);
          for (size_t i = 0; i < bytes; ++i) canonical[i] = static_cast<uint8_t>(i * 131 + (i >> 8) * 7);
          PageToOrder(format, canonical.data(), ordered.data());
          PageToCanonical(format, ordered.data(), back.data());
          ASSERT_EQ(back, canonical) << what;
          // Each record byte where RecordByteOffset says, in its region.
          const SlotShape shape = format.slots();
          for (int h = 0; h < format.kv_heads; ++h) {
            for (int side = 0; side < 2; ++side) {
              const CodecLayout& layout = side == 0 ? format.key_layout : format.value_layout;
              const size_t region = side == 0 ? shape.keys_offset(h) : shape.values_offset(h);
              for (int64_t slot = 0; slot < page_tokens; ++slot) {
                for (int b = 0; b < static_cast<int>(layout.code_size()); ++b) {
                  const size_t at = region + RecordByteOffset(PageOrder::kTokenGroups, layout, slot, b);
                  ASSERT_LT(at, region + static_cast<size_t>(page_tokens) * layout.code_size()) << what;
                  ASSERT_EQ(ordered[at], canonical[region + RecordByteOffset(PageOrder::kCanonical, layout, slot, b)])
                      << what << " head " << h << " side " << side << " slot " << slot << " byte " << b;
                }
              }
            }
          }
          std::vector<uint8_t> a = canonical, o = ordered;
          std::sort(a.begin(), a.end());
          std::sort(o.begin(), o.end());
          EXPECT_EQ(a, o) << what;
        }
      }
    }
  }
}

// What the GPU kernels load in one instruction starts aligned: every field
// but a block's fp16 scale at 8 bytes in its page (16 at d = 128), pages
// being 16-byte aligned.
TEST(PageLayoutTest, TokenGroupFieldsStartAligned) {
  for (int d : {64, 128, 256}) {
    for (CodecKind kind : kKinds) {
      const CodecLayout layout = MakeCodecLayout(kind, d);
      const PageFormat format{layout, layout, 4, 64, PageOrder::kTokenGroups};
      const SlotShape shape = format.slots();
      for (int h = 0; h < format.kv_heads; ++h) {
        for (size_t region : {shape.keys_offset(h), shape.values_offset(h)}) {
          ASSERT_EQ(region % 16, 0u) << d;
          for (int64_t slot = 0; slot < 64; ++slot) {
            for (int b = 0; b < static_cast<int>(layout.code_size());) {
              const RecordField f = FieldOf(layout, b);
              ASSERT_EQ(f.offset, b);
              const size_t at = region + RecordByteOffset(PageOrder::kTokenGroups, layout, slot, b);
              if (f.bytes != kTurboScaleBytes || kind == CodecKind::kF16) {
                EXPECT_EQ(at % (d == 128 ? 16 : 8), 0u)
                    << CodecName(kind) << " d=" << d << " slot " << slot << " field at " << b;
              }
              b += f.bytes;
            }
          }
        }
      }
    }
  }
}

TEST(PageLayoutTest, CanonicalIsACopyAndTheDescriptorsAgree) {
  const CodecLayout k = MakeCodecLayout(CodecKind::kTurbo3, 128), v = MakeCodecLayout(CodecKind::kQ8_0, 128);
  const PageFormat format{k, v, 2, 16, PageOrder::kCanonical};
  std::vector<uint8_t> in(format.page_bytes()), out(format.page_bytes());
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i);
  PageToOrder(format, in.data(), out.data());
  EXPECT_EQ(in, out);
  PagedKvCache cache;
  cache.key_layout = k;
  cache.value_layout = v;
  cache.kv_heads = 2;
  cache.page_tokens = 16;
  const SlotShape shape = format.slots();
  for (int h = 0; h < 2; ++h) {
    for (int64_t s = 0; s < 16; ++s) {
      EXPECT_EQ(cache.key_offset(h, s), shape.key_offset(h, s));
      EXPECT_EQ(cache.value_offset(h, s), shape.value_offset(h, s));
      EXPECT_EQ(shape.key_offset(h, s), shape.keys_offset(h) + RecordByteOffset(PageOrder::kCanonical, k, s, 0));
    }
  }
  EXPECT_EQ(cache.page_bytes(), format.page_bytes());
  EXPECT_FALSE(TokenGroupsApply(k, v, 24));
  EXPECT_FALSE(TokenGroupsApply(MakeCodecLayout(CodecKind::kTurbo3, 96), v, 16));
}

}  // namespace
}  // namespace turbokv
