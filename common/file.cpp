#include "common/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fm {

Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return NotFound(path + ": cannot open (" + std::strerror(errno) + ")");
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return NotFound(path + ": cannot stat (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) return InvalidArgument(path + ": not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes)
    return InvalidArgument(path + ": " + std::to_string(size) + " bytes, more than the " +
                           std::to_string(max_bytes) + " this file may hold");
  std::string out(size, '\0');
  uint64_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(fd, out.data() + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return NotFound(path + ": read failed (" + std::strerror(errno) + ")");
    if (n == 0) break;   // shrank while read: what is there
    got += static_cast<uint64_t>(n);
  }
  out.resize(got);
  return out;
}

}  // namespace fm
