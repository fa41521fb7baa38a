// One blocking connection to Redis, over a unix socket, TCP or TLS (OpenSSL),
// with a time limit on connecting and on every reply, for the Redis tier's
// threads. Commands are written and replies parsed by hiredis's protocol
// functions (Debian's hiredis 0.14 has no TLS of its own). Not thread-safe:
// each thread has its own. No gRPC types.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct redisReader;
struct ssl_st;
struct ssl_ctx_st;

namespace turbokv {

// Where Redis is: redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] (TLS)
// or unix:///PATH[?db=N].
struct RedisAddress {
  std::string host;  // empty for a unix socket
  int port = 6379;
  std::string path;  // the unix socket
  int db = 0;
  std::string url;   // as given, for messages
  // rediss://: TLS 1.2 or later, the server's certificate checked against
  // tls_ca (a PEM file; empty: the system's trust store) and its name or IP
  // address against `host`; with tls_cert and tls_key (PEM files), a client
  // certificate. main.cc sets the files (--redis-tls-*).
  bool tls = false;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  // Sent as AUTH [user] password on every connection when the password is
  // set. Never part of the URL (main.cc reads them from --redis-user and
  // --redis-password-file or $TURBOKV_REDIS_PASSWORD); never in a message.
  std::string user;
  std::string password;
};
// INVALID_ARGUMENT naming what is wrong with the URL.
absl::StatusOr<RedisAddress> ParseRedisUrl(absl::string_view url);

// A reply: nil, an integer, a string (bulk or status), an error, or an
// array of replies.
struct RedisValue {
  enum Type { kNil, kInteger, kString, kError, kArray } type = kNil;
  long long integer = 0;
  std::string str;  // kString and kError
  std::vector<RedisValue> elements;
};

class RedisConnection {
 public:
  RedisConnection(RedisAddress address, absl::Duration timeout);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Sends the commands in one batch and reads their replies in order.
  // UNAVAILABLE naming the address when it cannot connect, send or read
  // within the timeout (the connection is closed then and reopened by the
  // next call). A Redis error reply is a RedisValue of kError, not an error.
  absl::StatusOr<std::vector<RedisValue>> Run(const std::vector<std::vector<std::string>>& commands);
  // One command.
  absl::StatusOr<RedisValue> Run(std::vector<std::string> command);

  const RedisAddress& address() const { return address_; }
  // Whether the last connection failed for a reason that trying again will
  // not mend: Redis refused the credentials (a wrong password or user), its
  // certificate failed verification, or a TLS file could not be used.
  bool misconfigured() const { return misconfigured_; }

 private:
  absl::Status Connect();
  // The socket, connected within the timeout (fd_).
  absl::Status Dial();
  // The TLS session over fd_ (ssl_).
  absl::Status Handshake();
  // Closes the connection and returns UNAVAILABLE naming the address,
  // `what`, and the system's or OpenSSL's reason when there is one.
  absl::Status Fail(absl::string_view what, absl::string_view reason = "");
  void Close();
  absl::Status SendAll(const std::string& bytes, absl::string_view what);
  // Some bytes into buf (at least one), or why not (the peer closed, the
  // timeout passed).
  absl::StatusOr<size_t> Receive(char* buf, size_t size);

  const RedisAddress address_;
  const absl::Duration timeout_;
  int fd_ = -1;
  ssl_ctx_st* ssl_context_ = nullptr;  // made at the first TLS connection
  ssl_st* ssl_ = nullptr;
  redisReader* reader_ = nullptr;
  bool misconfigured_ = false;
};

}  // namespace turbokv
