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
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

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
    return absl::InvalidArgumentError(
        absl::StrCat("--redis-url ", shown, ": ", why,
                     " (redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] or unix:///PATH[?db=N]; a cluster: "
                     "redis://HOST1:PORT1,HOST2:PORT2,...)"));
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
    if (absl::StrContains(db, ',')) return bad("the database goes after the last seed (redis://H1:P1,H2:P2/DB)");
    if (!db.empty() && (!absl::SimpleAtoi(db, &address.db) || address.db < 0)) return bad("the database must be a number");
  }
  for (absl::string_view seed : absl::StrSplit(hostport, ',')) {
    if (absl::StrContains(seed, ' ')) return bad("a seed holds a space");
    int port = 6379;
    if (size_t colon = seed.rfind(':'); colon != absl::string_view::npos) {
      if (!absl::SimpleAtoi(seed.substr(colon + 1), &port) || port <= 0 || port > 65535) {
        return bad("the port must be 1 to 65535");
      }
      seed = seed.substr(0, colon);
    }
    if (seed.empty()) return bad("no host");
    int number = 0;
    if (absl::SimpleAtoi(seed, &number)) return bad("a seed is HOST:PORT, not a port alone");
    address.seeds.emplace_back(std::string(seed), port);
  }
  address.host = address.seeds.front().first;
  address.port = address.seeds.front().second;
  return address;
}

int RedisClusterSlot(absl::string_view key) {
  if (const size_t open = key.find('{'); open != absl::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != absl::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  // CRC16-CCITT (XMODEM), as Redis Cluster's key distribution specifies.
  uint16_t crc = 0;
  for (const char c : key) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(c)) << 8;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021) : crc << 1;
  }
  return crc & 16383;
}

RedisNodeConnection::RedisNodeConnection(RedisAddress address, absl::Duration timeout)
    : address_(std::move(address)), timeout_(timeout) {}

RedisNodeConnection::~RedisNodeConnection() {
  Close();
  if (ssl_context_ != nullptr) SSL_CTX_free(ssl_context_);
}

void RedisNodeConnection::Close() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  ssl_ = nullptr;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  if (reader_ != nullptr) redisReaderFree(reader_);
  reader_ = nullptr;
}

