#include "service/store/tiers/redis_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
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
  // A URL with credentials is shown without them.
  std::string shown(url);
  if (const size_t at = shown.find('@'), scheme = shown.find("://");
      at != std::string::npos && scheme != std::string::npos && scheme < at) {
    shown.replace(scheme + 3, at - scheme - 3, "...");
  }
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--redis-url ", shown, ": ", why,
                                                   " (redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] or unix:///PATH[?db=N])"));
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
  address.tls = absl::ConsumePrefix(&rest, "rediss://");
  if (!address.tls && !absl::ConsumePrefix(&rest, "redis://")) {
    return bad("the scheme must be redis://, rediss:// or unix://");
  }
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
  Close();
  if (ssl_context_ != nullptr) SSL_CTX_free(ssl_context_);
}

void RedisConnection::Close() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  ssl_ = nullptr;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  if (reader_ != nullptr) redisReaderFree(reader_);
  reader_ = nullptr;
}

absl::Status RedisConnection::Fail(absl::string_view what, absl::string_view reason) {
  Close();
  std::string message = absl::StrCat("Redis at ", address_.url, ": ", what);
  if (!reason.empty()) absl::StrAppend(&message, ": ", reason);
  return absl::UnavailableError(message);
}

namespace {

// OpenSSL's first queued error, as text (empty with none); the queue is
// emptied. *ours: whether it is Redis refusing this daemon's certificate (or
// its lack of one), which trying again will not mend.
std::string TlsError(bool* ours = nullptr) {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "";
  if (ours != nullptr) {
    const int reason = ERR_GET_REASON(code);
    *ours = reason == SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED || reason == SSL_R_TLSV1_ALERT_UNKNOWN_CA ||
            reason == SSL_R_SSLV3_ALERT_BAD_CERTIFICATE || reason == SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN ||
            reason == SSL_R_TLSV1_ALERT_ACCESS_DENIED;
  }
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

// errno as text, except a timeout's EAGAIN: the message says so already.
std::string SystemError(int error) {
  return error == 0 || error == EAGAIN || error == EWOULDBLOCK ? "" : std::strerror(error);
}

}  // namespace

absl::Status RedisConnection::Dial() {
  const int timeout_ms = static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout_)));
  // Each address in turn: a non-blocking connect, waited for within the timeout.
  auto attempt = [&](int family, const sockaddr* to, socklen_t length) -> int {
    const int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return errno;
    int error = 0;
    if (connect(fd, to, length) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        pollfd p = {fd, POLLOUT, 0};
        const int ready = poll(&p, 1, timeout_ms);
        socklen_t size = sizeof(error);
        if (ready == 0) {
          error = ETIMEDOUT;
        } else if (ready < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0) {
          error = errno;
        }
      }
    }
    if (error != 0) {
      close(fd);
      return error;
    }
    fd_ = fd;
    return 0;
  };
  int error = 0;
  if (!address_.path.empty()) {
    sockaddr_un to = {};
    to.sun_family = AF_UNIX;
    if (address_.path.size() >= sizeof(to.sun_path)) return Fail("cannot connect", "the socket path is too long");
    std::memcpy(to.sun_path, address_.path.data(), address_.path.size());
    error = attempt(AF_UNIX, reinterpret_cast<const sockaddr*>(&to), sizeof(to));
  } else {
    addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int code = getaddrinfo(address_.host.c_str(), std::to_string(address_.port).c_str(), &hints, &found);
        code != 0) {
      return Fail("cannot connect", gai_strerror(code));
    }
    error = ENOENT;
    for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) error = attempt(a->ai_family, a->ai_addr, a->ai_addrlen);
    freeaddrinfo(found);
  }
  if (fd_ < 0) return Fail("cannot connect", error == ETIMEDOUT ? "timed out" : std::strerror(error));
  // Blocking from now on, every read and write within the timeout.
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  const timeval tv = absl::ToTimeval(timeout_);
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (address_.path.empty()) {
    const int on = 1;
    setsockopt(fd_, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
  }
  return absl::OkStatus();
}

