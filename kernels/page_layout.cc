#include "kernels/page_layout.h"

#include <cstring>
#include <vector>

namespace turbokv {
namespace {

// Calls copy(canonical offset, ordered offset, bytes) for every field of
// every record of the page.
template <typename F>
void ForEachField(const PageFormat& format, F copy) {
  const SlotShape shape = format.slots();
  for (int side = 0; side < 2; ++side) {
    const CodecLayout& layout = side == 0 ? format.key_layout : format.value_layout;
    const int record = static_cast<int>(layout.code_size());
    std::vector<RecordField> fields;
    for (int byte = 0; byte < record; byte += fields.back().bytes) fields.push_back(FieldOf(layout, byte));
    for (int h = 0; h < format.kv_heads; ++h) {
      const size_t region = side == 0 ? shape.keys_offset(h) : shape.values_offset(h);
      for (int64_t slot = 0; slot < format.page_tokens; ++slot) {
        for (const RecordField& f : fields) {
          copy(region + static_cast<size_t>(slot) * record + f.offset,
               region + RecordByteOffset(format.order, layout, slot, f.offset), static_cast<size_t>(f.bytes));
        }
      }
    }
  }
}

}  // namespace

const char* PageOrderName(PageOrder order) {
  return order == PageOrder::kTokenGroups ? "token groups" : "canonical";
}

bool TokenGroupsApply(const CodecLayout& key_layout, const CodecLayout& value_layout, int page_tokens) {
  return key_layout.blocks > 0 && value_layout.blocks > 0 && page_tokens > 0 && page_tokens % kTokenGroup == 0;
}

void PageToOrder(const PageFormat& format, const uint8_t* canonical, uint8_t* ordered) {
  if (format.order == PageOrder::kCanonical) {
    std::memcpy(ordered, canonical, format.page_bytes());
    return;
  }
  ForEachField(format, [&](size_t from, size_t to, size_t bytes) { std::memcpy(ordered + to, canonical + from, bytes); });
}

void PageToCanonical(const PageFormat& format, const uint8_t* ordered, uint8_t* canonical) {
  if (format.order == PageOrder::kCanonical) {
    std::memcpy(canonical, ordered, format.page_bytes());
    return;
  }
  ForEachField(format, [&](size_t from, size_t to, size_t bytes) { std::memcpy(canonical + from, ordered + to, bytes); });
}

}  // namespace turbokv