absl::Status RedisNodeConnection::Fail(absl::string_view what, absl::string_view reason) {
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

absl::Status RedisNodeConnection::Dial() {
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

absl::Status RedisNodeConnection::Handshake() {
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

absl::Status RedisNodeConnection::Connect() {
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
    if (selected->type == RedisValue::kError) {
      // A cluster node has database 0 only: no retry mends that.
      misconfigured_ = absl::StrContains(selected->str, "cluster mode");
      return Fail(absl::StrCat("SELECT ", address_.db),
                  misconfigured_ ? absl::StrCat(selected->str, " (a Redis Cluster has database 0 only)") : selected->str);
    }
  }
  return absl::OkStatus();
}

absl::Status RedisNodeConnection::SendAll(const std::string& bytes, absl::string_view what) {
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

absl::StatusOr<size_t> RedisNodeConnection::Receive(char* buf, size_t size) {
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

absl::StatusOr<std::vector<RedisValue>> RedisNodeConnection::Run(const std::vector<std::vector<std::string>>& commands) {
  // A connection kept from before that Redis has closed since (a restart,
  // its idle timeout) fails the first command sent on it, before anything
  // is read: sent again once on a new one. The tier's commands may be sent
  // twice (its writes are fenced, and land on the same keys and slots).
  const bool kept = fd_ >= 0;
  bool closed = false;
  absl::StatusOr<std::vector<RedisValue>> replies = RunOnce(commands, &closed);
  if (!replies.ok() && kept && closed) replies = RunOnce(commands, &closed);
  return replies;
}

absl::StatusOr<std::vector<RedisValue>> RedisNodeConnection::RunOnce(const std::vector<std::vector<std::string>>& commands,
                                                                    bool* closed) {
  *closed = false;
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
  if (absl::Status status = SendAll(out, first); !status.ok()) {
    *closed = absl::StrContains(status.message(), std::strerror(EPIPE)) ||
              absl::StrContains(status.message(), std::strerror(ECONNRESET));
    return status;
  }
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
        const bool eof = got.status().message() == "the connection was closed" ||
                         got.status().message() == std::strerror(ECONNRESET);
        *closed = eof && i == 0 && replies.empty();
        return Fail(eof ? absl::StrCat("the connection was closed before the reply to ",
                                       commands[i].empty() ? "" : commands[i][0])
                        : absl::StrCat("no reply to ", commands[i].empty() ? "" : commands[i][0], " within ",
                                       absl::FormatDuration(timeout_)),
                    eof ? "" : got.status().message());
      }
      redisReaderFeed(reader_, buf.data(), *got);
    }
    replies.push_back(Convert(*static_cast<redisReply*>(reply)));
    freeReplyObject(reply);
  }
  return replies;
}

absl::StatusOr<RedisValue> RedisNodeConnection::Run(std::vector<std::string> command) {
  absl::StatusOr<std::vector<RedisValue>> replies = Run(std::vector<std::vector<std::string>>{std::move(command)});
  if (!replies.ok()) return replies.status();
  return std::move(replies->front());
}

namespace {

constexpr int kSlots = 16384;
constexpr int kMostRedirects = 5;

// The argument that holds a command's key (its slot's), or -1 for a
// command without one. The tier's commands: EVAL with its KEYS, and
// single-key commands (GET, SET, DEL, PEXPIRE, HGETALL, ...); keyless ones
// go to any master (RunOnEveryNode for those meant for every one).
int KeyArgument(const std::vector<std::string>& command) {
  if (command.empty()) return -1;
  const std::string name = absl::AsciiStrToUpper(command[0]);
  if (name == "EVAL" || name == "EVALSHA") {
    int keys = 0;
    return command.size() > 3 && absl::SimpleAtoi(command[2], &keys) && keys > 0 ? 3 : -1;
  }
  for (const char* keyless : {"PING", "INFO", "CONFIG", "AUTH", "SELECT", "CLUSTER", "CLIENT", "DBSIZE", "SCRIPT",
                              "COMMAND", "HELLO", "ASKING", "READONLY", "WAIT", "FLUSHALL", "KEYS", "SCAN"}) {
    if (name == keyless) return -1;
  }
  return command.size() > 1 ? 1 : -1;
}

// Host and port of a MOVED or ASK reply's "SLOT HOST:PORT" (an empty host:
// the node that answered, `asked`).
bool Redirect(const std::string& error, absl::string_view kind, const std::string& asked, std::string* host,
              int* port) {
  absl::string_view rest = error;
  if (!absl::ConsumePrefix(&rest, kind) || !absl::ConsumePrefix(&rest, " ")) return false;
  const size_t space = rest.find(' ');
  if (space == absl::string_view::npos) return false;
  absl::string_view where = rest.substr(space + 1);
  const size_t colon = where.rfind(':');
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(where.substr(colon + 1), port)) return false;
  *host = where.substr(0, colon).empty() ? asked : std::string(where.substr(0, colon));
  return true;
}

// Whether an error reply to CLUSTER SLOTS says that Redis is not a cluster.
bool NotACluster(const std::string& error) {
  return absl::StrContains(error, "cluster support disabled") || absl::StartsWith(error, "ERR unknown command");
}

}  // namespace

RedisConnection::RedisConnection(RedisAddress address, absl::Duration timeout)
    : address_(std::move(address)), timeout_(timeout) {}

RedisConnection::~RedisConnection() = default;

