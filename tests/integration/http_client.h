// A minimal blocking HTTP/1.1 client for the integration tests of the coordinator's HTTP API:
// raw sockets on 127.0.0.1, every wait bounded, the response bytes kept as they came so that
// tests can check framing byte by byte.
#pragma once
#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fm::it {

struct HttpResult {
  int status = 0;                              // 0: no response (connection failed / timeout)
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // everything after the header block
  std::string raw;                             // the whole response as received
};

// Sends `request` bytes as they are and reads until the server closes (or `timeout`).
HttpResult HttpRaw(int port, const std::string& request,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60));
// METHOD path with an optional JSON body and extra header lines ("Name: value"), Connection: close.
HttpResult HttpCall(int port, const std::string& method, const std::string& path,
                    const std::string& body = "", const std::vector<std::string>& headers = {},
                    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Fills status, headers and body from raw.
void ParseResponse(HttpResult* r);
// The bytes of METHOD path with an optional JSON body and extra header lines, Connection: close.
std::string Request(const std::string& method, const std::string& path, const std::string& body = "",
                    const std::vector<std::string>& headers = {});
// `request` over TLS, the server's certificate verified against `ca_file` for 127.0.0.1; on a
// failed connection or handshake, status 0 and *error says why.
HttpResult HttpsRaw(int port, const std::string& ca_file, const std::string& request,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60),
                    std::string* error = nullptr);

// A CA (DIR/ca.pem, ca.key) and a certificate for 127.0.0.1 signed by it (DIR/node.pem,
// node.key), made with the openssl command; false when openssl failed.
bool MakeTestCertificates(const std::string& dir);

// A connection left open: send a request, read some of the response, close at will.
class HttpStream {
 public:
  HttpStream(int port, const std::string& request);
  ~HttpStream();
  // Reads until `needle` has arrived `count` times in total, or `timeout`; everything so far.
  std::string ReadUntil(const std::string& needle, int count, std::chrono::milliseconds timeout);
  void Send(const std::string& bytes);   // more of the request
  void Close();

 private:
  int fd_ = -1;
  std::string got_;
};

std::string PostJson(const std::string& path, const std::string& body,
                     const std::vector<std::string>& headers = {});

}  // namespace fm::it
