#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

namespace fm {
namespace {

using json = nlohmann::json;

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Tensor names come from the file: keep them printable and short in messages.
std::string Quoted(const std::string& s) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 120; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (s.size() > 120) out += "...";
  return out + "'";
}

bool AsU64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

Status ParseEntry(const std::string& origin, const std::string& name, const json& v,
                  uint64_t data_size, SafetensorsTensor* t) {
  const std::string where = origin + ": tensor " + Quoted(name);
  if (!v.is_object()) return InvalidArgument(where + ": header entry is not a JSON object");
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string())
    return InvalidArgument(where + ": missing or non-string 'dtype'");
  if (!ParseDType(dt->get<std::string>(), &t->dtype))
    return InvalidArgument(where + ": unknown dtype " + Quoted(dt->get<std::string>()));
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return InvalidArgument(where + ": missing 'shape' array");
  if (sh->size() > 8) return InvalidArgument(where + ": shape has more than 8 dimensions");
  for (const auto& d : *sh) {
    uint64_t n;
    if (!AsU64(d, &n) || n > (1ull << 40))
      return InvalidArgument(where + ": shape entries must be integers in [0, 2^40]");
    t->shape.push_back(static_cast<int64_t>(n));
  }
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !AsU64((*off)[0], &t->begin) ||
      !AsU64((*off)[1], &t->end))
    return InvalidArgument(where + ": 'data_offsets' must be [begin, end] non-negative integers");
  if (t->begin > t->end)
    return InvalidArgument(where + ": data_offsets begin " + std::to_string(t->begin) +
                           " > end " + std::to_string(t->end));
  if (t->end > data_size)
    return OutOfRange(where + ": data_offsets end " + std::to_string(t->end) +
                      " is beyond the data section of " + std::to_string(data_size) +
                      " bytes (file truncated?)");
  uint64_t want;
  if (!TensorNbytes(t->dtype, t->shape, &want))
    return InvalidArgument(where + ": shape " + ShapeString(t->shape) + " overflows");
  if (t->end - t->begin != want)
    return InvalidArgument(where + ": data_offsets span " + std::to_string(t->end - t->begin) +
                           " bytes, but " + DTypeName(t->dtype) + " " + ShapeString(t->shape) +
                           " needs " + std::to_string(want));
  t->name = name;
  return Status::Ok();
}

}  // namespace