absl::Status RedisConnection::Handshake() {
  auto unusable = [&](absl::string_view what) {
    misconfigured_ = true;
    return Fail(what, TlsError());
  };
  if (ssl_context_ == nullptr) {
    ssl_context_ = SSL_CTX_new(TLS_client_method());
    if (ssl_context_ == nullptr) return Fail("cannot set up TLS", TlsError());
    SSL_CTX_set_min_proto_version(ssl_context_, TLS1_2_VERSION);
    SSL_CTX_set_verify(ssl_context_, SSL_VERIFY_PEER, nullptr);
    const bool trusted = address_.tls_ca.empty()
                             ? SSL_CTX_set_default_verify_paths(ssl_context_) == 1
                             : SSL_CTX_load_verify_locations(ssl_context_, address_.tls_ca.c_str(), nullptr) == 1;
    if (!trusted) {
      SSL_CTX_free(ssl_context_);
      ssl_context_ = nullptr;
      return unusable(absl::StrCat("cannot use the CA file '", address_.tls_ca, "' (--redis-tls-ca)"));
    }
    if (!address_.tls_cert.empty() &&
        (SSL_CTX_use_certificate_chain_file(ssl_context_, address_.tls_cert.c_str()) != 1 ||
         SSL_CTX_use_PrivateKey_file(ssl_context_, address_.tls_key.c_str(), SSL_FILETYPE_PEM) != 1 ||
         SSL_CTX_check_private_key(ssl_context_) != 1)) {
      SSL_CTX_free(ssl_context_);
      ssl_context_ = nullptr;
      return unusable(absl::StrCat("cannot use the client certificate '", address_.tls_cert, "' and key '",
                                   address_.tls_key, "' (--redis-tls-cert, --redis-tls-key)"));
    }
  }
  ERR_clear_error();
  ssl_ = SSL_new(ssl_context_);
  if (ssl_ == nullptr || SSL_set_fd(ssl_, fd_) != 1) return Fail("cannot set up TLS", TlsError());
  // The name (or address) in the URL is what the certificate must name.
  in6_addr ip;
  const bool literal = inet_pton(AF_INET, address_.host.c_str(), &ip) == 1 ||
                       inet_pton(AF_INET6, address_.host.c_str(), &ip) == 1;
  const bool named = literal ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl_), address_.host.c_str()) == 1
                             : SSL_set_tlsext_host_name(ssl_, address_.host.c_str()) == 1 &&
                                   SSL_set1_host(ssl_, address_.host.c_str()) == 1;
  if (!named) return Fail("cannot set up TLS", TlsError());
  if (SSL_connect(ssl_) != 1) {
    const long verified = SSL_get_verify_result(ssl_);
    if (verified != X509_V_OK) {
      misconfigured_ = true;
      ERR_clear_error();
      return Fail("the TLS handshake failed",
                  absl::StrCat("the server's certificate: ", X509_verify_cert_error_string(verified)));
    }
    bool ours = false;
    const std::string reason = TlsError(&ours);
    misconfigured_ = ours;
    std::string why = reason.empty() ? SystemError(errno) : reason;
    if (why.empty()) why = "no TLS from the server (is the port Redis's TLS port?)";
    return Fail("the TLS handshake failed", why);
  }
  return absl::OkStatus();
}

absl::Status RedisConnection::Connect() {
  if (fd_ >= 0) return absl::OkStatus();
  misconfigured_ = false;
  if (absl::Status status = Dial(); !status.ok()) return status;
  if (address_.tls) {
    if (absl::Status status = Handshake(); !status.ok()) return status;
  }
  reader_ = redisReaderCreate();
  if (reader_ == nullptr) return Fail("out of memory");
  if (!address_.password.empty()) {
    std::vector<std::string> auth = {"AUTH"};
    if (!address_.user.empty()) auth.push_back(address_.user);
    auth.push_back(address_.password);
    absl::StatusOr<RedisValue> authed = Run(std::move(auth));
    if (!authed.ok()) return authed.status();
    if (authed->type == RedisValue::kError) {
      // Redis's reply (WRONGPASS ..., or ERR AUTH ... called without any
      // password configured) never holds the password. Another error (ERR
      // max number of clients reached) is no reason to give up.
      misconfigured_ = absl::StartsWith(authed->str, "WRONGPASS") || absl::StartsWith(authed->str, "NOPERM") ||
                       absl::StrContains(authed->str, "AUTH");
      return Fail(absl::StrCat("refused the credentials of user '", address_.user.empty() ? "default" : address_.user,
                               "'"),
                  authed->str);
    }
  }
  if (address_.db != 0) {
    absl::StatusOr<RedisValue> selected = Run({"SELECT", std::to_string(address_.db)});
    if (!selected.ok()) return selected.status();
    if (selected->type == RedisValue::kError) return Fail(absl::StrCat("SELECT ", address_.db), selected->str);
  }
  return absl::OkStatus();
}

