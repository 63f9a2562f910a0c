#include "log.hpp"

#include "layout.hpp"

#include <boost/asio/dispatch.hpp>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <utility>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

namespace anydoor::apps::kv {

namespace {

constexpr char kMagic[8] = {'A', 'D', 'K', 'V', 'L', 'O', 'G', '1'};
constexpr std::uint32_t kLogVersion = 2;  // salted; 1 (salt 0) is read and appended to as before
constexpr std::uint32_t kMaxKeyHard = 65535;
constexpr std::uint32_t kMaxValueHard = std::uint32_t{1} << 30;
constexpr std::uint64_t kReserve = std::uint64_t{4} << 20;

std::uint32_t load32(const std::byte* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

void file_header_at(std::byte* p, std::uint32_t salt) {
  const std::uint32_t v[2] = {salt == 0 ? 1 : kLogVersion, salt};
  std::memcpy(p, kMagic, 8);
  std::memcpy(p + 8, v, 8);
}

void file_header(std::vector<std::byte>& out, std::uint32_t salt) {
  const std::size_t at = out.size();
  out.resize(at + kLogHeader);
  file_header_at(out.data() + at, salt);
}

// Version 2's header check: 24 bits of a salted CRC of type and lengths.
std::uint32_t header_check(std::uint32_t salt, const std::byte* p) noexcept {
  std::byte h[9];
  h[0] = p[4];
  std::memcpy(h + 1, p + 8, 8);
  return crc32c(salt ^ 0x9e3779b9u, h, sizeof h) & 0xffffffu;
}

// The record header at p (at least kRecordHeader bytes) is one this log
// writes: a known type, and the check bytes right (zeros in version 1).
bool header_ok(std::uint32_t salt, const std::byte* p) noexcept {
  const auto type = static_cast<std::uint8_t>(p[4]);
  if (type != 1 && type != 2) return false;
  const std::uint32_t check = static_cast<std::uint32_t>(p[5]) | static_cast<std::uint32_t>(p[6]) << 8 |
                              static_cast<std::uint32_t>(p[7]) << 16;
  return check == (salt == 0 ? 0 : header_check(salt, p));
}

// From the kernel (getrandom(2)); should that fail (it does not on Linux
// 3.17 and later), from the clock and the pid: a salt all the same.
std::uint32_t random_salt() noexcept {
  std::uint32_t s = 0;
  for (int tries = 0; s == 0 && tries < 8; ++tries) {
    if (::getrandom(&s, sizeof s, 0) != static_cast<ssize_t>(sizeof s)) s = 0;
  }
  if (s == 0) {
    const auto t = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    s = static_cast<std::uint32_t>(t ^ (t >> 32) ^ (static_cast<std::uint64_t>(::getpid()) << 16)) | 1u;
  }
  return s;
}

}  // namespace

const char* to_string(sync_mode m) noexcept {
  switch (m) {
    case sync_mode::always: return "always";
    case sync_mode::everysec: return "everysec";
    case sync_mode::no: return "no";
  }
  return "?";
}

namespace {
constexpr std::size_t kHugePage = std::size_t{2} << 20;
}  // namespace

snapshot_buffer::snapshot_buffer(snapshot_buffer&& o) noexcept
    : blocks_(std::move(o.blocks_)), size_(std::exchange(o.size_, 0)) {
  o.blocks_.clear();
}

snapshot_buffer& snapshot_buffer::operator=(snapshot_buffer&& o) noexcept {
  if (this != &o) {
    clear();
    blocks_ = std::move(o.blocks_);
    o.blocks_.clear();
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

snapshot_buffer::~snapshot_buffer() { clear(); }

void snapshot_buffer::clear() noexcept {
  for (const chunk& c : blocks_) ::munmap(c.p, c.mapped);
  blocks_.clear();
  size_ = 0;
}

std::byte* snapshot_buffer::append(std::size_t n) {
  constexpr std::size_t kBlock = std::size_t{8} << 20;
  if (blocks_.empty() || blocks_.back().mapped - blocks_.back().used < n) {
    if (n > std::numeric_limits<std::size_t>::max() - kHugePage) throw std::bad_alloc();
    const std::size_t mapped = std::max(kBlock, (n + kHugePage - 1) / kHugePage * kHugePage);
    blocks_.reserve(blocks_.size() + 1);  // (before the mapping: nothing to undo should it throw)
    void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    (void)::madvise(p, mapped, MADV_HUGEPAGE);  // (a hint: EINVAL without THP support)
    blocks_.push_back({static_cast<std::byte*>(p), mapped, 0});
  }
  chunk& b = blocks_.back();
  std::byte* at = b.p + b.used;
  b.used += n;
  size_ += n;
  return at;
}

namespace {

void encode_record_at(std::byte* p, record_type t, std::string_view key, std::span<const std::byte> value,
                      std::uint32_t salt) {
  const std::uint32_t k = static_cast<std::uint32_t>(key.size());
  const std::uint32_t v = static_cast<std::uint32_t>(value.size());
  p[4] = static_cast<std::byte>(t);
  std::memcpy(p + 8, &k, 4);
  std::memcpy(p + 12, &v, 4);
  const std::uint32_t check = salt == 0 ? 0 : header_check(salt, p);
  p[5] = static_cast<std::byte>(check & 0xff);
  p[6] = static_cast<std::byte>((check >> 8) & 0xff);
  p[7] = static_cast<std::byte>(check >> 16);
  std::memcpy(p + kRecordHeader, key.data(), key.size());
  if (!value.empty()) std::memcpy(p + kRecordHeader + key.size(), value.data(), value.size());
  const std::uint32_t crc = crc32c(salt, p + 4, kRecordHeader - 4 + key.size() + value.size());
  std::memcpy(p, &crc, 4);
}

}  // namespace

void encode_record(std::vector<std::byte>& out, record_type t, std::string_view key, std::span<const std::byte> value,
                   std::uint32_t salt) {
  const std::size_t at = out.size();
  out.resize(at + kRecordHeader + key.size() + value.size());
  encode_record_at(out.data() + at, t, key, value, salt);
}

void encode_record(snapshot_buffer& out, record_type t, std::string_view key, std::span<const std::byte> value,
                   std::uint32_t salt) {
  encode_record_at(out.append(kRecordHeader + key.size() + value.size()), t, key, value, salt);
}

log_parse parse_log(std::span<const std::byte> file,
                    const std::function<void(record_type, std::string_view, std::span<const std::byte>)>& apply) {
  log_parse r;
  if (file.size() < kLogHeader || std::memcmp(file.data(), kMagic, 8) != 0) {
    r.result = log_parse::outcome::not_a_log;
    r.why = file.size() < kLogHeader ? "shorter than the log header" : "no anydoor-kv log header";
    return r;
  }
  const std::uint32_t version = load32(file.data() + 8), salt = load32(file.data() + 12);
  if (!(version == 1 && salt == 0) && !(version == 2 && salt != 0)) {
    r.result = log_parse::outcome::not_a_log;
    r.why = version == 1 || version == 2 ? "log version " + std::to_string(version) + " with a bad salt"
                                         : "log version " + std::to_string(version) + " (this server reads 1 and 2)";
    return r;
  }
  r.salt = salt;
  std::size_t at = kLogHeader;
  const std::size_t end = file.size();
  auto zeros_to_end = [&](std::size_t from) {
    for (std::size_t i = from; i < end; ++i) {
      if (file[i] != std::byte{0}) return false;
    }
    return true;
  };
  while (at < end) {
    const std::byte* p = file.data() + at;
    const std::size_t left = end - at;
    if (p[0] == std::byte{0} && zeros_to_end(at)) {
      r.zero_tail = left;  // space reserved ahead (fallocate), not yet written
      break;
    }
    std::string bad;
    std::size_t rec = 0;
    if (left < kRecordHeader) {
      bad = "a record header cut short";
    } else {
      const auto type = static_cast<std::uint8_t>(p[4]);
      const std::uint32_t k = load32(p + 8), v = load32(p + 12);
      if (type != 1 && type != 2) {
        bad = "an unknown record type";
      } else if (!header_ok(salt, p)) {
        bad = salt == 0 ? "nonzero reserved bytes in a record header" : "a record header that fails its check";
      } else if (k == 0 || k > kMaxKeyHard || v > kMaxValueHard || (type == 2 && v != 0)) {
        bad = "impossible key or value lengths";
      } else if (kRecordHeader + std::size_t{k} + v > left) {
        bad = "a record cut short";
      } else {
        rec = kRecordHeader + std::size_t{k} + v;
        if (crc32c(salt, p + 4, rec - 4) != load32(p)) {
          bad = "a CRC mismatch";
        } else {
          apply(static_cast<record_type>(type), std::string_view(reinterpret_cast<const char*>(p + kRecordHeader), k),
                std::span<const std::byte>(p + kRecordHeader + k, v));
          ++r.records;
          at += rec;
          continue;
        }
      }
    }
    // A bad record: the torn end of the last write, or corruption? A tail
    // is torn when nothing valid follows the bad spot: no complete record
    // with a good CRC starts anywhere after it (a corrupted length can
    // make a record in the middle look cut short). Version 2 keys both
    // checks with the log's salt (random, never sent to a client): a
    // client's value cannot hold a record that passes them (short of
    // guessing 32 bits), so one cut
    // short by a crash is a torn tail whatever it holds, and the scan
    // computes a record's CRC only behind a header that passes its check
    // (one in 2^24 of a client's forged headers): linear in the tail.
    // (Version 1 is unsalted: a value holding a well-formed record, cut
    // short, reads as corruption, and the scan is quadratic in forged
    // headers; a log of version 1 is rewritten as version 2 at start.)
    r.valid_end = at;
    auto valid_record_after = [&](std::size_t from) {
      for (std::size_t o = from; o + kRecordHeader <= end; ++o) {
        const std::byte* q = file.data() + o;
        if (!header_ok(salt, q)) continue;
        const std::uint64_t k = load32(q + 8), v = load32(q + 12);
        if (k == 0 || k > kMaxKeyHard || v > kMaxValueHard || kRecordHeader + k + v > end - o) continue;
        if (crc32c(salt, q + 4, kRecordHeader - 4 + k + v) == load32(q)) return true;
      }
      return false;
    };
    // (A whole record with a bad CRC and only zeros after it is the last
    // write too, cut short inside space reserved ahead, unless its length
    // is what broke and good records lie inside what it claims.)
    const bool last = rec == 0 ? !valid_record_after(at + 1)
                               : at + rec == end || (zeros_to_end(at + rec) && !valid_record_after(at + 1));
    if (last) {
      r.result = log_parse::outcome::torn;
      r.why = bad + " at offset " + std::to_string(at) + " (" + std::to_string(left) + " bytes to the end)";
    } else {
      r.result = log_parse::outcome::corrupt;
      r.why = bad + " at offset " + std::to_string(at) + ", with " + std::to_string(left) +
              " bytes after it: not a torn tail";
    }
    return r;
  }
  r.valid_end = at;
  return r;
}

durable_log::durable_log(asio::io_context& io, log_options o, const apply_fn& apply) : io_(io), o_(std::move(o)) {
  if (::mkdir(o_.dir.c_str(), 0755) != 0 && errno != EEXIST) throw std::runtime_error(sys_error("cannot create " + o_.dir));
  dir_fd_ = ::open(o_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd_ < 0) throw std::runtime_error(sys_error("cannot open the data dir " + o_.dir));
  const std::string lock = o_.dir + "/LOCK";
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) throw std::runtime_error(sys_error("cannot open " + lock));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const std::string why = errno == EWOULDBLOCK ? "another anydoor-kv-server uses " + o_.dir : sys_error("flock " + lock);
    ::close(lock_fd_);
    ::close(dir_fd_);
    throw std::runtime_error(why);
  }
  path_ = o_.dir + "/kv.log";
  tmp_path_ = o_.dir + "/kv.log.compact";
  marker_path_ = o_.dir + "/kv.log.sync-failed";
  ::unlink(tmp_path_.c_str());  // a compaction that did not finish
  auto fail = [&](const std::string& why) {
    if (fd_ >= 0) ::close(fd_);
    ::close(lock_fd_);
    ::close(dir_fd_);
    throw std::runtime_error(why);
  };
  auto refuse_marker = [&] { fail(marker_path_ + " is not a regular file; refusing to start (remove it)"); };
  // A run whose fdatasync failed left the marker (leave_sync_marker): the
  // log is rewritten below. Its first line says what failed.
  if (const int m = ::open(marker_path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK); m >= 0) {
    struct stat ms{};
    if (::fstat(m, &ms) != 0 || !S_ISREG(ms.st_mode)) {
      ::close(m);
      refuse_marker();
    }
    char text[512];
    const ssize_t n = ::read(m, text, sizeof text);
    ::close(m);
    std::string line(text, n > 0 ? static_cast<std::size_t>(n) : 0);
    line = line.substr(0, line.find('\n'));
    report_.sync_failed_before = line.empty() ? "kv.log.sync-failed is empty" : line;
  } else if (errno == ELOOP) {
    refuse_marker();
  } else if (errno != ENOENT) {
    fail(sys_error("cannot read " + marker_path_));
  }
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(sys_error("cannot open " + path_));
  struct stat st{};
  if (::fstat(fd_, &st) != 0) fail(sys_error("stat " + path_));
  const auto t0 = std::chrono::steady_clock::now();
  std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  if (size == 0) {
    salt_ = random_salt();
    std::vector<std::byte> h;
    file_header(h, salt_);
    if (write_all(fd_, h.data(), h.size()) || ::fsync(fd_) != 0 || ::fsync(dir_fd_) != 0) fail(sys_error("cannot write " + path_));
    size = kLogHeader;
  } else {
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd_, 0);
    if (m == MAP_FAILED) fail(sys_error("cannot map " + path_));
    log_parse p;
    try {
      p = parse_log({static_cast<const std::byte*>(m), size}, apply);
    } catch (const std::exception& e) {
      ::munmap(m, size);
      fail(path_ + ": " + e.what());
    }
    if (p.result == log_parse::outcome::torn) {
      // Keep what is cut off (kv.log.torn-<time>): nothing is destroyed for good.
      report_.torn_copy = o_.dir + "/kv.log.torn-" + std::to_string(::time(nullptr));
      const int t = ::open(report_.torn_copy.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      const auto* tail = static_cast<const std::byte*>(m) + p.valid_end;
      // (Not the zeros of a reserve after the bytes that matter: 4 KiB and
      // more of them at the end; fewer may be a record's own.)
      std::size_t keep = size - p.valid_end;
      while (keep > 0 && tail[keep - 1] == std::byte{0}) --keep;
      if (size - p.valid_end - keep < 4096) keep = size - p.valid_end;
      if (t < 0 || write_all(t, tail, keep) || ::fsync(t) != 0) {
        if (t >= 0) ::close(t);
        ::munmap(m, size);
        fail(sys_error("cannot save the torn tail of " + path_ + " to " + report_.torn_copy));
      }
      ::close(t);
    }
    ::munmap(m, size);
    if (p.result == log_parse::outcome::not_a_log) fail(path_ + " is not an anydoor-kv log: " + p.why);
    if (p.result == log_parse::outcome::corrupt) {
      fail(path_ + " is corrupt: " + p.why + "; refusing to start (move the file away to start empty)");
    }
    report_.records = p.records;
    salt_ = p.salt;  // (0: a version 1 log, rewritten below)
    if (p.zero_tail > 0) {  // reserved ahead by the last run: written into from where the records end
      report_.zero_bytes = p.zero_tail;
      reserved_ = size;
      size = p.valid_end;
    }
    if (p.result == log_parse::outcome::torn) {
      report_.torn_bytes = size - p.valid_end;
      report_.torn_why = p.why;
      if (::ftruncate(fd_, static_cast<off_t>(p.valid_end)) != 0) fail(sys_error("cannot cut the torn tail of " + path_));
      if (::fsync(fd_) != 0) {
        const std::error_code ec(errno, std::generic_category());
        leave_sync_marker("the fsync of kv.log after cutting its torn tail at start", ec);
        fail("fsync " + path_ + " after cutting its torn tail: " + ec.message());
      }
      size = p.valid_end;
    }
    if (::lseek(fd_, static_cast<off_t>(size), SEEK_SET) < 0) fail(sys_error("lseek " + path_));
    // What the last run wrote may still be in the page cache only (everysec
    // acknowledged it after the write; a kill -9 left it unsynced): made
    // durable before anything new is acknowledged after it.
    // (With sync no too: once, at start, so that synced_bytes holds.)
    // A failure here is reported once: the next start's fdatasync may
    // succeed over the lost pages, so it finds the marker and rewrites.
    if (sync_file(fd_) != 0) {
      const std::error_code ec(errno, std::generic_category());
      leave_sync_marker("the fdatasync of kv.log at start", ec);
      fail("fdatasync " + path_ + ": " + ec.message() + " (" + marker_path_ + " makes the next start rewrite it)");
    }
    if (salt_ == 0 || !report_.sync_failed_before.empty()) {
      // A log of version 1 (an earlier server's, unsalted) is rewritten as
      // version 2 before anything is appended, as a compaction would.
      // Should that fail short of the rename (a full disk), the log stays
      // version 1 and is written on as such. After a failed fdatasync (the
      // marker) the rewrite is what puts the replayed records on the disk:
      // a start without it is refused. After the rename the new file is
      // the log, and a failed fsync of the directory refuses the start (a
      // crash could bring the old file back without what follows).
      const std::string why = rewrite_log(size);
      if (why.empty()) {
        report_.rewritten = true;
        if (::fsync(dir_fd_) != 0) fail(sys_error("fsync of " + o_.dir + " after rewriting " + path_));
      } else if (!report_.sync_failed_before.empty()) {
        fail("the last run could not make " + path_ + " durable (" + report_.sync_failed_before +
             "), and rewriting it into a new file, which would put what it holds on the disk, failed: " + why +
             "; refusing to start (once the disk is checked, removing " + marker_path_ +
             " starts on the log as it is)");
      } else {
        report_.rewrite_failed = why;
      }
    }
  }
  if (!report_.sync_failed_before.empty()) {
    // (Should the unlink not survive a crash, the next start rewrites again.)
    if ((::unlink(marker_path_.c_str()) != 0 && errno != ENOENT) || ::fsync(dir_fd_) != 0) {
      fail(sys_error("cannot remove " + marker_path_));
    }
  }
  report_.bytes = size;
  report_.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  logical_bytes_ = size;
  taken_end_ = written_end_ = size;
  synced_end_.store(size, std::memory_order_relaxed);
  thread_ = std::thread([this] { run(); });
}

std::string durable_log::rewrite_log(std::uint64_t& size) {
  const std::uint32_t salt = random_salt();
  std::string why;
  std::uint64_t written = 0;
  const int t = ::open(tmp_path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  void* old = MAP_FAILED;
  if (t < 0) {
    why = sys_error("cannot create " + tmp_path_);
  } else if (old = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd_, 0); old == MAP_FAILED) {
    why = sys_error("cannot map " + path_);
  } else {
    std::vector<std::byte> buf;
    std::error_code ec;
    log_parse again;
    try {
      file_header(buf, salt);
      again = parse_log({static_cast<const std::byte*>(old), size},
                        [&](record_type type, std::string_view k, std::span<const std::byte> v) {
                          if (ec) return;  // (the write failed: nothing more is kept)
                          encode_record(buf, type, k, v, salt);
                          if (buf.size() >= (std::size_t{1} << 20)) {
                            ec = write_all(t, buf.data(), buf.size());
                            written += buf.size();
                            buf.clear();
                          }
                        });
    } catch (const std::bad_alloc&) {
      ec = std::make_error_code(std::errc::not_enough_memory);
    }
    ::munmap(old, size);
    if (!ec) {
      ec = write_all(t, buf.data(), buf.size());
      written += buf.size();
    }
    if (ec) {
      why = "cannot write " + tmp_path_ + ": " + ec.message();
    } else if (again.result != log_parse::outcome::ok || again.valid_end != size) {
      why = "its records did not read back as they did a moment before";
    } else if (::fsync(t) != 0) {
      why = sys_error("cannot fsync " + tmp_path_);
    } else if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
      why = sys_error("cannot rename " + tmp_path_);
    }
  }
  if (!why.empty()) {
    if (t >= 0) ::close(t);
    ::unlink(tmp_path_.c_str());
    return why;
  }
  ::close(fd_);
  fd_ = t;
  salt_ = salt;
  reserved_ = 0;
  size = written;
  return why;
}

void durable_log::leave_sync_marker(const char* what, std::error_code ec) noexcept {
  if (marker_left_.exchange(true)) return;
  char when[64] = "";
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  if (::gmtime_r(&now, &tm) != nullptr) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  char text[512];
  const int n = std::snprintf(text, sizeof text, "%s failed: %s (%s)\n", what, ec.message().c_str(), when);
  const std::size_t len = n < 0 ? 0 : std::min(static_cast<std::size_t>(n), sizeof text - 1);
  // Appended: a marker already there keeps its first line, the failure
  // that may have lost acknowledged writes (a start reports that one).
  const int m = ::open(marker_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  std::error_code wec = m < 0 ? std::error_code(errno, std::generic_category())
                              : write_all(m, reinterpret_cast<const std::byte*>(text), len);
  // (Its own fsyncs may fail on the same disk: without a reboot the
  // restart finds it in the page cache, which is the case it is for.)
  if (m >= 0) {
    (void)::fsync(m);
    ::close(m);
  }
  if (!wec) (void)::fsync(dir_fd_);
  if (wec) {
    std::fprintf(stderr,
                 "anydoor-kv: cannot leave %s (%s): the next start will not rewrite the log unless the file is "
                 "created\n",
                 marker_path_.c_str(), wec.message().c_str());
  }
}

durable_log::~durable_log() {
  close();
  if (fd_ >= 0) ::close(fd_);
  ::close(lock_fd_);
  ::close(dir_fd_);
}

std::error_code durable_log::error() const noexcept {
  std::lock_guard lk(m_);
  return write_error_;
}

std::string durable_log::error_text() const {
  std::lock_guard lk(m_);
  return write_error_what_.empty() ? std::string() : "the log" + write_error_what_;
}

std::uint64_t durable_log::append(record_type t, std::string_view key, std::span<const std::byte> value) {
  if (failed_) return 0;
  const std::size_t n = kRecordHeader + key.size() + value.size();
  {
    std::lock_guard lk(m_);
    if (stop_) return 0;
    encode_record(pending_, t, key, value, salt_);
    lsn_ += n;
    pending_end_ = lsn_;
  }
  // The thread is woken once per io_context turn, after the handlers that
  // are ready ran (their replies went out first, their records form one
  // batch), as Redis writes its AOF buffer once per event-loop iteration;
  // not once per record (a context switch each on a busy core).
  if (!wake_posted_) {
    asio::post(io_, [this] {
      wake_posted_ = false;
      end_of_turn();
    });
    wake_posted_ = true;  // (once posted: should the post throw, the next append tries again)
  }
  if (!work_) work_.emplace(io_.get_executor());
  logical_bytes_ += n;
  if (compacting_) logical_if_failed_ += n;
  ++stats_.records;
  return lsn_;
}

void durable_log::end_of_turn() noexcept {
  // always: the thread writes and fsyncs (the io thread never waits for a
  // disk flush). everysec and no: the io thread writes the turn's records
  // itself, as Redis writes its AOF buffer before it replies, so their
  // replies wait for one write(2), not for a hand-off to another thread
  // and back. While the thread still writes records handed to it
  // earlier, or a compaction swaps the files, the records go to the
  // thread too: one writer at a time keeps the file in order. (fd_ changes
  // only while switching_, with no writer at work: io_writing_ says this
  // thread is one.)
  bool hand_off = o_.sync == sync_mode::always || failed_;
  std::vector<std::byte> buf;
  std::uint64_t end = 0;
  {
    std::lock_guard lk(m_);
    if (stop_) return;  // close() writes what is left
    // The thread's write failed (its failure is on its way here): nothing
    // after its records may be written, or answered, before that.
    if (handed_ || thread_writing_ || write_error_ || switching_) hand_off = true;
    if (hand_off) {
      handed_ = true;
    } else if (!pending_.empty()) {
      buf.swap(pending_);
      pending_.swap(spare_);
      end = pending_end_;
      taken_end_ += buf.size();
      io_writing_ = true;
    }
  }
  if (hand_off) {
    cv_.notify_one();
    return;
  }
  if (buf.empty()) return;
  std::size_t written = 0;
  const std::error_code ec = write_all(fd_, buf.data(), buf.size(), &written);
  bool wake = false, compactor_waits = false;
  {
    std::lock_guard lk(m_);
    io_writing_ = false;
    compactor_waits = compactor_waits_;
    if (!ec) written_end_ += buf.size();
    held_end_ = end - buf.size() + written;
    buf.clear();
    if (spare_.capacity() < buf.capacity()) spare_.swap(buf);
    if (ec) {
      if (!write_error_) {  // (the log thread's fdatasync may have failed meanwhile: the first cause stays)
        write_error_ = ec;
        write_error_what_ = " cannot be written: " + ec.message();
      }
      wake = true;  // the thread makes what was written before durable
    } else if (o_.sync == sync_mode::everysec && !unsynced_) {
      unsynced_ = true;  // the thread fsyncs within about a second
      wake = true;
    }
  }
  if (wake) cv_.notify_one();
  if (compactor_waits) switch_cv_.notify_all();
  on_durable(end, ec, false, {});
}

bool durable_log::compaction_due(std::uint64_t live_bytes) const noexcept {
  return !(compacting_ || snapshotting_ || compaction_stopped_ || failed_ || logical_bytes_ < o_.compact_min ||
           logical_bytes_ < retry_compact_at_ || logical_bytes_ <= 2 * (live_bytes + kLogHeader));
}

void durable_log::maybe_compact(std::uint64_t live_bytes, std::function<bool(snapshot_buffer&)> snapshot_step) {
  if (!compaction_due(live_bytes)) return;
  std::unique_ptr<compaction> c;
  try {
    c = std::make_unique<compaction>();
    file_header_at(c->snapshot.append(kLogHeader), salt_);
  } catch (const std::bad_alloc&) {
    give_up_snapshot();
    return;
  }
  {
    // The snapshot, taken from now on, reflects every record appended so
    // far: those written or being written (up to taken_end_) and those
    // still pending. The records appended while it is taken follow it in
    // the new log (as those appended while the compactor writes it): a key
    // they change is replayed to its last value whatever the snapshot saw.
    std::lock_guard lk(m_);
    if (stop_ || no_compaction_) return;
    c->start = taken_end_ + pending_.size();
    c->lsn = lsn_;
  }
  c->logical_at_start = logical_bytes_;
  snapshotting_ = true;
  stats_.last_snapshot_us = 0;
  stats_.last_snapshot_steps = 0;
  snapshot_step_now(std::move(c), std::move(snapshot_step));
}

void durable_log::compaction_failed(const char* what, const char* why) noexcept {
  // The old log stays and keeps growing; a compaction is tried again after
  // another compact_min.
  retry_compact_at_ = logical_bytes_ + std::max<std::uint64_t>(o_.compact_min, 1 << 20);
  ++stats_.compaction_failures;
  std::fprintf(stderr, "anydoor-kv: %s %s (%s): the log keeps growing; trying again later\n", what, path_.c_str(), why);
}

void durable_log::give_up_snapshot() noexcept {
  // No memory for the snapshot (or to queue its next step).
  snapshotting_ = false;
  compaction_failed("no memory for the snapshot to compact", "out of memory");
}

void durable_log::snapshot_step_now(std::unique_ptr<compaction> c, std::function<bool(snapshot_buffer&)> step) {
  {
    std::lock_guard lk(m_);
    if (stop_ || no_compaction_ || compaction_stopped_ || failed_) {
      snapshotting_ = false;  // (closed, stopped or failed meanwhile: the old log stays)
      return;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  bool done = false;
  try {
    done = step(c->snapshot);
  } catch (const std::bad_alloc&) {
    give_up_snapshot();
    return;
  }
  const auto held = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  stats_.last_snapshot_us = std::max(stats_.last_snapshot_us, held);
  stats_.max_snapshot_us = std::max(stats_.max_snapshot_us, held);
  ++stats_.last_snapshot_steps;
  if (!done) {
    // Requests run between the steps.
    try {
      asio::post(io_, [this, alive = std::weak_ptr<int>(alive_), c = std::move(c), step = std::move(step)]() mutable {
        if (alive.expired()) return;  // (the log was destroyed first: its io_context runs on)
        snapshot_step_now(std::move(c), std::move(step));
      });
    } catch (const std::bad_alloc&) {
      give_up_snapshot();
    }
    return;
  }
  snapshotting_ = false;
  {
    std::lock_guard lk(m_);
    c->complete_at = taken_end_ + pending_.size();
  }
  if (compactor_.joinable()) compactor_.join();  // the last one, whose end ran here already
  const std::uint64_t snapshot_bytes = c->snapshot.size();
  stats_.last_snapshot_bytes = snapshot_bytes;
  const std::uint64_t appended_since = logical_bytes_ - c->logical_at_start;
  try {
    compactor_ = std::thread([this, c = std::move(c)]() mutable { compact(std::move(*c)); });
  } catch (const std::system_error& e) {
    compaction_failed("cannot start compacting", e.what());
    return;
  }
  logical_if_failed_ = logical_bytes_;
  logical_bytes_ = snapshot_bytes + appended_since;
  compacting_ = true;
  if (!work_) work_.emplace(io_.get_executor());
}

log_stats durable_log::stats() const noexcept {
  log_stats s = stats_;
  s.file_bytes = logical_bytes_;
  s.fsyncs = fsyncs_.load(std::memory_order_relaxed);
  s.thread_rounds = thread_rounds_.load(std::memory_order_relaxed);
  s.synced_bytes = synced_end_.load(std::memory_order_relaxed);
  return s;
}

void durable_log::close() noexcept {
  {
    std::lock_guard lk(m_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  // A compaction under way gives up (the old log stays) unless it is
  // swapping the files already; then the thread writes what is left.
  switch_cv_.notify_all();
  if (compactor_.joinable()) compactor_.join();
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  // A failure of the last writes (the thread writes what is left) is
  // posted to an io_context that may run no more: told here.
  if (error()) tell_failure();
  // A clean stop leaves the records alone in the file: the space reserved
  // ahead is cut off (were it left, the next start would skip it anyway).
  const off_t at = ::lseek(fd_, 0, SEEK_CUR);
  if (at > 0 && reserved_ > static_cast<std::uint64_t>(at) && ::ftruncate(fd_, at) == 0) {
    reserved_ = static_cast<std::uint64_t>(at);
  }
}

void durable_log::stop_compaction() noexcept {
  compaction_stopped_ = true;  // (before any snapshot is built)
  {
    std::lock_guard lk(m_);
    no_compaction_ = true;
  }
  switch_cv_.notify_all();
}

void durable_log::reserve(std::size_t n) noexcept {
  if (!reserving_) return;
  const off_t at = ::lseek(fd_, 0, SEEK_CUR);
  if (at < 0) return;
  const std::uint64_t need = static_cast<std::uint64_t>(at) + n;
  if (need <= reserved_) return;
  const std::uint64_t to = need + kReserve;
  if (::fallocate(fd_, 0, at, static_cast<off_t>(to - static_cast<std::uint64_t>(at))) != 0) {
    // Not supported here (EOPNOTSUPP), or no room for the reserve (the
    // records themselves may still fit): plain appends from now on.
    reserving_ = false;
    if (errno != EOPNOTSUPP && errno != ENOSYS) {
      std::fprintf(stderr, "anydoor-kv: cannot reserve space ahead in %s (%s): appending without\n", path_.c_str(),
                   std::strerror(errno));
    }
    return;
  }
  reserved_ = to;
}

std::error_code durable_log::write_all(int fd, const std::byte* p, std::size_t n, std::size_t* done) noexcept {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return {errno, std::generic_category()};
    }
    p += w;
    n -= static_cast<std::size_t>(w);
    if (done != nullptr) *done += static_cast<std::size_t>(w);
  }
  return {};
}

std::error_code durable_log::copy_records(int fd, std::uint64_t from, std::uint64_t to,
                                         std::vector<std::byte>& buf) noexcept {
  while (from < to) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(to - from, buf.size()));
    const ssize_t r = ::pread(fd_, buf.data(), n, static_cast<off_t>(from));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return {errno, std::generic_category()};
    if (r == 0) return std::make_error_code(std::errc::io_error);  // the old log is shorter than its records
    if (const std::error_code ec = write_all(fd, buf.data(), static_cast<std::size_t>(r))) return ec;
    from += static_cast<std::uint64_t>(r);
  }
  return {};
}

void durable_log::compact(compaction c) noexcept {
  // fd_ (the old log) is read here without the lock: only this thread
  // changes it, below.
  std::error_code ec;
  bool switched = false;
  std::string failed_step;
  const int fd = ::open(tmp_path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);  // (read by the next compaction)
  if (fd < 0) ec = {errno, std::generic_category()};
  for (std::size_t i = 0; !ec && i < c.snapshot.blocks(); ++i) {
    ec = write_all(fd, c.snapshot.block(i).data(), c.snapshot.block(i).size());
  }
  const std::uint64_t snapshot_bytes = c.snapshot.size();
  c.snapshot.clear();  // (its memory back now)
  if (!ec && ::fdatasync(fd) != 0) ec = {errno, std::generic_category()};
  if (!ec) fsyncs_.fetch_add(1, std::memory_order_relaxed);
  // Catch up with the records written to the old log meanwhile, while they
  // go on: each round copies what was written when it began.
  std::vector<std::byte> buf;
  try {
    buf.resize(std::size_t{1} << 20);
  } catch (const std::bad_alloc&) {
    ec = std::make_error_code(std::errc::not_enough_memory);
  }
  // The records the snapshot covers may still be on their way to the old
  // log (pending, or being written): the copy starts once they are there,
  // so it never holds a record twice and the new file is exactly the
  // snapshot and what followed it. It also waits for the records appended
  // until the snapshot was complete (complete_at): a key written while it
  // was taken is left out of it, and only such a record holds the key.
  // Written to the new file only after the rename (as those appended
  // later are), a crash in between would lose the key, its last
  // acknowledged value included.
  std::uint64_t from = c.start, copied = snapshot_bytes;
  auto cancelled = [&] { return stop_ || no_compaction_ || write_error_; };  // under m_
  if (!ec) {
    std::unique_lock lk(m_);
    compactor_waits_ = true;
    switch_cv_.wait(lk, [&] { return cancelled() || written_end_ >= c.complete_at; });
    compactor_waits_ = false;
    if (cancelled()) ec = std::make_error_code(std::errc::operation_canceled);
  }
  // Rounds until what is left is small: each copies what was written when
  // it began (records keep coming meanwhile).
  for (int round = 0; !ec && round < 16; ++round) {
    std::uint64_t to = 0;
    {
      std::lock_guard lk(m_);
      if (cancelled()) ec = std::make_error_code(std::errc::operation_canceled);
      to = written_end_;
    }
    if (ec || to - from < (std::uint64_t{64} << 10)) break;
    ec = copy_records(fd, from, to, buf);
    copied += to - from;
    from = to;
    if (!ec && ::fdatasync(fd) != 0) ec = {errno, std::generic_category()};  // keeps the last fsync short
    if (!ec) fsyncs_.fetch_add(1, std::memory_order_relaxed);
  }
  int old = -1;
  if (!ec) {
    // The last round holds the writers: the records they take meanwhile
    // wait in pending_ and go to the new log.
    std::uint64_t to = 0, appended_after = 0;
    {
      std::unique_lock lk(m_);
      switching_ = true;
      compactor_waits_ = true;
      switch_cv_.wait(lk, [&] { return !io_writing_ && !thread_writing_ && !thread_syncing_; });
      compactor_waits_ = false;
      if (cancelled()) ec = std::make_error_code(std::errc::operation_canceled);
      to = written_end_;
      // By the sequence numbers, not the offsets: the record bytes appended
      // after the snapshot and written (none is being written now).
      appended_after = pending_end_ - pending_.size() - c.lsn;
    }
    if (!ec) ec = copy_records(fd, from, to, buf);
    copied += to - from;
    if (!ec && ::fdatasync(fd) != 0) ec = {errno, std::generic_category()};
    if (!ec) fsyncs_.fetch_add(1, std::memory_order_relaxed);
    // The new file must be the snapshot and exactly the records appended
    // after it: a check of the offsets' bookkeeping by other numbers.
    if (!ec && (copied != snapshot_bytes + appended_after ||
                ::lseek(fd, 0, SEEK_CUR) != static_cast<off_t>(copied))) {
      ec = std::make_error_code(std::errc::io_error);
    }
    if (!ec && ::rename(tmp_path_.c_str(), path_.c_str()) != 0) ec = {errno, std::generic_category()};
    if (!ec) {
      // From here kv.log is the new file: it is the one written to, even
      // should the directory's fsync fail (then the log fails: the rename
      // may not survive a crash, and nothing more is acknowledged).
      switched = true;
      if (::fsync(dir_fd_) != 0) {
        ec = {errno, std::generic_category()};
        failed_step = "fsync of the data dir after compacting";
      } else {
        fsyncs_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    {
      std::lock_guard lk(m_);
      if (switched) {
        old = fd_;
        fd_ = fd;
        taken_end_ = written_end_ = copied;
        synced_end_.store(copied, std::memory_order_relaxed);  // (fdatasynced above, whatever the directory's fsync did)
        new_file_ = true;
        if (ec && !write_error_) {
          write_error_ = ec;
          write_error_what_ = " cannot be made durable: " + failed_step + ": " + ec.message();
        }
      }
      switching_ = false;
    }
    cv_.notify_one();  // records held meanwhile
  }
  if (!switched) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp_path_.c_str());
  }
  // A failure after the switch is the log's (write_error_ above); one
  // before leaves the old log as it was.
  const std::error_code compact_ec = switched ? std::error_code() : ec;
  const std::error_code log_ec = switched ? ec : std::error_code();
  // The old file is closed before the end is posted: the last close of a
  // large unlinked file frees its blocks and may take a while, and the
  // next compaction's join, on the io thread, must not wait for it.
  if (old >= 0) {
    // The rename may not survive a crash (the directory's fsync failed):
    // the old file may come back, and everysec's records since its last
    // fsync must be on the disk in it too.
    if (log_ec && o_.sync == sync_mode::everysec && ::fdatasync(old) != 0) {
      std::lock_guard lk(m_);
      sync_failed_ = true;  // (told by tell_failure(), which runs after the post below)
    }
    ::close(old);
  }
  // The rename may not be on the disk: a restart rewrites the log again.
  if (log_ec) leave_sync_marker("the fsync of the data dir after a compaction", log_ec);
  asio::post(io_, [this, log_ec, compact_ec] { on_durable(0, log_ec, true, compact_ec); });
}

void durable_log::run() noexcept {
  using clock = std::chrono::steady_clock;
  std::unique_lock lk(m_);
  bool dirty = false;
  clock::time_point synced_at = clock::now();
  bool failed = false;
  // With everysec and no the io thread writes the records itself
  // (end_of_turn) unless it hands them here (handed_), or the stop needs
  // them: only then does this thread take pending_. While a compaction
  // swaps the files (switching_) it leaves fd_ alone.
  const bool writes_all = o_.sync == sync_mode::always;
  for (;;) {
    auto ready = [&] {
      return !switching_ &&
             (stop_ || ((writes_all || handed_) && !pending_.empty()) || (unsynced_ && !dirty && !failed) ||
              (write_error_ && !failed));
    };
    if (o_.sync == sync_mode::everysec && dirty) {
      cv_.wait_until(lk, synced_at + std::chrono::seconds(1), ready);
    } else {
      cv_.wait(lk, ready);
    }
    if (switching_) {
      cv_.wait(lk, [&] { return !switching_; });
      continue;
    }
    thread_rounds_.fetch_add(1, std::memory_order_relaxed);
    // Written by the io thread, not yet fsynced. The flag stays set until
    // an fdatasync is due (below): meanwhile the io thread's writes find it
    // set and do not wake this thread, which sleeps until then.
    if (unsynced_) dirty = true;
    if (new_file_) {  // a compaction swapped the files: the new one has no reserve
      new_file_ = false;
      reserved_ = 0;
    }
    // The log failed elsewhere (the io thread's write, or the directory's
    // fsync after a compaction): nothing more is written or acknowledged.
    // With everysec, what was written before is made durable once more
    // (acknowledged after the write alone, it must not wait for a restart
    // to reach the disk); always acknowledged nothing without an fsync,
    // and no leaves it to the OS. Never after a failed fdatasync.
    bool last_sync = false;
    if (write_error_) {
      last_sync = !failed && o_.sync == sync_mode::everysec && !sync_failed_;
      failed = true;
      dirty = false;
    }
    const bool told_elsewhere = last_sync;  // (the io thread tells the operator, maybe already)
    const bool stopping = stop_;
    std::vector<std::byte> buf;
    if (writes_all || handed_ || stopping) {
      handed_ = false;
      thread_writing_ = true;  // until written: the io thread hands its records here meanwhile
      buf.swap(pending_);
      pending_.swap(spare_);  // the buffer the last round used, emptied
      taken_end_ += buf.size();
    }
    thread_syncing_ = true;
    const std::uint64_t end = pending_end_;
    const std::uint64_t written_before = written_end_;  // an fdatasync from here covers at least this
    // everysec: an fdatasync made now covers what the io thread has written
    // so far; its next write sets unsynced_ again (and wakes this thread).
    const bool due = (o_.sync == sync_mode::everysec && clock::now() - synced_at >= std::chrono::seconds(1)) ||
                     (stopping && o_.sync != sync_mode::no);
    if (due || failed) unsynced_ = false;
    lk.unlock();

    std::error_code ec;
    bool sync_failed = false;
    std::size_t written = 0;
    if (!failed) {
      if (!buf.empty()) {
        if (writes_all) reserve(buf.size());
        ec = write_all(fd_, buf.data(), buf.size(), &written);
        dirty = true;
      }
      const bool sync_now = o_.sync == sync_mode::always || due;
      if (!ec && dirty && sync_now) {
        if (sync_file(fd_) != 0) {
          ec = {errno, std::generic_category()};
          sync_failed = true;
        } else {
          fsyncs_.fetch_add(1, std::memory_order_relaxed);
          synced_end_.store(written_before + buf.size(), std::memory_order_relaxed);
          dirty = false;
          synced_at = clock::now();
        }
      }
      // This thread's write failed: what was written before it, as above.
      if (ec && !sync_failed && o_.sync == sync_mode::everysec) last_sync = true;
    }
    const std::error_code last_sync_ec = last_sync ? final_sync(written_before) : std::error_code();
    if (sync_failed || last_sync_ec) leave_sync_marker("the fdatasync of kv.log", sync_failed ? ec : last_sync_ec);
    const bool post_end = !failed && (!buf.empty() || ec);
    lk.lock();
    thread_writing_ = false;
    thread_syncing_ = false;
    if (!ec && !failed) written_end_ += buf.size();
    if (written > 0) held_end_ = end - buf.size() + written;
    // The operator is told what may not be on the disk: by the line
    // tell_failure() prints when sync_failed_ is set before it runs, else
    // (the io thread's failure, told already or about to be) by one more.
    std::error_code also_failed;
    if (last_sync_ec) {
      sync_failed_ = true;
      if (told_elsewhere && failure_told_.load()) also_failed = last_sync_ec;
    }
    if (ec && !failed) {
      failed = true;
      if (sync_failed) sync_failed_ = true;
      if (write_error_) {
        // The io thread's write failed meanwhile, and it may have told the
        // operator already: this fdatasync failed too.
        if (sync_failed) also_failed = ec;
      } else {
        write_error_ = ec;
        write_error_what_ =
            std::string(sync_failed ? " cannot be made durable: fdatasync: " : " cannot be written: ") + ec.message();
      }
    }
    // Posted once the error is set: the writers it fails are answered with
    // error_text() (before, the io thread could answer them with an empty
    // reason, the text not yet written here).
    if (post_end) asio::post(io_, [this, end, ec] { on_durable(end, ec, false, {}); });
    if (failed) dirty = false;  // (nothing more is written or fsynced: no timed wakeups)
    if (also_failed) {
      std::fprintf(stderr,
                   "anydoor-kv: the log %s cannot be made durable either: fdatasync: %s; writes acknowledged since the "
                   "last fsync may not be on the disk (the next start rewrites the log from what it reads, "
                   "kv.log.sync-failed marks it)\n",
                   path_.c_str(), also_failed.message().c_str());
    }
    if (compactor_waits_) switch_cv_.notify_all();
    buf.clear();
    if (spare_.capacity() < buf.capacity()) spare_.swap(buf);
    if (stopping && pending_.empty()) break;
  }
}

int durable_log::sync_file(int fd) const noexcept {
  return o_.fdatasync_hook != nullptr ? o_.fdatasync_hook(fd) : ::fdatasync(fd);
}

std::error_code durable_log::final_sync(std::uint64_t covered) noexcept {
  // (Not after a failed fdatasync: a second one can report success for
  // pages the first lost.)
  if (sync_file(fd_) == 0) {
    fsyncs_.fetch_add(1, std::memory_order_relaxed);
    synced_end_.store(covered, std::memory_order_relaxed);
    return {};
  }
  return {errno, std::generic_category()};
}

void durable_log::tell_failure() noexcept {
  // Once, for the operator: the clients see the reason on each refused
  // write, but a failure under everysec or no may follow the last write by
  // seconds (an fsync), or come at the close, with no client to tell.
  // (The clients' text leaves the path out: what a hostile client needs
  // not learn. The operator's names it.)
  if (failure_told_.exchange(true)) return;
  std::string why;
  bool sync_failed = false;
  {
    std::lock_guard lk(m_);
    why = write_error_what_;
    sync_failed = sync_failed_;
  }
  std::fprintf(stderr,
               "anydoor-kv: the log %s%s; writes are refused from now on (reads go on); every write acknowledged "
               "before is in the file%s: restart once the cause is fixed\n",
               path_.c_str(), why.c_str(),
               o_.sync == sync_mode::always ? ""
               : o_.sync == sync_mode::no
                   ? " (with sync no, the OS decides when it reaches the disk)"
                   : (sync_failed ? ", but what was acknowledged since the last fsync may not be on the disk (the "
                                    "next start rewrites the log from what it reads, kv.log.sync-failed marks it, "
                                    "which puts on the disk what the page cache still holds)"
                                  : ", and one more fdatasync is made to put it on the disk (a line follows should "
                                    "it fail)"));
}

void durable_log::on_durable(std::uint64_t lsn, std::error_code ec, bool compacted,
                             std::error_code compact_ec) noexcept {
  if (compacted) {
    compacting_ = false;  // (its thread is joined by the next compaction or close(): it has closed the old file)
    if (compact_ec == std::errc::operation_canceled) {
      // The log closed or failed under it: the old log stays, nothing to report.
      logical_bytes_ = logical_if_failed_;
    } else if (compact_ec) {
      // The log keeps growing in the old file; try again after another compact_min.
      logical_bytes_ = logical_if_failed_;
      compaction_failed("compacting failed:", compact_ec.message().c_str());
    } else if (!ec) {
      ++stats_.compactions;
    }
  }
  if (ec) {
    tell_failure();
    if (!failed_) {  // (a second failure can follow: the other writer's, a compaction's)
      {
        std::lock_guard lk(m_);
        held_ = held_end_;  // (final: nothing is written after a failure)
      }
      failed_ = true;
      if (on_failure_) on_failure_();
    }
    if (!compacting_) work_.reset();  // (else the compaction's end is still to come here)
    while (!waiters_.empty()) {
      auto h = std::move(waiters_.front().second);
      waiters_.pop_front();
      std::move(h)(ec);
    }
    return;
  }
  durable_ = std::max(durable_, lsn);
  if ((durable_ >= lsn_ || failed_) && !compacting_) work_.reset();
  while (!waiters_.empty() && waiters_.front().first <= durable_) {
    auto h = std::move(waiters_.front().second);
    waiters_.pop_front();
    std::move(h)(std::error_code());
  }
}

}  // namespace anydoor::apps::kv
