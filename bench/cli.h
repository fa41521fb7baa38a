// Shared pieces of the turbokv-bench subcommands.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"

namespace turbokv::bench {

// Prints the problem and the usage to stderr; returns the exit code 2.
int UsageError(const std::string& message);

// --name value / --name=value options and bare --switches after the subcommand.
class Options {
 public:
  bool Parse(int argc, char** argv, const std::vector<std::string>& valued,
             const std::vector<std::string>& switches, std::string* error) {
    for (int i = 0; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.rfind("--", 0) != 0) {
        *error = "unexpected argument \"" + arg + "\"";
        return false;
      }
      arg = arg.substr(2);
      std::string value;
      const size_t eq = arg.find('=');
      const bool inline_value = eq != std::string::npos;
      if (inline_value) {
        value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
      if (std::find(switches.begin(), switches.end(), arg) != switches.end() && !inline_value) {
        values_[arg] = "true";
        continue;
      }
      if (std::find(valued.begin(), valued.end(), arg) == valued.end()) {
        *error = "unknown option --" + arg;
        return false;
      }
      if (!inline_value) {
        if (i + 1 >= argc) {
          *error = "--" + arg + " needs a value";
          return false;
        }
        value = argv[++i];
      }
      values_[arg] = value;
    }
    return true;
  }

  bool Has(const std::string& name) const { return values_.count(name) != 0; }
  std::string Get(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  // A positive integer option; false with *error set when it is not one.
  bool GetInt(const std::string& name, long long fallback, long long* out, std::string* error) const {
    const std::string text = Get(name, std::to_string(fallback));
    if (!absl::SimpleAtoi(text, out) || *out <= 0) {
      *error = "--" + name + " must be a positive integer, got \"" + text + "\"";
      return false;
    }
    return true;
  }

 private:
  std::map<std::string, std::string> values_;
};

inline double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline double Micros(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

// The value at fraction p (0 to 1) of the way through v, sorted; v not empty.
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// Runs each op in turn, `rounds` times, each turn repeated for at least
// `min_seconds`, and returns each op's median rate in items per second (an
// op handles `first` items per call). Interleaving spreads the drift of a
// shared machine over every op alike, so their ratios hold.
inline std::vector<double> InterleavedMedianRates(
    const std::vector<std::pair<size_t, std::function<void()>>>& ops, int rounds = 7,
    double min_seconds = 0.15) {
  std::vector<std::vector<double>> rates(ops.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < ops.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      size_t done = 0;
      double elapsed = 0;
      do {
        ops[i].second();
        done += ops[i].first;
        elapsed = Seconds(start);
      } while (elapsed < min_seconds);
      rates[i].push_back(done / elapsed);
    }
  }
  std::vector<double> medians;
  for (std::vector<double>& r : rates) {
    std::sort(r.begin(), r.end());
    medians.push_back(r[r.size() / 2]);
  }
  return medians;
}

}  // namespace turbokv::bench
