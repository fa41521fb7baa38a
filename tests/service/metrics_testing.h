// Scraping a real /metrics endpoint in tests: a plain HTTP/1.0 GET over
// TCP, and the value of one sample of the text it returns.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sstream>
#include <string>

#include "absl/time/time.h"

namespace turbokv::testing {

// A TCP connection to host:port (IPv4), or -1.
inline int ConnectTcp(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &to.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET http://address/metrics (address: host:port); the body, or "" when the
// endpoint does not answer within `timeout`.
inline std::string Scrape(const std::string& address, absl::Duration timeout = absl::Seconds(5)) {
  const int fd = ConnectTcp(address);
  if (fd < 0) return "";
  timeval tv{static_cast<time_t>(absl::ToInt64Seconds(timeout)), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string body;
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
    char buffer[65536];
    for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) body.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return body;
}

// The value of a Prometheus sample line that starts with `series` (name and
// labels as exposed), or -1.
inline double Sample(const std::string& metrics, const std::string& series) {
  std::istringstream lines(metrics);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

}  // namespace turbokv::testing
