#include "common/status.h"

namespace fm {

const char* CodeName(Code c) {
  switch (c) {
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kOutOfRange: return "OUT_OF_RANGE";
    case Code::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case Code::kUnavailable: return "UNAVAILABLE";
    case Code::kUnauthenticated: return "UNAUTHENTICATED";
    case Code::kInternal: return "INTERNAL";
    case Code::kCancelled: return "CANCELLED";
    case Code::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case Code::kFailedPrecondition: return "FAILED_PRECONDITION";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + msg_;
}

}  // namespace fm
