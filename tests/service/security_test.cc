// Bearer tokens and tenants, TLS and mTLS on TCP, the unix socket's mode:
// the real server in-process, certificates made by openssl for the test.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/server.h"

namespace turbokv {
namespace {

using ::testing::HasSubstr;

std::string Dir() {
  static const std::string dir = [] {
    std::string path = absl::StrCat(::testing::TempDir(), "turbokv-security-", getpid());
    std::system(("rm -rf " + path + " && mkdir -p " + path).c_str());
    return path;
  }();
  return dir;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// A CA, a server certificate for 127.0.0.1 it signed, a client certificate it
// signed, and a client certificate from another CA.
void MakeCertificates() {
  static bool made = false;
  if (made) return;
  made = true;
  const std::string d = Dir();
  Write(d + "/san.ext", "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
  const std::string script = absl::StrCat(
      "cd ", d, " && set -e && exec >openssl.log 2>&1\n",
      "for ca in ca other_ca; do openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=$ca ",
      "-keyout $ca.key -out $ca.pem; done\n",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=turbokvd -keyout server.key -out server.csr\n",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext ",
      "-out server.pem\n",
      "for c in client:ca stranger:other_ca; do n=${c%%:*}; ca=${c##*:}; ",
      "openssl req -newkey rsa:2048 -nodes -subj /CN=$n -keyout $n.key -out $n.csr; ",
      "openssl x509 -req -in $n.csr -CA $ca.pem -CAkey $ca.key -CAcreateserial -days 2 -out $n.pem; done\n");
  ASSERT_EQ(std::system(script.c_str()), 0) << Read(d + "/openssl.log");
}

std::unique_ptr<Server> Start(ServerOptions options) {
  options.device = "cpu";
  options.threads = 1;
  options.metrics_listen = "";
  auto server = Server::Create(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  absl::Status started = (*server)->Start();
  EXPECT_TRUE(started.ok()) << started;
  return *std::move(server);
}

SessionOptions Small() {
  SessionOptions options;
  options.head_dim = 64;
  return options;
}

TEST(SecurityTest, TokensNameTenantsAndTenantsSeeOnlyTheirSessions) {
  Write(Dir() + "/tokens", "# token tenant\nalpha-secret alpha\nbeta-secret beta\n\nalpha-2 alpha\n");
  ServerOptions options;
  options.listen = {absl::StrCat("unix://", Dir(), "/auth.sock")};
  options.auth_tokens_file = Dir() + "/tokens";
  std::unique_ptr<Server> server = Start(options);
  ASSERT_TRUE(server);
  auto connect = [&](const std::string& token) {
    ClientOptions client_options;
    client_options.auth_token = token;
    return Client::Connect(options.listen[0], client_options);
  };
  auto alpha = connect("alpha-secret"), alpha2 = connect("alpha-2"), beta = connect("beta-secret");
  auto nobody = connect(""), wrong = connect("guess");
  ASSERT_TRUE(nobody->WaitUntilServing(absl::Seconds(10)).ok());  // health needs no token

  auto missing = nobody->Stats();
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("no bearer token"));
  auto guessed = wrong->CreateSession(Small());
  EXPECT_EQ(guessed.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(std::string(guessed.status().message()), HasSubstr("unknown bearer token"));
  // Nothing but "Bearer", one space and the token: two spaces or a token
  // with a space after it are not the token.
  for (const char* almost : {" alpha-secret", "alpha-secret "}) {
    auto refused = connect(almost)->Stats();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << "'" << almost << "'";
  }

  auto session = alpha->CreateSession(Small());
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> k(4 * 64, 0.5f);
  ASSERT_TRUE(session->Append(0, 0, TensorData::F32(k), TensorData::F32(k)).ok());
  EXPECT_TRUE(alpha2->GetSession(session->id()).ok());  // same tenant, other token

  // Another tenant: the id is unknown, exactly as a made-up one.
  auto stolen = beta->GetSession(session->id());
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(stolen.status().message(), absl::StrCat("no session ", session->id()));
  EXPECT_EQ(beta->DeleteSession(session->id()).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(beta->ListSessions()->empty());
  EXPECT_EQ(alpha->ListSessions()->size(), 1u);
  // A stream with no token is refused too, and nothing is stored.
  auto unauthenticated_stream = nobody->OpenSession(session->id());
  EXPECT_EQ(unauthenticated_stream.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(alpha->GetSession(session->id())->layer_tokens(0), 4);
  EXPECT_TRUE(server->Shutdown(absl::Seconds(1)).ok());
}

TEST(SecurityTest, TheUnixSocketIsCreated0660) {
  ServerOptions options;
  const std::string path = Dir() + "/mode.sock";
  options.listen = {"unix://" + path};
  std::unique_ptr<Server> server = Start(options);
  ASSERT_TRUE(server);
  struct stat info;
  ASSERT_EQ(stat(path.c_str(), &info), 0);
  EXPECT_TRUE(S_ISSOCK(info.st_mode));
  EXPECT_EQ(info.st_mode & 0777, 0660u);
  EXPECT_TRUE(server->Shutdown(absl::Seconds(1)).ok());
}

TEST(SecurityTest, TlsAndMutualTlsOnTcp) {
  MakeCertificates();
  const std::string d = Dir();
  for (bool mutual : {false, true}) {
    SCOPED_TRACE(mutual ? "mTLS" : "TLS");
    ServerOptions options;
    options.listen = {"127.0.0.1:0"};
    options.tls_cert = d + "/server.pem";
    options.tls_key = d + "/server.key";
    if (mutual) options.tls_client_ca = d + "/ca.pem";
    std::unique_ptr<Server> server = Start(options);
    ASSERT_TRUE(server);
    const std::string target = server->endpoints()[0];
    auto connect = [&](const std::string& ca, const std::string& name) {
      ClientOptions client_options;
      client_options.timeout = absl::Seconds(5);
      if (!ca.empty()) client_options.tls_root_certs = Read(d + "/" + ca);
      if (!name.empty()) {
        client_options.tls_client_cert = Read(d + "/" + name + ".pem");
        client_options.tls_client_key = Read(d + "/" + name + ".key");
      }
      return Client::Connect(target, client_options);
    };
    EXPECT_EQ(connect("ca.pem", mutual ? "client" : "")->Stats().status().code(), absl::StatusCode::kOk);
    // Plaintext to a TLS port, and a client that does not trust the server's CA.
    EXPECT_EQ(connect("", "")->Stats().status().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(connect("other_ca.pem", mutual ? "client" : "")->Stats().status().code(),
              absl::StatusCode::kUnavailable);
    if (mutual) {
      // No client certificate, and one from an untrusted CA.
      EXPECT_EQ(connect("ca.pem", "")->Stats().status().code(), absl::StatusCode::kUnavailable);
      EXPECT_EQ(connect("ca.pem", "stranger")->Stats().status().code(), absl::StatusCode::kUnavailable);
    }
    EXPECT_TRUE(server->Shutdown(absl::Seconds(1)).ok());
  }
  // A key that is not the certificate's is named at Create, not a bare
  // "cannot listen" at Start.
  ServerOptions mismatched;
  mismatched.listen = {"127.0.0.1:0"};
  mismatched.metrics_listen = "";
  mismatched.tls_cert = d + "/server.pem";
  mismatched.tls_key = d + "/client.key";
  auto refused = Server::Create(mismatched);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("client.key is not the key of --tls-cert"));
  mismatched.tls_key = d + "/server.pem";
  EXPECT_THAT(std::string(Server::Create(mismatched).status().message()), HasSubstr("holds no PEM private key"));
}

TEST(SecurityTest, BadSecurityOptionsAreRefusedAtCreate) {
  ServerOptions options;
  options.listen = {absl::StrCat("unix://", Dir(), "/bad.sock")};
  options.metrics_listen = "";
  options.auth_tokens_file = Dir() + "/no-such-file";
  EXPECT_EQ(Server::Create(options).status().code(), absl::StatusCode::kNotFound);
  Write(Dir() + "/bad-tokens", "one-field-only\n");
  options.auth_tokens_file = Dir() + "/bad-tokens";
  auto bad = Server::Create(options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("bad-tokens:1: expected \"TOKEN TENANT\""));
  options.auth_tokens_file.clear();
  options.tls_cert = Dir() + "/server.pem";
  EXPECT_EQ(Server::Create(options).status().code(), absl::StatusCode::kInvalidArgument);  // no key
  options.tls_cert.clear();
  options.tls_client_ca = Dir() + "/ca.pem";
  EXPECT_EQ(Server::Create(options).status().code(), absl::StatusCode::kInvalidArgument);  // no cert
}

}  // namespace
}  // namespace turbokv
