// One blocking connection to Redis (hiredis), with a time limit on
// connecting and on every reply, for the Redis tier's threads. Not
// thread-safe: each thread has its own. No gRPC types.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct redisContext;
struct redisReply;

namespace turbokv {

// Where Redis is: redis://HOST[:PORT][/DB] or unix:///PATH[?db=N].
struct RedisAddress {
  std::string host;  // empty for a unix socket
  int port = 6379;
  std::string path;  // the unix socket
  int db = 0;
  std::string url;   // as given, for messages
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
  // Whether the last connection failed because Redis refused the
  // credentials (a wrong password or user): trying again will not help.
  bool refused_credentials() const { return refused_credentials_; }

 private:
  absl::Status Connect();
  absl::Status Fail(absl::string_view what);

  const RedisAddress address_;
  const absl::Duration timeout_;
  redisContext* context_ = nullptr;
  bool refused_credentials_ = false;
};

}  // namespace turbokv
