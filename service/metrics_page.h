// /metrics over HTTP: the daemon's registry and the process collector in
// Prometheus' text format, and nothing else (prometheus::Exposer adds its own
// unprefixed exposer_* series, one in microseconds).

#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"

class CivetServer;

namespace turbokv {

class MetricsPage {
 public:
  // Serves `collectables` at http://listen/metrics from `threads` threads;
  // a request not read within `request_timeout_ms` is dropped, so a few
  // idle connections cannot hold the page. UNAVAILABLE when `listen` cannot
  // be bound.
  static absl::StatusOr<std::unique_ptr<MetricsPage>> Start(
      const std::string& listen, std::vector<std::shared_ptr<prometheus::Collectable>> collectables, int threads,
      int request_timeout_ms);
  ~MetricsPage();

  // The port bound (listen's, or the one chosen for port 0).
  int port() const { return port_; }

 private:
  class Handler;
  MetricsPage() = default;

  std::unique_ptr<Handler> handler_;
  std::unique_ptr<CivetServer> server_;
  int port_ = 0;
};

}  // namespace turbokv
