#include "service/text_file.h"

#include <fstream>
#include <sstream>

namespace turbokv {

std::optional<std::string> ReadTextFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace turbokv
