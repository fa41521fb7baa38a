// Reading a small file whole: /proc and /sys entries, PEM files.
#pragma once

#include <optional>
#include <string>

namespace turbokv {

// The file's contents, or nullopt when it cannot be opened.
std::optional<std::string> ReadTextFile(const std::string& path);

}  // namespace turbokv
