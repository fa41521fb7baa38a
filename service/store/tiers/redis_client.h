// One blocking connection to Redis, over a unix socket, TCP or TLS (OpenSSL),
// with a time limit on connecting and on every reply, for the Redis tier's
// threads; to a Redis Cluster, a connection to each master, commands routed
// by the slot of their key and MOVED and ASK followed. Commands are written
// and replies parsed by hiredis's protocol functions (Debian's hiredis 0.14
// has no TLS of its own). Not thread-safe: each thread has its own. No gRPC
// types.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct redisReader;
struct ssl_st;
struct ssl_ctx_st;

namespace turbokv {

// Where Redis is: redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] (TLS)
// or unix:///PATH[?db=N]. A Redis Cluster is any of its nodes, or several
// (redis://HOST1:PORT1,HOST2:PORT2,...: seeds tried in turn), database 0.
struct RedisAddress {
  std::string host;  // empty for a unix socket; the first seed
  int port = 6379;
  std::vector<std::pair<std::string, int>> seeds;  // every HOST:PORT given (TCP), the first one first
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

// The Redis Cluster slot of a key (CRC16 of its hash tag, the part between
// the first '{' and the next '}' when not empty, or of the whole key).
int RedisClusterSlot(absl::string_view key);

// One connection to one Redis node.
class RedisNodeConnection {
 public:
  RedisNodeConnection(RedisAddress address, absl::Duration timeout);
  ~RedisNodeConnection();
  RedisNodeConnection(const RedisNodeConnection&) = delete;
  RedisNodeConnection& operator=(const RedisNodeConnection&) = delete;

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
  // Run, once; *closed: it failed because Redis had closed the connection
  // before it answered anything.
  absl::StatusOr<std::vector<RedisValue>> RunOnce(const std::vector<std::vector<std::string>>& commands, bool* closed);
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

// Redis, standalone or a cluster (found out at the first call: CLUSTER
// SLOTS answered), as one connection.
class RedisConnection {
 public:
  RedisConnection(RedisAddress address, absl::Duration timeout);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Sends the commands and reads their replies, in order. A cluster's go to
  // the masters of their keys' slots (commands without a key to any),
  // pipelined per master (a slot's in order, but for those a redirection
  // sends again after later ones were answered); a MOVED reply updates the
  // map (the whole of it, once a call) and the command goes to the new
  // master, an ASK sends it to the node named (after ASKING), a TRYAGAIN
  // sends it again for up to the timeout, and a master that does not answer
  // has the map read again from the other nodes: its commands go where the
  // map sends them then, or answer a CLUSTERDOWN error reply of their own
  // (the others answered as usual). UNAVAILABLE as a node's connection says
  // when no command could be sent (or after too many redirections); the
  // whole call within about three timeouts. A Redis error reply is a
  // RedisValue of kError, not an error.
  absl::StatusOr<std::vector<RedisValue>> Run(const std::vector<std::vector<std::string>>& commands);
  // One command.
  absl::StatusOr<RedisValue> Run(std::vector<std::string> command);
  // The commands on every master (one, standalone): each node's replies,
  // or why it did not answer, by its host:port (or socket path). The
  // error of a master when none answered.
  struct NodeReplies {
    std::string node;
    absl::StatusOr<std::vector<RedisValue>> replies;
  };
  absl::StatusOr<std::vector<NodeReplies>> RunOnEveryNode(const std::vector<std::vector<std::string>>& commands);
  // The master (host:port) that serves this key's slot as last known; the
  // one Redis, standalone; "" when none is known.
  std::string NodeOf(absl::string_view key) const;

  const RedisAddress& address() const { return address_; }
  // Whether the last connection failed for a reason that trying again will
  // not mend (RedisNodeConnection::misconfigured).
  bool misconfigured() const { return misconfigured_; }
  // Whether Redis is a cluster (known once a call has reached it).
  bool cluster() const { return cluster_; }

 private:
  // Connects to the first seed that answers and finds out whether it is a
  // cluster (reading the slot map then).
  absl::Status Discover();
  // The slot map again, from any node that answers but `silent` (nodes
  // that did not answer just now), asking no node after `deadline`.
  absl::Status RefreshSlots(const std::vector<size_t>& silent, absl::Time deadline);
  // The slot map from this reply to CLUSTER SLOTS; false when it is not one.
  bool ReadSlots(const RedisValue& reply, const std::string& asked_host);
  // The connection to the node at host:port (made on first use).
  size_t Node(const std::string& host, int port);
  absl::StatusOr<std::vector<RedisValue>> RunOnCluster(const std::vector<std::vector<std::string>>& commands);

  const RedisAddress address_;
  const absl::Duration timeout_;
  bool discovered_ = false;
  bool cluster_ = false;
  bool misconfigured_ = false;
  std::vector<std::unique_ptr<RedisNodeConnection>> nodes_;  // standalone: one
  std::vector<std::string> node_names_;                      // host:port of each
  std::vector<int32_t> slots_;  // a cluster's: each slot's master, an index in nodes_ (-1: none known)
  std::vector<absl::Time> silent_since_;  // of each node: when it last did not answer (InfinitePast: it did)
};

}  // namespace turbokv