size_t RedisConnection::Node(const std::string& host, int port) {
  const std::string name = absl::StrCat(host, ":", port);
  for (size_t i = 0; i < node_names_.size(); ++i) {
    if (node_names_[i] == name) return i;
  }
  RedisAddress node = address_;
  node.host = host;
  node.port = port;
  node.path.clear();
  node.seeds = {{host, port}};
  node.url = absl::StrCat(address_.tls ? "rediss://" : "redis://", name);
  nodes_.push_back(std::make_unique<RedisNodeConnection>(std::move(node), timeout_));
  node_names_.push_back(name);
  silent_since_.push_back(absl::InfinitePast());
  return nodes_.size() - 1;
}

bool RedisConnection::ReadSlots(const RedisValue& reply, const std::string& asked_host) {
  if (reply.type != RedisValue::kArray || reply.elements.empty()) return false;
  std::vector<std::pair<std::pair<long long, long long>, std::pair<std::string, int>>> ranges;
  for (const RedisValue& range : reply.elements) {
    if (range.type != RedisValue::kArray || range.elements.size() < 3 || range.elements[2].type != RedisValue::kArray ||
        range.elements[2].elements.size() < 2) {
      return false;
    }
    const long long first = range.elements[0].integer, last = range.elements[1].integer;
    const RedisValue& master = range.elements[2];
    // An empty host is the node that answered's; "?" is not known yet.
    const std::string& named = master.elements[0].str;
    if (named == "?") continue;
    if (first < 0 || last >= kSlots || first > last) return false;
    ranges.push_back({{first, last}, {named.empty() ? asked_host : named, static_cast<int>(master.elements[1].integer)}});
  }
  std::vector<int32_t> slots(kSlots, -1);
  for (const auto& [range, master] : ranges) {
    const int32_t node = static_cast<int32_t>(Node(master.first, master.second));
    for (long long slot = range.first; slot <= range.second; ++slot) slots[static_cast<size_t>(slot)] = node;
  }
  slots_ = std::move(slots);
  return true;
}

absl::Status RedisConnection::Discover() {
  if (discovered_) return absl::OkStatus();
  // Each seed in turn (a unix socket's URL is its one seed).
  std::vector<std::pair<std::string, int>> seeds = address_.seeds;
  if (seeds.empty()) seeds.emplace_back("", 0);
  absl::Status last;
  for (const auto& [host, port] : seeds) {
    RedisAddress seed = address_;
    if (!host.empty()) {
      seed.host = host;
      seed.port = port;
    }
    auto node = std::make_unique<RedisNodeConnection>(seed, timeout_);
    absl::StatusOr<RedisValue> slots = node->Run(std::vector<std::string>{"CLUSTER", "SLOTS"});
    misconfigured_ = node->misconfigured();
    if (!slots.ok()) {
      last = slots.status();
      if (misconfigured_) return last;
      continue;
    }
    if (slots->type == RedisValue::kError) {
      if (absl::StartsWith(slots->str, "NOPERM")) {
        // May this user not ask, or is there no cluster to ask about?
        absl::StatusOr<RedisValue> info = node->Run(std::vector<std::string>{"INFO", "cluster"});
        if (info.ok() && absl::StrContains(info->str, "cluster_enabled:1")) {
          misconfigured_ = true;
          return absl::FailedPreconditionError(absl::StrCat("Redis Cluster at ", address_.url, " refused CLUSTER SLOTS (",
                                                            slots->str, "): user '",
                                                            address_.user.empty() ? "default" : address_.user,
                                                            "' needs it to find the masters"));
        }
      } else if (!NotACluster(slots->str) && !absl::StartsWith(slots->str, "NOAUTH")) {
        // Busy or loading: asked again at the next call.
        last = absl::UnavailableError(absl::StrCat("Redis at ", seed.url, ": CLUSTER SLOTS: ", slots->str));
        continue;
      }
      // Not a cluster: this node is Redis (one that wants a password this
      // daemon lacks says so to the facts the tier reads at start). Several
      // seeds name a cluster's nodes: one that is not is a mistake.
      if (address_.seeds.size() > 1 && !absl::StartsWith(slots->str, "NOAUTH")) {
        misconfigured_ = true;
        return absl::FailedPreconditionError(absl::StrCat(
            "--redis-url ", address_.url, " names several seeds (a Redis Cluster's nodes), but ", seed.host, ":",
            seed.port, " is not a cluster node (", slots->str, "); give a standalone Redis alone"));
      }
      nodes_.push_back(std::move(node));
      node_names_.push_back(seed.path.empty() ? absl::StrCat(seed.host, ":", seed.port) : seed.path);
      silent_since_.push_back(absl::InfinitePast());
      discovered_ = true;
      return absl::OkStatus();
    }
    if (!ReadSlots(*slots, seed.host)) {
      nodes_.clear();
      node_names_.clear();
      silent_since_.clear();
      last = absl::UnavailableError(absl::StrCat("Redis at ", seed.url, ": CLUSTER SLOTS answered something else"));
      continue;
    }
    if (address_.db != 0) {
      misconfigured_ = true;
      return absl::FailedPreconditionError(
          absl::StrCat("Redis Cluster at ", address_.url, " has database 0 only, not ", address_.db));
    }
    cluster_ = true;
    discovered_ = true;
    return absl::OkStatus();
  }
  return last;
}