bool TensorNbytes(DType dtype, const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *out = n;
  return true;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const SafetensorsTensor* SafetensorsHeader::Find(const std::string& name) const {
  auto it = by_name.find(name);
  return it == by_name.end() ? nullptr : &tensors[it->second];
}

Result<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t avail,
                                                 uint64_t file_size, const std::string& origin) {
  if (file_size < 8 || avail < 8)
    return InvalidArgument(origin + ": file of " + std::to_string(file_size) +
                           " bytes is too short for a safetensors header");
  const uint64_t n = ReadLe64(bytes);
  if (n > file_size - 8)
    return OutOfRange(origin + ": header length " + std::to_string(n) +
                      " is beyond the file size " + std::to_string(file_size));
  if (n > kMaxSafetensorsHeaderBytes)
    return InvalidArgument(origin + ": header length " + std::to_string(n) + " exceeds the " +
                           std::to_string(kMaxSafetensorsHeaderBytes) + " byte limit");
  if (n + 8 > avail) return Internal(origin + ": header bytes not provided");
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  json j = json::parse(text, text + n, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(origin + ": header is not valid JSON");
  if (!j.is_object()) return InvalidArgument(origin + ": header JSON is not an object");

  SafetensorsHeader h;
  h.data_offset = 8 + n;
  const uint64_t data_size = file_size - h.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return InvalidArgument(origin + ": '__metadata__' is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          return InvalidArgument(origin + ": '__metadata__' value " + Quoted(m.key()) +
                                 " is not a string");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsTensor t;
    FM_RETURN_IF_ERROR(ParseEntry(origin, it.key(), *it, data_size, &t));
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // Each non-empty tensor against the non-empty one before it (sorted and disjoint so far,
  // that one ends last): a zero-size tensor sorted between two overlapping ones hides nothing.
  const SafetensorsTensor* prev = nullptr;
  for (const auto& b : h.tensors) {
    if (b.begin == b.end) continue;   // zero-size tensors occupy no bytes
    if (!prev || b.begin >= prev->end) {
      prev = &b;
      continue;
    }
    const auto& a = *prev;
    return InvalidArgument(origin + ": tensors " + Quoted(a.name) + " [" +
                           std::to_string(a.begin) + ", " + std::to_string(a.end) + ") and " +
                           Quoted(b.name) + " [" + std::to_string(b.begin) + ", " +
                           std::to_string(b.end) + ") overlap");
  }
  // The tensors fill the data section to its end (as the reference library requires): a header
  // length a few bytes short still parses (JSON allows the padding spaces after it) and would
  // shift every tensor.
  const uint64_t end = prev ? prev->end : 0;
  if (end != data_size)
    return InvalidArgument(origin + ": the data section has " + std::to_string(data_size) +
                           " bytes but its tensors end at " + std::to_string(end) +
                           " (a header length that does not match the header?)");
  for (size_t i = 0; i < h.tensors.size(); ++i) h.by_name[h.tensors[i].name] = i;
  return h;
}

// ---- SafetensorsFile -------------------------------------------------------------------

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path,
                                                               TensorBytes where) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(path + ": cannot open shard: " + std::strerror(errno));
  struct FdCloser {   // kPrivate keeps the descriptor (released: -1) for Load
    int fd;
    ~FdCloser() { if (fd >= 0) ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    return InvalidArgument(path + ": not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint8_t len_bytes[8];
  if (size < 8 || ::pread(fd, len_bytes, 8, 0) != 8)
    return InvalidArgument(path + ": file of " + std::to_string(size) +
                           " bytes is too short for a safetensors header");
  const uint64_t n = ReadLe64(len_bytes);
  if (n > size - 8)
    return OutOfRange(path + ": header length " + std::to_string(n) +
                      " is beyond the file size " + std::to_string(size));
  if (n > kMaxSafetensorsHeaderBytes)
    return InvalidArgument(path + ": header length " + std::to_string(n) + " exceeds the " +
                           std::to_string(kMaxSafetensorsHeaderBytes) + " byte limit");
  std::vector<uint8_t> head(8 + n);
  std::memcpy(head.data(), len_bytes, 8);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, head.data() + 8 + got, n - got, 8 + got);
    if (r <= 0) return InvalidArgument(path + ": read error in the header");
    got += static_cast<size_t>(r);
  }
  FM_ASSIGN_OR_RETURN(SafetensorsHeader header,
                      ParseSafetensorsHeader(head.data(), head.size(), size, path));
  // kPrivate reserves address space only (MAP_NORESERVE): pages exist once Load writes them,
  // so a worker pays memory for its own tensors, not for the whole shard file.
  void* base = where == TensorBytes::kMapped
                   ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0)
                   : ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return Internal(path + ": mmap failed: " + std::strerror(errno));
  // Mapped tensors are read in the order the kernels need them, not sequentially: no
  // readahead beyond what Load asks for, so that unselected neighbours stay on disk.
  if (where == TensorBytes::kMapped) ::madvise(base, size, MADV_RANDOM);
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->header_ = std::move(header);
  f->where_ = where;
  f->base_ = static_cast<const uint8_t*>(base);
  f->size_ = size;
  if (where == TensorBytes::kPrivate) {
    f->fd_ = fd;
    closer.fd = -1;
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

Status SafetensorsFile::Load(const std::vector<std::pair<uint64_t, uint64_t>>& runs) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint8_t* base = const_cast<uint8_t*>(base_);
  if (where_ == TensorBytes::kPrivate && fd_ < 0)
    return Internal(path_ + ": tensor data loaded twice");
  for (const auto& [begin, end] : runs) {
    const uint64_t a = header_.data_offset + begin, b = std::min(header_.data_offset + end, size_);
    if (b <= a) continue;
    if (where_ == TensorBytes::kMapped) {
      ::madvise(base + a / page * page, b - a / page * page, MADV_WILLNEED);
      continue;
    }
    // Huge pages for the run's 2 MiB-aligned interior only (none beyond the run's bytes): a
    // decode step reads every page of its weights, and 4 KiB pages cost it a page walk each.
    constexpr uint64_t kHuge = 2u << 20;
    const uint64_t ha = (reinterpret_cast<uint64_t>(base) + a + kHuge - 1) / kHuge * kHuge;
    const uint64_t hb = (reinterpret_cast<uint64_t>(base) + b) / kHuge * kHuge;
    if (hb > ha) ::madvise(reinterpret_cast<void*>(ha), hb - ha, MADV_HUGEPAGE);
    for (uint64_t at = a; at < b;) {
      const ssize_t r =
          ::pread(fd_, base + at, std::min<uint64_t>(b - at, 1u << 30), static_cast<off_t>(at));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        return InvalidArgument(path_ + ": read of tensor data at byte " + std::to_string(at) +
                               " failed: " + (r < 0 ? std::strerror(errno) : "file shrank"));
      at += static_cast<uint64_t>(r);
    }
  }
  if (where_ == TensorBytes::kPrivate) {
    ::mprotect(base, size_, PROT_READ);   // weights are never written; a stray write faults
    ::close(fd_);
    fd_ = -1;
  }
  return Status::Ok();
}

