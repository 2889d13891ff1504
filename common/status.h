// Status / Result<T>: the one error style of flashmesh. Every fallible function returns one;
// the message always names the thing that is wrong (file:line, tensor name, field name).
#pragma once
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace fm {

enum class Code {
  kOk = 0,
  kInvalidArgument,   // bad input from a user or a file
  kNotFound,          // missing file / tensor / field
  kOutOfRange,        // offsets, indices, context beyond limits
  kResourceExhausted, // queue full, memory plan does not fit
  kUnavailable,       // peer dead, timed out
  kUnauthenticated,
  kInternal,
  kCancelled,
  kDeadlineExceeded,
  kFailedPrecondition, // refused in this state (e.g. a stale coordinator term)
};

const char* CodeName(Code c);

// [[nodiscard]]: a dropped Status or Result is a compile warning (-Wunused-result).
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  std::string ToString() const;
  // Prepends context ("loading shard x: ") keeping the code.
  Status Wrap(const std::string& context) const {
    return ok() ? *this : Status(code_, context + ": " + msg_);
  }

 private:
  Code code_ = Code::kOk;
  std::string msg_;
};

inline Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
inline Status OutOfRange(std::string m) { return {Code::kOutOfRange, std::move(m)}; }
inline Status ResourceExhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
inline Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
inline Status Unauthenticated(std::string m) { return {Code::kUnauthenticated, std::move(m)}; }
inline Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }
inline Status Cancelled(std::string m) { return {Code::kCancelled, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) { return {Code::kDeadlineExceeded, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {Code::kFailedPrecondition, std::move(m)}; }

// Result<T>: a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}           // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}    // NOLINT: must be non-ok
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace fm

#define FM_CONCAT_INNER(a, b) a##b
#define FM_CONCAT(a, b) FM_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if it is not ok.
#define FM_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::fm::Status fm_status_ = (expr);         \
    if (!fm_status_.ok()) return fm_status_;  \
  } while (0)

// FM_ASSIGN_OR_RETURN(auto x, MakeX()); declares x from a Result or returns its Status.
#define FM_ASSIGN_OR_RETURN(decl, expr) \
  FM_ASSIGN_OR_RETURN_IMPL(FM_CONCAT(fm_result_, __LINE__), decl, expr)
#define FM_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  decl = std::move(tmp).value()