absl::Status RedisConnection::RefreshSlots(const std::vector<size_t>& silent, absl::Time deadline) {
  absl::Status last = absl::UnavailableError(absl::StrCat("Redis Cluster at ", address_.url, ": no node answers"));
  // The masters of the map first, then the other nodes known, then the
  // seeds; those that did not answer lately last, and those that did not
  // just now not at all.
  std::vector<size_t> ask;
  for (int32_t node : slots_) {
    if (node >= 0 && std::find(ask.begin(), ask.end(), static_cast<size_t>(node)) == ask.end()) {
      ask.push_back(static_cast<size_t>(node));
    }
  }
  for (const auto& [host, port] : address_.seeds) Node(host, port);
  for (size_t node = 0; node < nodes_.size(); ++node) {
    if (std::find(ask.begin(), ask.end(), node) == ask.end()) ask.push_back(node);
  }
  std::stable_sort(ask.begin(), ask.end(), [&](size_t a, size_t b) { return silent_since_[a] < silent_since_[b]; });
  for (size_t node : ask) {
    if (std::find(silent.begin(), silent.end(), node) != silent.end()) continue;
    if (absl::Now() >= deadline) break;
    absl::StatusOr<RedisValue> slots = nodes_[node]->Run(std::vector<std::string>{"CLUSTER", "SLOTS"});
    if (!slots.ok()) {
      silent_since_[node] = absl::Now();
      last = slots.status();
      continue;
    }
    silent_since_[node] = absl::InfinitePast();
    if (ReadSlots(*slots, nodes_[node]->address().host)) return absl::OkStatus();
  }
  return last;
}

std::string RedisConnection::NodeOf(absl::string_view key) const {
  if (!cluster_) return node_names_.empty() ? "" : node_names_[0];
  const int32_t node = slots_[static_cast<size_t>(RedisClusterSlot(key))];
  return node < 0 ? "" : node_names_[static_cast<size_t>(node)];
}

absl::StatusOr<std::vector<RedisValue>> RedisConnection::Run(const std::vector<std::vector<std::string>>& commands) {
  misconfigured_ = false;
  if (absl::Status found = Discover(); !found.ok()) return found;
  if (!cluster_) {
    absl::StatusOr<std::vector<RedisValue>> replies = nodes_[0]->Run(commands);
    misconfigured_ = nodes_[0]->misconfigured();
    return replies;
  }
  return RunOnCluster(commands);
}

