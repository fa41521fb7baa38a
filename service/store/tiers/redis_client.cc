#include "service/store/tiers/redis_client.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace turbokv {
namespace {

RedisValue Convert(const redisReply& reply) {
  RedisValue value;
  switch (reply.type) {
    case REDIS_REPLY_INTEGER:
      value.type = RedisValue::kInteger;
      value.integer = reply.integer;
      break;
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
      value.type = RedisValue::kString;
      value.str.assign(reply.str, reply.len);
      break;
    case REDIS_REPLY_ERROR:
      value.type = RedisValue::kError;
      value.str.assign(reply.str, reply.len);
      break;
    case REDIS_REPLY_ARRAY:
      value.type = RedisValue::kArray;
      for (size_t i = 0; i < reply.elements; ++i) value.elements.push_back(Convert(*reply.element[i]));
      break;
    default:
      break;
  }
  return value;
}

}  // namespace

absl::StatusOr<RedisAddress> ParseRedisUrl(absl::string_view url) {
  RedisAddress address;
  address.url = std::string(url);
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--redis-url ", url, ": ", why,
                                                   " (redis://HOST[:PORT][/DB] or unix:///PATH[?db=N])"));
  };
  absl::string_view rest = url;
  if (absl::ConsumePrefix(&rest, "unix://")) {
    absl::string_view path = rest;
    if (size_t q = rest.find('?'); q != absl::string_view::npos) {
      path = rest.substr(0, q);
      absl::string_view query = rest.substr(q + 1);
      if (!absl::ConsumePrefix(&query, "db=") || !absl::SimpleAtoi(query, &address.db) || address.db < 0) {
        return bad("the only query is db=N");
      }
    }
    if (!absl::StartsWith(path, "/")) return bad("the socket path must be absolute");
    address.path = std::string(path);
    return address;
  }
  if (!absl::ConsumePrefix(&rest, "redis://")) return bad("the scheme must be redis:// or unix://");
  if (absl::StrContains(rest, '@')) {
    return bad("credentials in the URL are not supported: give them with --redis-user and --redis-password-file "
               "(or $TURBOKV_REDIS_PASSWORD), which stay out of process lists and logs");
  }
  absl::string_view hostport = rest;
  if (size_t slash = rest.find('/'); slash != absl::string_view::npos) {
    hostport = rest.substr(0, slash);
    absl::string_view db = rest.substr(slash + 1);
    if (!db.empty() && (!absl::SimpleAtoi(db, &address.db) || address.db < 0)) return bad("the database must be a number");
  }
  if (size_t colon = hostport.rfind(':'); colon != absl::string_view::npos) {
    if (!absl::SimpleAtoi(hostport.substr(colon + 1), &address.port) || address.port <= 0 || address.port > 65535) {
      return bad("the port must be 1 to 65535");
    }
    hostport = hostport.substr(0, colon);
  }
  if (hostport.empty()) return bad("no host");
  address.host = std::string(hostport);
  return address;
}

RedisConnection::RedisConnection(RedisAddress address, absl::Duration timeout)
    : address_(std::move(address)), timeout_(timeout) {}

RedisConnection::~RedisConnection() {
  if (context_ != nullptr) redisFree(context_);
}

absl::Status RedisConnection::Fail(absl::string_view what) {
  std::string message = absl::StrCat("Redis at ", address_.url, ": ", what);
  if (context_ != nullptr) {
    // A reply that timed out reads EAGAIN's "Resource temporarily
    // unavailable": the message has said so already.
    if (context_->err != 0 && std::strcmp(context_->errstr, std::strerror(EAGAIN)) != 0) {
      absl::StrAppend(&message, ": ", context_->errstr);
    }
    redisFree(context_);
    context_ = nullptr;
  }
  return absl::UnavailableError(message);
}

absl::Status RedisConnection::Connect() {
  if (context_ != nullptr) return absl::OkStatus();
  const timeval tv = absl::ToTimeval(timeout_);
  context_ = address_.path.empty() ? redisConnectWithTimeout(address_.host.c_str(), address_.port, tv)
                                   : redisConnectUnixWithTimeout(address_.path.c_str(), tv);
  if (context_ == nullptr) return absl::UnavailableError(absl::StrCat("Redis at ", address_.url, ": out of memory"));
  if (context_->err != 0) return Fail("cannot connect");
  if (redisSetTimeout(context_, tv) != REDIS_OK) return Fail("cannot set the timeout");
  if (address_.path.empty() && redisEnableKeepAlive(context_) != REDIS_OK) return Fail("cannot set TCP keepalive");
  refused_credentials_ = false;
  if (!address_.password.empty()) {
    std::vector<std::string> auth = {"AUTH"};
    if (!address_.user.empty()) auth.push_back(address_.user);
    auth.push_back(address_.password);
    absl::StatusOr<RedisValue> authed = Run(std::move(auth));
    if (!authed.ok()) return authed.status();
    if (authed->type == RedisValue::kError) {
      // Redis's reply (WRONGPASS ..., or ERR AUTH ... called without any
      // password configured) never holds the password.
      refused_credentials_ = true;
      return Fail(absl::StrCat("refused the credentials of user '", address_.user.empty() ? "default" : address_.user,
                               "': ", authed->str));
    }
  }
  if (address_.db != 0) {
    absl::StatusOr<RedisValue> selected = Run({"SELECT", std::to_string(address_.db)});
    if (!selected.ok()) return selected.status();
    if (selected->type == RedisValue::kError) return Fail(absl::StrCat("SELECT ", address_.db, ": ", selected->str));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RedisValue>> RedisConnection::Run(const std::vector<std::vector<std::string>>& commands) {
  if (absl::Status status = Connect(); !status.ok()) return status;
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const std::vector<std::string>& command : commands) {
    argv.clear();
    lengths.clear();
    for (const std::string& arg : command) {
      argv.push_back(arg.data());
      lengths.push_back(arg.size());
    }
    if (redisAppendCommandArgv(context_, static_cast<int>(argv.size()), argv.data(), lengths.data()) != REDIS_OK) {
      return Fail("cannot send");
    }
  }
  std::vector<RedisValue> replies;
  replies.reserve(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    void* reply = nullptr;
    if (redisGetReply(context_, &reply) != REDIS_OK || reply == nullptr) {
      return Fail(absl::StrCat("no reply to ", commands[i].empty() ? "" : commands[i][0], " within ",
                               absl::FormatDuration(timeout_)));
    }
    replies.push_back(Convert(*static_cast<redisReply*>(reply)));
    freeReplyObject(reply);
  }
  return replies;
}

absl::StatusOr<RedisValue> RedisConnection::Run(std::vector<std::string> command) {
  absl::StatusOr<std::vector<RedisValue>> replies = Run(std::vector<std::vector<std::string>>{std::move(command)});
  if (!replies.ok()) return replies.status();
  return std::move(replies->front());
}

}  // namespace turbokv
