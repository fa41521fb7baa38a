// Byte sizes as operators write them: 4GiB, 512MiB, 100MB, 65536.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace turbokv {

// A number followed by nothing (bytes), B, KB/MB/GB/TB (powers of 1000) or
// KiB/MiB/GiB/TiB (powers of 1024); case-insensitive. INVALID_ARGUMENT
// otherwise.
absl::StatusOr<size_t> ParseByteSize(absl::string_view text);

// 4294967296 -> "4.00 GiB".
std::string FormatByteSize(size_t bytes);

}  // namespace turbokv