absl::StatusOr<RedisValue> RedisConnection::Run(std::vector<std::string> command) {
  absl::StatusOr<std::vector<RedisValue>> replies = Run(std::vector<std::vector<std::string>>{std::move(command)});
  if (!replies.ok()) return replies.status();
  return std::move(replies->front());
}

absl::StatusOr<std::vector<RedisValue>> RedisConnection::RunOnCluster(
    const std::vector<std::vector<std::string>>& commands) {
  std::vector<RedisValue> replies(commands.size());
  // Where each command not answered yet goes: its slot's master, or a node
  // an ASK named (-1: its slot's).
  std::vector<size_t> pending(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) pending[i] = i;
  std::vector<int64_t> asked(commands.size(), -1);
  std::vector<bool> unreached(commands.size(), false);  // its node did not answer, and still has its slot
  size_t any = 0;  // the node for commands without a key
  absl::Status failed;
  std::vector<size_t> silent;  // nodes that did not answer
  // The whole call within a few timeouts; a slot being moved answers
  // TRYAGAIN to a command whose keys are not all on one side yet: sent
  // again for up to one timeout, then that reply.
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + 3 * timeout_;
  const absl::Time busy_until = start + timeout_;
  int redirects = 0;
  bool refreshed = false;  // the whole map, after a MOVED
  for (int round = 0; !pending.empty(); ++round) {
    if (redirects > kMostRedirects || (round > 0 && absl::Now() >= deadline)) {
      if (!failed.ok()) return failed;
      return absl::UnavailableError(absl::StrCat("Redis Cluster at ", address_.url, ": still redirected after ",
                                                 redirects, " tries"));
    }
    // Grouped by node, in the order of their first command.
    std::vector<std::pair<size_t, std::vector<size_t>>> groups;
    for (size_t i : pending) {
      const int key = KeyArgument(commands[i]);
      while (std::find(silent.begin(), silent.end(), any) != silent.end() && silent.size() < nodes_.size()) {
        any = (any + 1) % nodes_.size();
      }
      size_t node = any;
      if (asked[i] >= 0) {
        node = static_cast<size_t>(asked[i]);
      } else if (key >= 0) {
        const int32_t master = slots_[static_cast<size_t>(RedisClusterSlot(commands[i][static_cast<size_t>(key)]))];
        if (master < 0) {
          unreached[i] = true;
          continue;
        }
        node = static_cast<size_t>(master);
      }
      // Still a node that did not answer (the map has not moved the slot
      // away: no failover yet).
      if (std::find(silent.begin(), silent.end(), node) != silent.end()) {
        unreached[i] = true;
        continue;
      }
      auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == node; });
      if (group == groups.end()) {
        groups.push_back({node, {}});
        group = groups.end() - 1;
      }
      group->second.push_back(i);
    }
    std::vector<size_t> again;
    bool refresh = false, busy = false, redirected = false;
    for (const auto& [node, indices] : groups) {
      std::vector<std::vector<std::string>> batch;
      for (size_t i : indices) {
        if (asked[i] >= 0) batch.push_back({"ASKING"});
        batch.push_back(commands[i]);
      }
      absl::StatusOr<std::vector<RedisValue>> got = nodes_[node]->Run(batch);
      if (!got.ok()) {
        // A master that does not answer (failed over, gone): the map again.
        misconfigured_ = nodes_[node]->misconfigured();
        if (misconfigured_) return got.status();
        failed = got.status();
        silent_since_[node] = absl::Now();
        refresh = true;
        redirected = true;
        silent.push_back(node);
        for (size_t i : indices) asked[i] = -1;
        again.insert(again.end(), indices.begin(), indices.end());
        continue;
      }
      silent_since_[node] = absl::InfinitePast();
      size_t at = 0;
      for (size_t i : indices) {
        if (asked[i] >= 0) ++at;  // ASKING's OK
        RedisValue& reply = (*got)[at++];
        std::string host;
        int port = 0;
        if (reply.type == RedisValue::kError &&
            Redirect(reply.str, "MOVED", nodes_[node]->address().host, &host, &port)) {
          const int key = KeyArgument(commands[i]);
          if (key >= 0) {
            slots_[static_cast<size_t>(RedisClusterSlot(commands[i][static_cast<size_t>(key)]))] =
                static_cast<int32_t>(Node(host, port));
          }
          asked[i] = -1;
          again.push_back(i);
          redirected = true;
          refresh = refresh || !refreshed;  // other slots have moved too, most likely
        } else if (reply.type == RedisValue::kError &&
                   Redirect(reply.str, "ASK", nodes_[node]->address().host, &host, &port)) {
          asked[i] = static_cast<int64_t>(Node(host, port));
          again.push_back(i);
          redirected = true;
        } else if (reply.type == RedisValue::kError && absl::StartsWith(reply.str, "TRYAGAIN") &&
                   absl::Now() + absl::Milliseconds(20) * (round + 1) < busy_until) {
          // A slot being moved, its keys on both nodes for now: shortly
          // again, to the same node.
          again.push_back(i);
          busy = true;
        } else {
          asked[i] = -1;
          replies[i] = std::move(reply);
        }
      }
    }
    if (refresh) {
      // The MOVED patches stay when the map cannot be read.
      const std::vector<int32_t> patched = slots_;
      if (!RefreshSlots(silent, deadline).ok()) slots_ = patched;
      refreshed = true;
    }
    if (busy) absl::SleepFor(absl::Milliseconds(20) * (round + 1));
    if (redirected) ++redirects;
    std::sort(again.begin(), again.end());
    pending = std::move(again);
  }
  // Commands whose master did not answer: an error for the whole call when
  // none was answered, else a reply of their own (CLUSTERDOWN, which the
  // caller takes for Redis refusing them for now), the others' replies kept.
  const size_t lost = static_cast<size_t>(std::count(unreached.begin(), unreached.end(), true));
  if (lost == commands.size() && lost > 0) {
    return failed.ok() ? absl::UnavailableError(absl::StrCat("Redis Cluster at ", address_.url,
                                                             ": no master serves the slot"))
                       : failed;
  }
  for (size_t i = 0; i < commands.size(); ++i) {
    if (!unreached[i]) continue;
    replies[i].type = RedisValue::kError;
    replies[i].str = absl::StrCat("CLUSTERDOWN its master did not answer: ",
                                  failed.ok() ? "no master serves the slot" : failed.message());
  }
  return replies;
}

