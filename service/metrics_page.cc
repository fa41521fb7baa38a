#include "service/metrics_page.h"

#include <exception>
#include <utility>

#include "CivetServer.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace turbokv {

class MetricsPage::Handler : public CivetHandler {
 public:
  explicit Handler(std::vector<std::shared_ptr<prometheus::Collectable>> collectables)
      : collectables_(std::move(collectables)) {}

  bool handleGet(CivetServer* /*server*/, mg_connection* connection) override {
    std::vector<prometheus::MetricFamily> families;
    for (const std::shared_ptr<prometheus::Collectable>& collectable : collectables_) {
      std::vector<prometheus::MetricFamily> more = collectable->Collect();
      families.insert(families.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
    const std::string body = prometheus::TextSerializer().Serialize(families);
    mg_printf(connection,
              "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: %zu\r\n"
              "Connection: close\r\n\r\n",
              body.size());
    mg_write(connection, body.data(), body.size());
    return true;
  }

 private:
  const std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;
};

absl::StatusOr<std::unique_ptr<MetricsPage>> MetricsPage::Start(
    const std::string& listen, std::vector<std::shared_ptr<prometheus::Collectable>> collectables, int threads,
    int request_timeout_ms) {
  std::unique_ptr<MetricsPage> page(new MetricsPage());
  page->handler_ = std::make_unique<Handler>(std::move(collectables));
  try {
    page->server_ = std::make_unique<CivetServer>(std::vector<std::string>{
        "listening_ports", listen, "num_threads", std::to_string(threads), "request_timeout_ms",
        std::to_string(request_timeout_ms)});
  } catch (const std::exception&) {
    // civetweb says only "null context when constructing CivetServer".
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen,
                                               " (--metrics-listen): the port is in use or the address is not "
                                               "this host's"));
  }
  page->server_->addHandler("/metrics", page->handler_.get());
  const std::vector<int> ports = page->server_->getListeningPorts();
  page->port_ = ports.empty() ? 0 : ports[0];
  return page;
}

MetricsPage::~MetricsPage() {
  // Stop serving before the handler goes.
  server_.reset();
}

}  // namespace turbokv