size_t SafetensorsFile::ResidentBytes() const {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t pages = (size_ + page - 1) / page;
  std::vector<unsigned char> vec(pages);
  if (::mincore(const_cast<uint8_t*>(base_), size_, vec.data()) != 0) return 0;
  size_t resident = 0;
  for (unsigned char v : vec) resident += (v & 1) ? page : 0;
  return resident;
}

// ---- SafetensorsWriter -----------------------------------------------------------------

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, const std::vector<SafetensorsDecl>& tensors,
    const std::map<std::string, std::string>& metadata) {
  json j = json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t n;
    if (!TensorNbytes(t.dtype, t.shape, &n))
      return InvalidArgument(path + ": tensor '" + t.name + "' has an invalid shape");
    if (j.contains(t.name)) return InvalidArgument(path + ": duplicate tensor '" + t.name + "'");
    j[t.name] = {{"dtype", DTypeName(t.dtype)}, {"shape", t.shape},
                 {"data_offsets", {offset, offset + n}}};
    offset += n;
    w->sizes_.push_back(n);
    w->names_.push_back(t.name);
  }
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  head += text;
  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return NotFound(path + ": cannot create: " + std::strerror(errno));
  w->path_ = path;
  FM_RETURN_IF_ERROR(w->Append(nullptr, 0));  // skips leading zero-size tensors
  if (::write(w->fd_, head.data(), head.size()) != static_cast<ssize_t>(head.size()))
    return Internal(path + ": write failed: " + std::strerror(errno));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status SafetensorsWriter::Append(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (true) {
    while (current_ < sizes_.size() && written_in_current_ == sizes_[current_]) {
      ++current_;
      written_in_current_ = 0;
    }
    if (n == 0) return Status::Ok();
    if (current_ >= sizes_.size())
      return Internal(path_ + ": more bytes appended than the declared tensors hold");
    const size_t take = static_cast<size_t>(
        std::min<uint64_t>(n, sizes_[current_] - written_in_current_));
    size_t done = 0;
    while (done < take) {
      const ssize_t r = ::write(fd_, p + done, take - done);
      if (r <= 0) return Internal(path_ + ": write failed: " + std::strerror(errno));
      done += static_cast<size_t>(r);
    }
    p += take;
    n -= take;
    written_in_current_ += take;
  }
}

Status SafetensorsWriter::Finish() {
  FM_RETURN_IF_ERROR(Append(nullptr, 0));
  if (current_ < sizes_.size())
    return Internal(path_ + ": tensor '" + names_[current_] + "' was not written in full");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Internal(path_ + ": close failed: " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace fm