absl::StatusOr<std::vector<RedisConnection::NodeReplies>> RedisConnection::RunOnEveryNode(
    const std::vector<std::vector<std::string>>& commands) {
  misconfigured_ = false;
  if (absl::Status found = Discover(); !found.ok()) return found;
  std::vector<size_t> masters;
  if (!cluster_) {
    masters.push_back(0);
  } else {
    for (int32_t node : slots_) {
      if (node >= 0 && std::find(masters.begin(), masters.end(), static_cast<size_t>(node)) == masters.end()) {
        masters.push_back(static_cast<size_t>(node));
      }
    }
  }
  std::vector<NodeReplies> all;
  std::vector<size_t> silent;
  for (size_t node : masters) {
    absl::StatusOr<std::vector<RedisValue>> replies = nodes_[node]->Run(commands);
    if (nodes_[node]->misconfigured()) {
      misconfigured_ = true;
      return replies.status();
    }
    if (!replies.ok()) silent.push_back(node);
    all.push_back(NodeReplies{node_names_[node], std::move(replies)});
  }
  if (cluster_ && !silent.empty()) RefreshSlots(silent, absl::Now() + timeout_).IgnoreError();
  // Standalone, or every master silent: the call's error.
  if (silent.size() == masters.size()) return all.front().replies.status();
  return all;
}

}  // namespace turbokv