absl::Status RedisConnection::SendAll(const std::string& bytes, absl::string_view what) {
  for (size_t sent = 0; sent < bytes.size();) {
    const size_t left = bytes.size() - sent;
    ssize_t n;
    if (ssl_ != nullptr) {
      ERR_clear_error();
      n = SSL_write(ssl_, bytes.data() + sent, static_cast<int>(std::min<size_t>(left, 1 << 30)));
    } else {
      n = send(fd_, bytes.data() + sent, left, MSG_NOSIGNAL);
    }
    if (n <= 0) {
      const int error = errno;
      if (error == EINTR && ssl_ == nullptr) continue;
      const std::string reason = ssl_ != nullptr ? TlsError() : "";
      return Fail(absl::StrCat("cannot send ", what, " within ", absl::FormatDuration(timeout_)),
                  reason.empty() ? SystemError(error) : reason);
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> RedisConnection::Receive(char* buf, size_t size) {
  for (;;) {
    ssize_t n;
    if (ssl_ != nullptr) {
      ERR_clear_error();
      n = SSL_read(ssl_, buf, static_cast<int>(size));
    } else {
      n = recv(fd_, buf, size, 0);
    }
    if (n > 0) return static_cast<size_t>(n);
    const int error = n == 0 ? 0 : errno;
    if (error == EINTR && ssl_ == nullptr) continue;
    bool ours = false;
    std::string reason = ssl_ != nullptr ? TlsError(&ours) : "";
    // With TLS 1.3 Redis refuses a client certificate after the handshake,
    // at the first read.
    if (ours) misconfigured_ = true;
    if (reason.empty()) reason = n == 0 ? "the connection was closed" : SystemError(error);
    return absl::UnavailableError(reason);
  }
}

absl::StatusOr<std::vector<RedisValue>> RedisConnection::Run(const std::vector<std::vector<std::string>>& commands) {
  if (absl::Status status = Connect(); !status.ok()) return status;
  std::string out;
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const std::vector<std::string>& command : commands) {
    argv.clear();
    lengths.clear();
    for (const std::string& arg : command) {
      argv.push_back(arg.data());
      lengths.push_back(arg.size());
    }
    char* formatted = nullptr;
    const int n = redisFormatCommandArgv(&formatted, static_cast<int>(argv.size()), argv.data(), lengths.data());
    if (n < 0) return Fail("out of memory");
    out.append(formatted, static_cast<size_t>(n));
    redisFreeCommand(formatted);
  }
  const std::string first = commands.empty() || commands[0].empty() ? "" : commands[0][0];
  if (absl::Status status = SendAll(out, first); !status.ok()) return status;
  std::vector<RedisValue> replies;
  replies.reserve(commands.size());
  std::vector<char> buf(size_t{64} << 10);
  for (size_t i = 0; i < commands.size(); ++i) {
    void* reply = nullptr;
    for (;;) {
      if (redisReaderGetReply(reader_, &reply) != REDIS_OK) return Fail("a reply that is not Redis's protocol");
      if (reply != nullptr) break;
      absl::StatusOr<size_t> got = Receive(buf.data(), buf.size());
      if (!got.ok()) {
        return Fail(absl::StrCat("no reply to ", commands[i].empty() ? "" : commands[i][0], " within ",
                                 absl::FormatDuration(timeout_)),
                    got.status().message());
      }
      redisReaderFeed(reader_, buf.data(), *got);
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
