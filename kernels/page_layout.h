// The one owner of a layer's page bytes (docs/FORMAT.md, "Pages"): where each
// token's key and value records lie in the canonical order that snapshots,
// the tiers and Redis hold, and in the native orders a backend may keep
// instead because its kernels read them fastest, with the translation
// between the two. A backend translates at WritePage and ReadPage (and its
// own kernels write and read its order), so a native order changes no file,
// tier or Redis format.
//
// Canonical: per kv head h, at h * page_tokens * (K + V) bytes, the
// page_tokens key records of K = key_layout.code_size() bytes, token-major,
// then the page_tokens value records of V bytes.
//
// Token groups (PageOrder::kTokenGroups, a GPU's): the same regions (each
// head's keys, then its values), cut into groups of kTokenGroup consecutive
// slots; a group holds its records split into their fields, field by field
// and token by token: the kTokenGroup block scales of the first block, then
// the kTokenGroup copies of its first index plane, then its second plane
// (turbo3), then the next block's fields. A field of a record (a block
// scale, an index plane, a block's int8 values or nibbles, a whole f16
// vector) keeps its bytes together; the group of R-byte records starts
// where the canonical group does (at slot * R), and field f (canonical
// offset o_f in the record, z_f bytes) of its token t lies at
// kTokenGroup * o_f + t * z_f: every plane and value field of every token
// starts 8-byte aligned (16-byte for d = 128), so a warp loads a group's
// planes with wide, aligned loads and feeds them to mma fragments as they
// are. Pages of such a layer hold a multiple of kTokenGroup tokens.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/hd.h"
#include "kernels/layout.h"

namespace turbokv {

// Where slot `slot`'s key record and value record of head `head` start in
// a canonical page of page_tokens slots of key_bytes and value_bytes
// records: head h's keys of its page_tokens slots, then its values, then
// head h + 1's.
TURBOKV_HD size_t CanonicalKeyOffset(int head, int64_t slot, int page_tokens, size_t key_bytes, size_t value_bytes) {
  return static_cast<size_t>(head) * page_tokens * (key_bytes + value_bytes) + static_cast<size_t>(slot) * key_bytes;
}
TURBOKV_HD size_t CanonicalValueOffset(int head, int64_t slot, int page_tokens, size_t key_bytes, size_t value_bytes) {
  return static_cast<size_t>(head) * page_tokens * (key_bytes + value_bytes) +
         static_cast<size_t>(page_tokens) * key_bytes + static_cast<size_t>(slot) * value_bytes;
}

// The canonical geometry of a page (CanonicalKeyOffset, CanonicalValueOffset).
struct SlotShape {
  int32_t heads = 0;
  int32_t page_tokens = 0;
  int32_t key_bytes = 0;    // per slot
  int32_t value_bytes = 0;  // per slot

  TURBOKV_HD size_t head_bytes() const {
    return static_cast<size_t>(page_tokens) * (static_cast<size_t>(key_bytes) + static_cast<size_t>(value_bytes));
  }
  TURBOKV_HD size_t page_bytes() const { return static_cast<size_t>(heads) * head_bytes(); }
  // Offsets of slot s's records, and of the key and value regions of a head.
  TURBOKV_HD size_t key_offset(int head, int64_t slot) const {
    return CanonicalKeyOffset(head, slot, page_tokens, static_cast<size_t>(key_bytes), static_cast<size_t>(value_bytes));
  }
  TURBOKV_HD size_t value_offset(int head, int64_t slot) const {
    return CanonicalValueOffset(head, slot, page_tokens, static_cast<size_t>(key_bytes),
                                static_cast<size_t>(value_bytes));
  }
  TURBOKV_HD size_t keys_offset(int head) const { return key_offset(head, 0); }
  TURBOKV_HD size_t values_offset(int head) const { return value_offset(head, 0); }
  // Bytes of slots [from, to) of every head, keys and values.
  size_t slots_bytes(int32_t from, int32_t to) const {
    return static_cast<size_t>(heads) * static_cast<size_t>(to - from) *
           (static_cast<size_t>(key_bytes) + static_cast<size_t>(value_bytes));
  }
};

enum class PageOrder : uint8_t {
  kCanonical = 0,    // docs/FORMAT.md: what every tier and snapshot holds
  kTokenGroups = 1,  // fields of kTokenGroup tokens together (above)
};

// "canonical" or "token groups", for messages.
const char* PageOrderName(PageOrder order);

constexpr int kTokenGroup = 16;

// The field of a record of `layout` that byte `byte` of the record is in:
// its canonical offset in the record and its size. A block's fp16 scale,
// its index plane (turbo2, turbo4) or planes (turbo3: the 2-bit low plane,
// then the 1-bit high plane), its int8 values (q8_0) or nibbles (q4_0); an
// f16 record is one field.
struct RecordField {
  int offset = 0;
  int bytes = 0;
};

TURBOKV_HD RecordField FieldOf(const CodecLayout& layout, int byte) {
  if (layout.kind == CodecKind::kF16) return RecordField{0, static_cast<int>(layout.code_size())};
  const int block = byte / layout.block_bytes;
  const int in_block = byte - block * layout.block_bytes;
  const int start = block * layout.block_bytes;
  if (in_block < kTurboScaleBytes) return RecordField{start, kTurboScaleBytes};
  if (layout.kind == CodecKind::kTurbo3) {
    const int low = layout.block_values / 4;
    if (in_block < kTurboScaleBytes + low) return RecordField{start + kTurboScaleBytes, low};
    return RecordField{start + kTurboScaleBytes + low, layout.block_values / 8};
  }
  return RecordField{start + kTurboScaleBytes, layout.block_bytes - kTurboScaleBytes};
}

// Where byte `byte` of slot `slot`'s record lies in its region (a head's
// keys or values, page_tokens records of `layout`), in `order`.
TURBOKV_HD size_t RecordByteOffset(PageOrder order, const CodecLayout& layout, int64_t slot, int byte) {
  const size_t record = layout.code_size();
  if (order == PageOrder::kCanonical) return static_cast<size_t>(slot) * record + static_cast<size_t>(byte);
  const RecordField f = FieldOf(layout, byte);
  const int64_t group = slot / kTokenGroup;
  const int t = static_cast<int>(slot - group * kTokenGroup);
  return static_cast<size_t>(group) * kTokenGroup * record + static_cast<size_t>(kTokenGroup) * f.offset +
         static_cast<size_t>(t) * f.bytes + static_cast<size_t>(byte - f.offset);
}

// What a backend needs to translate a page: its shape, its codecs and the
// order it keeps the page in.
struct PageFormat {
  CodecLayout key_layout;
  CodecLayout value_layout;
  int kv_heads = 0;
  int page_tokens = 0;
  PageOrder order = PageOrder::kCanonical;

  SlotShape slots() const {
    return SlotShape{kv_heads, page_tokens, static_cast<int32_t>(key_layout.code_size()),
                     static_cast<int32_t>(value_layout.code_size())};
  }
  size_t page_bytes() const { return slots().page_bytes(); }
};

// Whether pages of these codecs and page size can be kept in kTokenGroups
// order: whole groups a page, codecs with a layout.
bool TokenGroupsApply(const CodecLayout& key_layout, const CodecLayout& value_layout, int page_tokens);

// A page of `format` between its canonical bytes and its own order
// (format.page_bytes() bytes each; `from` and `to` do not overlap). In the
// canonical order both are a copy.
void PageToOrder(const PageFormat& format, const uint8_t* canonical, uint8_t* ordered);
void PageToCanonical(const PageFormat& format, const uint8_t* ordered, uint8_t* canonical);

}  // namespace turbokv
