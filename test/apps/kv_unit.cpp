// The key-value store's parts without a network: the table and its
// one-sided read checks (including torn, moved and hostile reads), the log
// format (torn tails at every byte, corruption), the durable log (group
// commit, compaction, replay) and the Redis protocol parser and commands.
#include "../support/runtime.hpp"
#include "kv/client.hpp"
#include "kv/log.hpp"
#include "kv/read.hpp"
#include "kv/resp.hpp"
#include "kv/service.hpp"
#include "kv/store.hpp"
#include "kv/undo.hpp"
#include "kv_rig.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>

using namespace anydoor::apps::kv;
using anydoor::test::addr;
using anydoor::test::failure;
using anydoor::test::run_to_completion;
using anydoor::test::test_host;
using anydoor::test::test_options;
namespace rpc = anydoor::rpc;

namespace {

std::span<const std::byte> B(std::string_view s) { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }
std::string S(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

// A layout of `buckets` buckets with an arena of `arena` bytes after them
// (no region).
layout layout_of(std::uint64_t buckets, std::uint64_t arena, std::uint32_t max_key, std::uint32_t max_value) {
  layout l;
  l.buckets = buckets;
  l.arena_offset = (buckets + 1) * kBucketSize;
  l.arena_size = arena;
  l.max_key = max_key;
  l.max_value = max_value;
  return l;
}

// What a one-sided GET concludes from the table's bytes as they are now
// (`nb` may be an older copy of the neighbourhood).
struct outcome {
  enum { found, absent, torn, ask_server } kind;
  std::string value;
};
outcome read_from(const store& st, std::string_view key, const std::vector<std::byte>* old_nb = nullptr) {
  const layout l = st.describe();
  const auto mem = st.memory();
  const std::uint64_t h = key_hash(l.seed, key);
  const std::uint64_t home = h & (l.buckets - 1);
  std::vector<std::byte> nbb(mem.begin() + static_cast<std::ptrdiff_t>(home * kBucketSize),
                             mem.begin() + static_cast<std::ptrdiff_t>(home * kBucketSize + kNeighbourhoodBytes));
  if (old_nb != nullptr) nbb = *old_nb;
  const neighbourhood nb = scan_neighbourhood(nbb, h);
  bool torn = nb.torn;
  for (std::size_t i = 0; i < nb.n; ++i) {
    const slot& s = nb.cand[i];
    std::span<const std::byte> v;
    match m;
    if ((s.length & kInlineFlag) != 0) {
      m = check_inline(s, key, v);
    } else if (!item_in_bounds(s, l)) {
      m = match::torn;
    } else {
      m = check_item(mem.subspan(l.arena_offset + s.offset, s.length), s, key, v);
    }
    if (m == match::yes) return {outcome::found, S(v)};
    if (m == match::torn) torn = true;
  }
  if (torn) return {outcome::torn, {}};
  return {nb.overflow != 0 ? outcome::ask_server : outcome::absent, {}};
}

std::string tmpdir() {
  char t[] = "/tmp/anydoor-kv-XXXXXX";
  REQUIRE(::mkdtemp(t) != nullptr);
  return t;
}

// Runs io until the log has answered for position `lsn`: what it said
// (EIO should it never answer).
std::error_code wait_answered(asio::io_context& io, durable_log& log, std::uint64_t lsn) {
  std::error_code ec{EIO, std::generic_category()};
  log.async_wait(lsn, [&](std::error_code e) { ec = e; });
  io.restart();
  io.run();
  return ec;
}

// One put through the service, run until the log has answered it: what
// the log said (EIO should it never answer).
std::error_code durable_put(asio::io_context& io, service& svc, durable_log& log, std::string_view key,
                            std::string_view value) {
  std::uint64_t lsn = 0;
  REQUIRE(svc.put(key, B(value), lsn).is_ok());
  return wait_answered(io, log, lsn);
}

// Runs io until the log has failed (its syncing thread found the error),
// for at most 10 s.
void wait_for_log_error(asio::io_context& io, const durable_log& l) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!l.error() && std::chrono::steady_clock::now() < until) {
    io.restart();
    io.run_for(std::chrono::milliseconds(20));
  }
}

// Runs io until the io thread has seen the log fail (failed(): its writes
// taken back), for at most 10 s.
void run_until_failed(asio::io_context& io, const durable_log& l) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!l.failed() && std::chrono::steady_clock::now() < until) {
    io.restart();
    io.run_for(std::chrono::milliseconds(5));
  }
}

// A file size limit for the scope (as ulimit -f), with SIGXFSZ ignored as
// the server ignores it: a write past the limit writes what fits, the next
// fails with EFBIG, as on a full disk.
struct file_size_limit {
  ::rlimit old{};
  void (*old_handler)(int) = SIG_DFL;
  explicit file_size_limit(rlim_t bytes) {
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    ::rlimit l = old;
    l.rlim_cur = std::min(bytes, old.rlim_max);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &l) == 0);
  }
  ~file_size_limit() {
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
  }
  file_size_limit(const file_size_limit&) = delete;
  file_size_limit& operator=(const file_size_limit&) = delete;
};


}  // namespace

TEST_CASE("kv store: put, get, del, overwrite across inline and arena items", "[kv]") {
  store st({.max_memory = 1 << 20});
  CHECK(st.put("a", B("small")) == put_status::ok);
  CHECK(st.stats().inline_keys == 1);
  const std::string big(500, 'x');
  CHECK(st.put("a", B(big)) == put_status::ok);  // inline -> arena
  CHECK(S(*st.get("a")) == big);
  CHECK(st.stats().inline_keys == 0);
  CHECK(st.stats().keys == 1);
  CHECK(st.put("a", B("tiny")) == put_status::ok);  // arena -> inline
  CHECK(S(*st.get("a")) == "tiny");
  CHECK(st.stats().used_bytes == 0);
  CHECK(st.put("a", B("")) == put_status::ok);  // an empty value
  CHECK(st.get("a")->empty());
  CHECK(st.del("a"));
  CHECK_FALSE(st.del("a"));
  CHECK_FALSE(st.get("a"));
  CHECK(st.stats().keys == 0);
  CHECK(st.stats().live_bytes == 0);
  CHECK(st.put("", B("x")) == put_status::too_large);
  CHECK(st.put(std::string(1025, 'k'), B("x")) == put_status::too_large);
  CHECK(st.put("k", std::vector<std::byte>((1 << 20) + 1)) == put_status::too_large);
}

TEST_CASE("kv store: the index is faulted in at start - no page fault per first write to a bucket", "[kv]") {
  // 16 MiB of arena: an 8 MiB index, 2048 pages a first touch would fault
  // one by one on the io thread.
  store st({.max_memory = 16 << 20});
  const auto mem = st.memory();
  const std::size_t index = static_cast<std::size_t>(st.describe().arena_offset);
  REQUIRE(st.index_resident());
  REQUIRE(index >= (std::size_t{8} << 20));
  CHECK(reinterpret_cast<std::uintptr_t>(mem.data()) % (std::uintptr_t{2} << 20) == 0);  // huge-page aligned
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((index + page - 1) / page);
  REQUIRE(::mincore(mem.data(), index, in.data()) == 0);
  std::size_t absent = 0;
  for (unsigned char c : in) absent += (c & 1) == 0 ? 1 : 0;
  CHECK(absent == 0);
  // The arena is not: it fills from the bottom as items arrive.
  std::vector<unsigned char> arena(1);
  REQUIRE(::mincore(mem.data() + mem.size() - page, page, arena.data()) == 0);
  CHECK((arena[0] & 1) == 0);
}

TEST_CASE("kv store: a full neighbourhood overflows to the server-only table, readers are told to ask", "[kv]") {
  store st({.max_memory = 1 << 20, .buckets = 1});  // 2 buckets: 8 slots in all
  std::map<std::string, std::string> want;
  for (int i = 0; i < 40; ++i) {
    const std::string k = "key" + std::to_string(i), v = (i % 2 != 0 ? std::string(100, 'v') : "s") + std::to_string(i);
    REQUIRE(st.put(k, B(v)) == put_status::ok);
    want[k] = v;
  }
  CHECK(st.stats().overflow_keys == 32);
  std::size_t found = 0, ask = 0;
  for (const auto& [k, v] : want) {
    CHECK(S(*st.get(k)) == v);
    const outcome o = read_from(st, k);
    if (o.kind == outcome::found) {
      CHECK(o.value == v);
      ++found;
    } else {
      CHECK(o.kind == outcome::ask_server);
      ++ask;
    }
  }
  CHECK(found == 8);
  CHECK(ask == 32);
  std::size_t seen = 0;
  st.for_each([&](std::string_view k, std::span<const std::byte> v) {
    CHECK(want.at(std::string(k)) == S(v));
    ++seen;
  });
  CHECK(seen == 40);
  for (const auto& [k, v] : want) CHECK(st.del(k));
  CHECK(st.stats().keys == 0);
  CHECK(st.stats().used_bytes == 0);
  CHECK(read_from(st, "key1").kind == outcome::absent);  // the overflow count went back to 0
}

TEST_CASE("kv store: --max-memory fails a put with out_of_memory and keeps the old value", "[kv]") {
  store st({.max_memory = 8192, .max_value = 4096});
  const std::string v(1000, 'm');
  int n = 0;
  while (st.put("k" + std::to_string(n), B(v)) == put_status::ok) ++n;
  CHECK(n >= 4);
  CHECK(st.stats().used_bytes <= 8192);
  REQUIRE(st.put("k0", B(std::string(2000, 'n'))) == put_status::out_of_memory);
  CHECK(S(*st.get("k0")) == v);
  for (int i = 0; i < n; ++i) CHECK(S(*st.get("k" + std::to_string(i))) == v);
  CHECK(st.del("k1"));
  CHECK(st.put("k" + std::to_string(n), B(v)) == put_status::ok);
}

TEST_CASE("kv read: one-sided reads find what the store holds - stale and moved reads are never taken as values",
          "[kv]") {
  store st({.max_memory = 1 << 20});
  std::mt19937 rng(7);
  std::map<std::string, std::vector<std::string>> written;  // every value each key ever had
  auto value = [&](int key, int n) {
    const std::size_t len = (rng() % 3 == 0) ? 10 : 40 + rng() % 300;
    std::string v(len, static_cast<char>('a' + n % 26));
    v += "#" + std::to_string(key) + "/" + std::to_string(n);
    return v;
  };
  std::size_t stale_reads = 0, stale_torn = 0;
  for (int round = 0; round < 3000; ++round) {
    const int key = static_cast<int>(rng() % 50);
    const std::string k = "key" + std::to_string(key);
    // A reader that took the neighbourhood before this update and reads
    // the item after it (a moved or reused item).
    const layout l = st.describe();
    const std::uint64_t home = key_hash(l.seed, k) & (l.buckets - 1);
    const auto mem = st.memory();
    const std::vector<std::byte> before(mem.begin() + static_cast<std::ptrdiff_t>(home * kBucketSize),
                                        mem.begin() + static_cast<std::ptrdiff_t>(home * kBucketSize + kNeighbourhoodBytes));
    if (rng() % 5 == 0) {
      st.del(k);
    } else {
      const std::string v = value(key, round);
      REQUIRE(st.put(k, B(v)) == put_status::ok);
      written[k].push_back(v);
    }
    // Another key's update may reuse the freed memory.
    const std::string other = "key" + std::to_string((key + 1) % 50);
    const std::string ov = value(key + 1, round);
    REQUIRE(st.put(other, B(ov)) == put_status::ok);
    written[other].push_back(ov);

    const outcome o = read_from(st, k, &before);
    ++stale_reads;
    if (o.kind == outcome::found) {
      const auto& w = written[k];
      CHECK(std::find(w.begin(), w.end(), o.value) != w.end());
    } else if (o.kind == outcome::torn) {
      ++stale_torn;
    }
    // A fresh read sees exactly the current value.
    const outcome now = read_from(st, k);
    if (auto cur = st.get(k)) {
      REQUIRE(now.kind == outcome::found);
      CHECK(now.value == S(*cur));
    } else {
      CHECK(now.kind == outcome::absent);
    }
  }
  CHECK(stale_torn > 0);  // the checks did catch moved items
  INFO(stale_reads);
}

TEST_CASE("kv read: flipped bytes in a neighbourhood never yield a value that was not written", "[kv]") {
  store st({.max_memory = 1 << 20, .buckets = 1});
  std::map<std::string, std::string> want;
  for (int i = 0; i < 8; ++i) {
    const std::string k = "k" + std::to_string(i);
    want[k] = (i % 2 == 0 ? std::string(20, 'i') : std::string(200, 'a')) + std::to_string(i);
    REQUIRE(st.put(k, B(want[k])) == put_status::ok);
  }
  const auto mem = st.memory();
  std::mt19937 rng(11);
  std::size_t torn = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<std::byte> nb(mem.begin(), mem.begin() + static_cast<std::ptrdiff_t>(kNeighbourhoodBytes));
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) nb[rng() % nb.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
    const std::string k = "k" + std::to_string(rng() % 8);
    const outcome o = read_from(st, k, &nb);
    if (o.kind == outcome::found) {
      CHECK(o.value == want[k]);
    } else {
      torn += o.kind == outcome::torn ? 1 : 0;
    }
  }
  CHECK(torn > 1000);
}

TEST_CASE("kv read: hostile slots and layouts are refused before any READ", "[kv]") {
  const layout l = layout_of(1024, 1 << 20, 1024, 4096);
  const std::uint64_t region = l.arena_offset + l.arena_size;
  CHECK(layout_usable(l, region));
  CHECK_FALSE(layout_usable(l, region - 1));
  layout bad = l;
  bad.buckets = 1000;
  CHECK_FALSE(layout_usable(bad, region));
  bad = l;
  bad.arena_offset = 100;  // overlaps the index
  CHECK_FALSE(layout_usable(bad, region));
  bad = l;
  bad.arena_size = ~std::uint64_t{0};
  CHECK_FALSE(layout_usable(bad, region));
  bad = l;
  bad.buckets = std::uint64_t{1} << 62;  // (buckets + 1) * size would wrap
  CHECK_FALSE(layout_usable(bad, region));
  bad = l;
  bad.slot_size = 64;
  CHECK_FALSE(layout_usable(bad, region));
  bad = l;
  bad.magic = 0;
  CHECK_FALSE(layout_usable(bad, region));

  slot s{};
  s.length = 100;
  s.offset = (1 << 20) - 100;
  CHECK(item_in_bounds(s, l));
  s.offset = (1 << 20) - 99;
  CHECK_FALSE(item_in_bounds(s, l));
  s.offset = ~std::uint64_t{0} - 10;
  CHECK_FALSE(item_in_bounds(s, l));
  s.offset = 0;
  s.length = static_cast<std::uint32_t>(kItemHeader + 1024 + 4096 + 1);  // above the stated limits
  CHECK_FALSE(item_in_bounds(s, l));
  s.length = kItemHeader;  // no key
  CHECK_FALSE(item_in_bounds(s, l));
}

namespace {

// A log file's header: version 1 (salt 0, as earlier servers wrote) or 2.
std::vector<std::byte> log_header(std::uint32_t salt) {
  std::vector<std::byte> h(kLogHeader);
  const std::uint32_t v[2] = {salt == 0 ? 1u : 2u, salt};
  std::memcpy(h.data(), "ADKVLOG1", 8);
  std::memcpy(h.data() + 8, v, 8);
  return h;
}

}  // namespace

TEST_CASE("kv log: records round-trip - a cut at every byte of the last record is a torn tail", "[kv]") {
  for (const std::uint32_t salt : {0u, 0x5eed1234u}) {
    INFO("salt " << salt);
    // The file header, then three records.
    std::vector<std::byte> file = log_header(salt);
    encode_record(file, record_type::put, "alpha", B("one"), salt);
    encode_record(file, record_type::del, "beta", {}, salt);
    const std::size_t last = file.size();
    encode_record(file, record_type::put, "gamma", B(std::string(300, 'g')), salt);
    std::vector<std::string> seen;
    auto apply = [&](record_type t, std::string_view k, std::span<const std::byte> v) {
      seen.push_back((t == record_type::put ? "put " : "del ") + std::string(k) + "=" + S(v).substr(0, 3));
    };
    log_parse p = parse_log(file, apply);
    CHECK(p.result == log_parse::outcome::ok);
    CHECK(p.records == 3);
    CHECK(seen == std::vector<std::string>{"put alpha=one", "del beta=", "put gamma=ggg"});
    for (std::size_t cut = last + 1; cut < file.size(); ++cut) {
      seen.clear();
      p = parse_log(std::span(file).first(cut), apply);
      INFO("cut at " << cut);
      CHECK(p.result == log_parse::outcome::torn);
      CHECK(p.valid_end == last);
      CHECK(p.records == 2);
    }
    // The last record complete but with a bad CRC: torn (its write did not finish).
    auto bad = file;
    bad[file.size() - 1] ^= std::byte{1};
    CHECK(parse_log(bad, apply).result == log_parse::outcome::torn);
    // Zeros after the good records (space reserved ahead, or a file
    // extended but not written): nothing torn, the records end there.
    auto zeros = std::vector<std::byte>(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(last));
    zeros.resize(zeros.size() + 4096);
    p = parse_log(zeros, apply);
    CHECK(p.result == log_parse::outcome::ok);
    CHECK(p.valid_end == last);
    CHECK(p.zero_tail == 4096);
    // ... but a byte that is not zero in them is a torn tail (the bytes from
    // the end of the records on), as is a record cut short into zeros.
    zeros.back() = std::byte{7};
    p = parse_log(zeros, apply);
    CHECK(p.result == log_parse::outcome::torn);
    CHECK(p.valid_end == last);
    CHECK(p.zero_tail == 0);
    auto cut_into_zeros = std::vector<std::byte>(file.begin(), file.end() - 3);
    cut_into_zeros.resize(cut_into_zeros.size() + 4096);
    p = parse_log(cut_into_zeros, apply);
    CHECK(p.result == log_parse::outcome::torn);
    CHECK(p.valid_end == last);
    // A length broken to reach into zeros after the records, with good
    // records inside what it claims: corruption, not a torn record in
    // reserved space (that would cut the good ones off).
    auto long_into_zeros = file;
    long_into_zeros.resize(file.size() + 4096);
    {
      const std::uint32_t v =
          static_cast<std::uint32_t>(file.size() - 16 - 16 - 5 + 100);  // alpha's value, past the end of gamma
      std::memcpy(long_into_zeros.data() + 16 + 12, &v, 4);
    }
    p = parse_log(long_into_zeros, apply);
    CHECK(p.result == log_parse::outcome::corrupt);
    CHECK(p.valid_end == 16);
    // A bad record with a good one after it: corruption.
    auto mid = file;
    mid[16 + 4 + 12 + 2] ^= std::byte{0x40};  // a byte of alpha's key
    p = parse_log(mid, apply);
    CHECK(p.result == log_parse::outcome::corrupt);
    CHECK(p.valid_end == 16);
    CHECK(p.why.find("CRC mismatch at offset 16") != std::string::npos);
    // An impossible length in the middle: corruption, not a reason to read past the end.
    auto len = file;
    len[16 + 8] = std::byte{0xff};
    len[16 + 9] = std::byte{0xff};
    len[16 + 10] = std::byte{0xff};
    CHECK(parse_log(len, apply).result == log_parse::outcome::corrupt);
    // A length in the middle corrupted to point past the end (below the hard
    // limits): it looks cut short, but valid records follow: corruption.
    auto past = file;
    past[16 + 14] = std::byte{0x01};  // alpha's value length + 64 KiB
    p = parse_log(past, apply);
    CHECK(p.result == log_parse::outcome::corrupt);
    // (Version 2: the header check fails first.)
    CHECK(p.why.find(salt == 0 ? "a record cut short at offset 16"
                               : "a record header that fails its check at offset 16") != std::string::npos);
    // Not a log at all.
    CHECK(parse_log(B("hello, this is not a log file"), apply).result == log_parse::outcome::not_a_log);
    auto other = file;
    other[8] = std::byte{3};
    CHECK(parse_log(other, apply).result == log_parse::outcome::not_a_log);
    // A version that does not match its salt: version 1 with one, 2 without.
    other = file;
    other[8] = salt == 0 ? std::byte{2} : std::byte{1};
    CHECK(parse_log(other, apply).result == log_parse::outcome::not_a_log);
    // Records of another salt (or version) are not this log's.
    std::vector<std::byte> foreign = log_header(salt);
    encode_record(foreign, record_type::put, "alpha", B("one"), salt ^ 1);
    p = parse_log(foreign, apply);
    CHECK(p.result == log_parse::outcome::torn);
    CHECK(p.records == 0);
  }
}

TEST_CASE("kv log: a value holding well-formed records - cut short by a crash - is a torn tail: the log's salt",
          "[kv]") {
  // What a hostile client stores: records as a log of version 1, or of
  // other salts, would hold them, in the middle of a value.
  std::vector<std::byte> forged;
  for (const std::uint32_t other : {0u, 0x5eed1235u, 0x12345678u}) {
    encode_record(forged, record_type::put, "forged", B("x"), other);
  }
  std::string value(4096, 'v');
  value.replace(1000, forged.size(), S(forged));
  auto apply = [](record_type, std::string_view, std::span<const std::byte>) {};
  for (const std::uint32_t salt : {0u, 0x5eed1234u}) {
    INFO("salt " << salt);
    std::vector<std::byte> file = log_header(salt);
    encode_record(file, record_type::put, "good", B("one"), salt);
    const std::size_t last = file.size();
    encode_record(file, record_type::put, "hostile", B(value), salt);
    // The crash cut the last write after the forged records.
    const log_parse p = parse_log(std::span(file).first(file.size() - 100), apply);
    if (salt == 0) {
      CHECK(p.result == log_parse::outcome::corrupt);  // version 1's weakness (logs of earlier servers)
    } else {
      CHECK(p.result == log_parse::outcome::torn);
      CHECK(p.valid_end == last);
      CHECK(p.records == 1);
    }
  }
  // A fresh log is salted: the same crash leaves a log that starts, the
  // hostile record cut off as a torn tail.
  const std::string dir = tmpdir();
  asio::io_context io;
  {
    store st({.max_memory = 1 << 20});
    durable_log log(io, {.dir = dir, .sync = sync_mode::no},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    CHECK(log.salt() != 0);
    service svc(st, &log);
    std::uint64_t lsn = 0;
    REQUIRE(svc.put("good", B("one"), lsn).is_ok());
    REQUIRE(svc.put("hostile", B(value), lsn).is_ok());
    io.run();
    log.close();
  }
  const std::string path = dir + "/kv.log";
  REQUIRE(::truncate(path.c_str(), static_cast<off_t>(std::filesystem::file_size(path) - 100)) == 0);
  {
    store st({.max_memory = 1 << 20});
    std::vector<std::string> keys;
    durable_log log(io, {.dir = dir, .sync = sync_mode::no},
                    [&](record_type, std::string_view k, std::span<const std::byte>) { keys.emplace_back(k); });
    CHECK(keys == std::vector<std::string>{"good"});
    CHECK(log.replayed().torn_bytes == kRecordHeader + 7 + value.size() - 100);
    log.close();
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a torn tail full of forged record headers is told from corruption in linear time", "[kv]") {
  // A 1 MiB value with a record header every 16 bytes, each claiming a
  // record that reaches to near the end of the value: unsalted, replay would
  // CRC 32 GiB to learn that none is good; salted, a forged header fails
  // its check and costs no CRC.
  const std::uint32_t salt = 0x5eed1234u;
  std::vector<std::byte> value(1 << 20);
  for (std::size_t o = 0; o + kRecordHeader + 64 <= value.size(); o += kRecordHeader) {
    // (ending 64 bytes before the value's end: inside what the crash left)
    const std::uint32_t k = 1, v = static_cast<std::uint32_t>(value.size() - o - kRecordHeader - 64);
    value[o + 4] = std::byte{1};
    value[o + 5] = static_cast<std::byte>(o >> 4);  // check bytes: zeros (version 1's) and others
    std::memcpy(value.data() + o + 8, &k, 4);
    std::memcpy(value.data() + o + 12, &v, 4);
  }
  std::vector<std::byte> file = log_header(salt);
  encode_record(file, record_type::put, "good", B("one"), salt);
  const std::size_t last = file.size();
  encode_record(file, record_type::put, "many", value, salt);
  const auto t0 = std::chrono::steady_clock::now();
  const log_parse p =
      parse_log(std::span(file).first(file.size() - 8), [](record_type, std::string_view, std::span<const std::byte>) {});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(p.result == log_parse::outcome::torn);
  CHECK(p.valid_end == last);
  CHECK(s < 1.0);
}

namespace {
// The whole file, in one read: byte by byte through a stream iterator
// took minutes under TSan at -O1 (a test reads a log 300 times).
std::vector<std::byte> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<std::byte> b;
  const std::streamoff n = in ? static_cast<std::streamoff>(in.tellg()) : -1;
  if (n <= 0) return b;
  b.resize(static_cast<std::size_t>(n));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(n));
  b.resize(static_cast<std::size_t>(in.gcount()));
  return b;
}
// Where the good records in the log file at `path` end (the file may be
// longer: space reserved ahead).
std::size_t logged_end(const std::string& path) {
  return parse_log(file_bytes(path), [](record_type, std::string_view, std::span<const std::byte>) {}).valid_end;
}

// Replays the log in `dir` into a fresh store: it must equal `live`, and
// no tail may be torn.
void expect_replay_equals(asio::io_context& io, const std::string& dir, sync_mode mode, const store& live,
                          std::uint64_t max_memory = 4 << 20) {
  store back({.max_memory = max_memory});
  io.restart();
  durable_log again(io, {.dir = dir, .sync = mode}, [&](record_type t, std::string_view k, std::span<const std::byte> v) {
    if (t == record_type::put) back.put(k, v, true); else back.del(k);
  });
  CHECK(again.replayed().torn_bytes == 0);
  CHECK(back.stats().keys == live.stats().keys);
  live.for_each([&](std::string_view k, std::span<const std::byte> v) {
    auto got = back.get(k);
    REQUIRE(got);
    CHECK(S(*got) == S(v));
  });
  again.close();
}

// Writes 300 puts (distinct values) and deletes without running the io
// context, so that a compaction starts early and the later records follow
// its marker; runs it; then replays the log into a fresh store and checks
// it equals the live one. Returns the log's stats.
log_stats write_compact_replay(const std::string& dir, bool break_compaction, bool version1 = false) {
  asio::io_context io;
  store st({.max_memory = 4 << 20});
  log_stats stats;
  if (version1) {  // an empty log as an earlier server left it
    const std::vector<std::byte> h = log_header(0);
    std::ofstream(dir + "/kv.log", std::ios::binary).write(reinterpret_cast<const char*>(h.data()),
                                                            static_cast<std::streamsize>(h.size()));
  }
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::always, .compact_min = 16 << 10},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    if (break_compaction) std::filesystem::create_directory(dir + "/kv.log.compact");  // open() fails: EISDIR
    service svc(st, &log);
    int acked = 0;
    for (int i = 0; i < 300; ++i) {
      std::uint64_t lsn = 0;
      const std::string key = "key" + std::to_string(i % 10);
      if (i % 17 == 16) {
        bool existed = false;
        REQUIRE(svc.del(key, existed, lsn).is_ok());
        if (!existed) continue;
      } else {
        REQUIRE(svc.put(key, B(std::to_string(i) + std::string(200, static_cast<char>('a' + i % 26))), lsn).is_ok());
      }
      log.async_wait(lsn, [&](std::error_code ec) {
        CHECK_FALSE(ec);
        ++acked;
      });
    }
    io.run();
    CHECK(acked > 250);
    stats = log.stats();
    CHECK(stats.fsyncs < 300);  // group commit: the writers shared fsyncs
    log.close();
    // The file is exactly the records the log counted: none twice (the
    // copy after the snapshot starts where the snapshot ends), none lost.
    CHECK(std::filesystem::file_size(dir + "/kv.log") == log.stats().file_bytes);
    CHECK(log.salt() != 0);
    CHECK(log.replayed().rewritten == version1);
  }
  // Version 2 through the compaction (a log of version 1 was rewritten at start).
  const std::vector<std::byte> f = file_bytes(dir + "/kv.log");
  REQUIRE(f.size() >= kLogHeader);
  std::uint32_t hv[2];
  std::memcpy(hv, f.data() + 8, 8);
  CHECK(hv[0] == 2u);
  CHECK(hv[1] != 0);
  expect_replay_equals(io, dir, sync_mode::always, st);
  return stats;
}
}  // namespace

TEST_CASE("kv log: records written while a compaction runs follow it into the new log - fsyncs are shared", "[kv]") {
  const std::string dir = tmpdir();
  const log_stats s = write_compact_replay(dir, false);
  CHECK(s.compactions == 1);  // 300 x 220 B of log for 10 live keys
  CHECK(s.compaction_failures == 0);
  CHECK(std::filesystem::file_size(dir + "/kv.log") < 55000);  // about 66 KB without it
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: the time a compaction's snapshot holds the io thread is reported - the last one and the longest",
          "[kv]") {
  const std::string dir = tmpdir();
  {
    asio::io_context io;
    durable_log log(io, {.dir = dir, .sync = sync_mode::no, .compact_min = 16 << 10},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    CHECK(log.stats().last_snapshot_us == 0);
    CHECK(log.stats().max_snapshot_us == 0);
    const std::string value(200, 'x');
    auto fill = [&] {  // about 44 KB of log for one live key of 201 B
      for (int i = 0; i < 200; ++i) REQUIRE(log.append(record_type::put, "k", B(value)) != 0);
    };
    auto one_key = [&](snapshot_buffer& out) {
      encode_record(out, record_type::put, "k", B(value), log.salt());
      return true;
    };
    fill();
    log.maybe_compact(kRecordHeader + 1 + value.size(), [&](snapshot_buffer& out) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a large store's copy
      return one_key(out);
    });
    io.run();
    io.restart();
    REQUIRE(log.stats().compactions == 1);
    const std::uint64_t slow = log.stats().last_snapshot_us;
    CHECK(slow >= 200000);
    CHECK(log.stats().max_snapshot_us == slow);
    fill();
    log.maybe_compact(kRecordHeader + 1 + value.size(), one_key);
    io.run();
    REQUIRE(log.stats().compactions == 2);
    CHECK(log.stats().last_snapshot_us < slow);
    CHECK(log.stats().max_snapshot_us == slow);
    log.close();
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a snapshot's memory grows in blocks without moving what it holds - in order, any size", "[kv]") {
  snapshot_buffer b;
  CHECK(b.size() == 0);
  CHECK(b.blocks() == 0);
  // Pieces of 1 B to 3 MiB, 20 MiB in all, then one of 9 MiB (larger than
  // a block): every byte where it was written, blocks in order.
  std::vector<std::pair<std::byte*, std::size_t>> pieces;
  std::size_t total = 0;
  std::uint8_t next = 1;
  for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{3} << 20, std::size_t{5} << 20,
                        std::size_t{7} << 20, std::size_t{5} << 20, std::size_t{9} << 20, std::size_t{17}}) {
    std::byte* p = b.append(n);
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(next++);
    pieces.emplace_back(p, n);
    total += n;
  }
  CHECK(b.size() == total);
  CHECK(b.blocks() >= 3);
  std::uint8_t want = 1;
  bool same = true;
  std::size_t seen = 0;
  for (std::size_t i = 0; i < b.blocks(); ++i) {
    for (std::byte x : b.block(i)) same = same && x == static_cast<std::byte>(want++);
    seen += b.block(i).size();
  }
  CHECK(same);
  CHECK(seen == total);
  // Never moved: the first piece is still where append put it.
  CHECK(pieces.front().first[0] == std::byte{1});
  snapshot_buffer moved = std::move(b);
  CHECK(b.size() == 0);
  CHECK(moved.size() == total);
  moved.clear();
  CHECK(moved.blocks() == 0);
  CHECK(moved.size() == 0);
}

TEST_CASE("kv log: a compaction whose snapshot is larger than 2 MiB (mapped memory) replays as the live data",
          "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 16 << 20});
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::no, .compact_min = 1 << 20},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    for (int round = 0; round < 3; ++round) {  // 3000 keys of 1000 B, written 3 times: about 9 MB of log
      for (int i = 0; i < 3000; ++i) {
        std::uint64_t lsn = 0;
        const std::string value = std::to_string(round) + ":" + std::string(998, static_cast<char>('a' + i % 26));
        REQUIRE(svc.put("key" + std::to_string(i), B(value), lsn).is_ok());
      }
      io.run();
      io.restart();
    }
    CHECK(log.stats().compactions >= 1);
    CHECK(log.stats().compaction_failures == 0);
    CHECK(st.stats().live_bytes > (std::uint64_t{2} << 20));
    log.close();
  }
  expect_replay_equals(io, dir, sync_mode::no, st, 16 << 20);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a snapshot taken in steps with writes in between - puts, overwrites and deletes on either side of "
          "its cursor - replays as the live data",
          "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 32 << 20});
  std::mt19937 rng(7);
  auto value = [&](int key, int round) {
    return std::to_string(key) + "/" + std::to_string(round) + ":" + std::string(990, static_cast<char>('a' + key % 26));
  };
  std::uint64_t steps = 0;
  int between = 0;  // writes made while the snapshot was under way
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::no, .compact_min = 1 << 20},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    std::uint64_t lsn = 0;
    for (int i = 0; i < 3000; ++i) REQUIRE(svc.put("key" + std::to_string(i), B(value(i, 0)), lsn).is_ok());
    io.run();
    io.restart();
    // Overwritten until the log passes twice the live data: the compaction
    // starts inside that put, its first step (4 MiB of work of about 19:
    // 3 MB of records, 16 MiB of buckets) with it.
    for (int i = 0; i < 6000 && !log.compacting(); ++i) {
      REQUIRE(svc.put("key" + std::to_string(i % 3000), B(value(i % 3000, 1)), lsn).is_ok());
    }
    REQUIRE(log.compacting());
    CHECK(log.stats().last_snapshot_steps == 1);
    CHECK(log.stats().compactions == 0);
    // Writes between the steps: overwrites, deletes and new keys anywhere
    // in the table (ahead of the cursor and behind it), then one handler.
    // None once the snapshot is taken: each of these must reach the new
    // log by its own record (a later write would hide a lost one).
    for (int turn = 0; turn < 2000 && log.stats().compactions == 0; ++turn) {
      if (log.stats().last_snapshot_steps > steps) steps = log.stats().last_snapshot_steps;
      for (int w = 0; w < 20 && log.snapshotting(); ++w) {
        const int k = static_cast<int>(rng() % 3500);
        const std::string key = "key" + std::to_string(k);
        if (rng() % 4 == 0) {
          bool existed = false;
          REQUIRE(svc.del(key, existed, lsn).is_ok());
        } else {
          REQUIRE(svc.put(key, B(value(k, 2 + turn)), lsn).is_ok());
        }
        ++between;
      }
      if (io.poll_one() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // (the compactor's thread)
      io.restart();
    }
    io.run();
    io.restart();
    CHECK(log.stats().compactions == 1);
    CHECK(log.stats().compaction_failures == 0);
    CHECK(log.stats().last_snapshot_steps >= 3);
    log.close();
  }
  INFO("snapshot steps " << steps << ", writes between them " << between);
  CHECK(between >= 40);
  expect_replay_equals(io, dir, sync_mode::no, st, 32 << 20);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a snapshot taken in steps under churn - deletes behind its cursor, inserts ahead, overflow keys - "
          "replays within the memory limit",
          "[kv]") {
  // The snapshot holds only keys written before it began: one that took
  // every key the cursor passed (deleted since, or inserted since) could
  // need far more memory to replay than the store ever used.
  const std::uint64_t limit = 8 << 20;
  for (const std::uint64_t buckets : {std::uint64_t{0}, std::uint64_t{1024}}) {  // 1024: most keys overflow
    INFO("buckets " << buckets);
    const std::string dir = tmpdir();
    asio::io_context io;
    store st({.max_memory = limit, .buckets = buckets});
    std::mt19937 rng(11);
    const std::string value(1000, 'v');
    std::vector<int> live_keys;
    int next_key = 0;
    {
      durable_log log(io, {.dir = dir, .sync = sync_mode::no, .compact_min = 1 << 20},
                      [](record_type, std::string_view, std::span<const std::byte>) {});
      service svc(st, &log);
      std::uint64_t lsn = 0;
      for (; next_key < 6200; ++next_key) {  // (about 8 MB: items and the overflow table)
        REQUIRE(svc.put("key" + std::to_string(next_key), B(value), lsn).is_ok());
        live_keys.push_back(next_key);
      }
      io.run();
      io.restart();
      for (int i = 0; i < 20000 && !log.compacting(); ++i) {
        REQUIRE(svc.put("key" + std::to_string(live_keys[static_cast<std::size_t>(i) % live_keys.size()]), B(value),
                        lsn).is_ok());
      }
      REQUIRE(log.snapshotting());
      // The store as the snapshot began (inside that put): its records.
      const std::uint64_t at_start = kLogHeader + st.stats().live_bytes + st.stats().keys * kRecordHeader;
      int steps_churned = 0;
      for (int turn = 0; turn < 5000 && log.stats().compactions == 0; ++turn) {
        if (log.snapshotting()) {
          // A quarter of the keys deleted, as many new ones put: the live
          // data stays the same size.
          ++steps_churned;
          for (int w = 0; w < 1600; ++w) {
            const std::size_t at = rng() % live_keys.size();
            bool existed = false;
            REQUIRE(svc.del("key" + std::to_string(live_keys[at]), existed, lsn).is_ok());
            REQUIRE(existed);
            live_keys[at] = next_key++;
            REQUIRE(svc.put("key" + std::to_string(live_keys[at]), B(value), lsn).is_ok());
          }
        }
        if (io.poll_one() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        io.restart();
      }
      io.run();
      io.restart();
      CHECK(steps_churned >= 2);
      CHECK(log.stats().last_snapshot_steps >= 2);
      // Never more than the store held then (keys put since are left out).
      CHECK(log.stats().last_snapshot_bytes <= at_start);
      CHECK(log.stats().last_snapshot_bytes > at_start / 2);
      CHECK(log.stats().compactions == 1);
      CHECK(log.stats().compaction_failures == 0);
      if (buckets != 0) CHECK(st.stats().overflow_keys > 1000);
      log.close();
    }
    expect_replay_equals(io, dir, sync_mode::no, st, limit);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("kv log: a log of version 1 (an earlier server's) is rewritten as version 2 at start - its records kept",
          "[kv]") {
  {
    const std::string dir = tmpdir();  // empty, then written on and compacted
    const log_stats s = write_compact_replay(dir, false, true);
    CHECK(s.compactions == 1);
    CHECK(s.compaction_failures == 0);
    std::filesystem::remove_all(dir);
  }
  // With records, a zero tail (always's reserve) and a torn record: the
  // torn one is cut and saved first, the others are rewritten in order.
  const std::string dir = tmpdir();
  std::vector<std::byte> v1 = log_header(0);
  encode_record(v1, record_type::put, "a", B("1"), 0);
  encode_record(v1, record_type::put, "b", B(std::string(3000, 'b')), 0);
  encode_record(v1, record_type::del, "a", {}, 0);
  encode_record(v1, record_type::put, "c", B("3"), 0);
  const std::size_t good = v1.size();
  encode_record(v1, record_type::put, "torn", B(std::string(100, 't')), 0);
  v1.resize(v1.size() - 10);
  v1.resize(v1.size() + 8192);  // zeros: space reserved ahead
  std::ofstream(dir + "/kv.log", std::ios::binary)
      .write(reinterpret_cast<const char*>(v1.data()), static_cast<std::streamsize>(v1.size()));
  asio::io_context io;
  std::vector<std::string> seen;
  auto apply = [&](record_type t, std::string_view k, std::span<const std::byte> v) {
    seen.push_back((t == record_type::put ? "put " : "del ") + std::string(k) + "=" + std::to_string(v.size()));
  };
  const std::vector<std::string> want{"put a=1", "put b=3000", "del a=0", "put c=1"};
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::always}, apply);
    CHECK(seen == want);
    CHECK(log.replayed().rewritten);
    CHECK(log.replayed().torn_bytes > 0);
    CHECK_FALSE(log.replayed().torn_copy.empty());
    CHECK(log.salt() != 0);
    // The new file: the same records salted, and a write after them.
    CHECK(log.replayed().bytes == good);  // (the same sizes: only the checks differ)
    store st({.max_memory = 1 << 20});
    service svc(st, &log);
    CHECK_FALSE(durable_put(io, svc, log, "d", "4"));
    log.close();
  }
  CHECK_FALSE(std::filesystem::exists(dir + "/kv.log.compact"));
  const std::vector<std::byte> f = file_bytes(dir + "/kv.log");
  seen.clear();
  const log_parse p = parse_log(f, apply);
  CHECK(p.result == log_parse::outcome::ok);
  CHECK(p.salt != 0);
  std::vector<std::string> want_after = want;
  want_after.emplace_back("put d=1");
  CHECK(seen == want_after);
  {
    seen.clear();
    durable_log log(io, {.dir = dir, .sync = sync_mode::always}, apply);  // version 2 now: nothing rewritten
    CHECK_FALSE(log.replayed().rewritten);
    CHECK(seen == want_after);
    log.close();
  }
  std::filesystem::remove_all(dir);
}

namespace {

// What the code under test writes to stderr (fd 2) in the scope.
class stderr_capture {
 public:
  stderr_capture() : path_("/tmp/anydoor-kv-stderr-" + std::to_string(::getpid())) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(saved_ >= 0);
    REQUIRE(fd >= 0);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~stderr_capture() {
    restore();
    ::unlink(path_.c_str());
  }
  std::string text() {
    restore();
    return text_;
  }
  stderr_capture(const stderr_capture&) = delete;
  stderr_capture& operator=(const stderr_capture&) = delete;

 private:
  // Back to the real stderr, and what was caught is written there too (a
  // sanitizer's report among it must not vanish).
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    std::ifstream in(path_);
    text_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    std::fwrite(text_.data(), 1, text_.size(), stderr);
  }
  std::string path_;
  std::string text_;
  int saved_ = -1;
};

}  // namespace

TEST_CASE("kv log: a version 1 log that cannot be rewritten stays version 1 - written on, and rewritten next time",
          "[kv]") {
  for (const bool full_disk : {false, true}) {
    INFO((full_disk ? "the rewrite's writes fail (a file size limit)" : "kv.log.compact cannot be created"));
    const std::string dir = tmpdir();
    std::vector<std::byte> v1 = log_header(0);
    for (int i = 0; i < 100; ++i) encode_record(v1, record_type::put, "k" + std::to_string(i), B(std::string(1000, 'v')), 0);
    std::ofstream(dir + "/kv.log", std::ios::binary)
        .write(reinterpret_cast<const char*>(v1.data()), static_cast<std::streamsize>(v1.size()));
    if (!full_disk) std::filesystem::create_directory(dir + "/kv.log.compact");  // open() fails: EISDIR
    asio::io_context io;
    int replayed = 0;
    auto count = [&](record_type, std::string_view, std::span<const std::byte>) { ++replayed; };
    {
      std::optional<file_size_limit> limit;
      if (full_disk) limit.emplace(v1.size() / 2);  // (the old log is read, not grown)
      durable_log log(io, {.dir = dir, .sync = sync_mode::always}, count);
      limit.reset();
      CHECK(replayed == 100);
      CHECK_FALSE(log.replayed().rewritten);
      CHECK_THAT(log.replayed().rewrite_failed,
                 Catch::Contains(full_disk ? "File too large" : "Is a directory") && Catch::Contains("kv.log.compact"));
      CHECK(log.salt() == 0);
      store st({.max_memory = 1 << 20});
      service svc(st, &log);
      CHECK_FALSE(durable_put(io, svc, log, "after", "x"));
      log.close();
    }
    CHECK(std::filesystem::file_size(dir + "/kv.log") == v1.size() + kRecordHeader + 5 + 1);  // version 1, appended to
    if (!full_disk) CHECK(std::filesystem::is_directory(dir + "/kv.log.compact"));
    std::filesystem::remove_all(dir + "/kv.log.compact");
    replayed = 0;
    {
      durable_log log(io, {.dir = dir, .sync = sync_mode::always}, count);
      CHECK(replayed == 101);
      CHECK(log.replayed().rewritten);
      CHECK(log.salt() != 0);
      log.close();
    }
    std::filesystem::remove_all(dir);
  }
}

namespace {

// fdatasync(2) that fails with EIO once the file has reached g_fail_at
// bytes (a write hit a file size limit there), counting its calls.
std::atomic<int> g_syncs{0};
std::atomic<int> g_failed_syncs{0};
std::atomic<long long> g_fail_at{0};
int failing_fdatasync(int fd) {
  ++g_syncs;
  struct stat st{};
  if (::fstat(fd, &st) == 0 && st.st_size >= g_fail_at.load()) {
    ++g_failed_syncs;
    errno = EIO;
    return -1;
  }
  return ::fdatasync(fd);
}

int occurrences(const std::string& text, const std::string& what) {
  int n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("kv log: a failed fdatasync fails the log - never tried again, the operator told what may not be on the disk",
          "[kv]") {
  g_syncs = 0;
  g_failed_syncs = 0;
  g_fail_at = 0;  // every fdatasync fails
  const std::string dir = tmpdir();
  asio::io_context io;
  std::string told;
  {
    stderr_capture capture;
    store st({.max_memory = 1 << 20});
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec, .fdatasync_hook = &failing_fdatasync},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    CHECK_FALSE(durable_put(io, svc, log, "a", "1"));  // everysec: answered once written
    // The thread fsyncs it within about a second: that fails.
    wait_for_log_error(io, log);
    REQUIRE(log.error() == std::errc::io_error);
    io.restart();
    io.poll();  // (the failure's post)
    CHECK(log.error_text() == "the log cannot be made durable: fdatasync: Input/output error");
    std::uint64_t lsn = 0;
    CHECK(svc.put("b", B("2"), lsn).code() == rpc::errc::unavailable);
    // Never tried again (a second fdatasync can report success for pages
    // the first lost): not later, not at the close.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    log.close();
    CHECK(g_syncs == 1);
    CHECK(log.stats().fsyncs == 0);
    told = capture.text();
  }
  CHECK_THAT(told, Catch::Contains("kv.log cannot be made durable: fdatasync: Input/output error; writes are refused") &&
                       Catch::Contains("but what was acknowledged since the last fsync may not be on the disk (the next start "
                                      "rewrites the log from what it reads, kv.log.sync-failed marks it"));
  CHECK_THAT(told, !Catch::Contains("one more fdatasync"));
  CHECK(occurrences(told, "writes are refused from now on") == 1);
  std::filesystem::remove_all(dir);
}

namespace {
prior inline_prior(std::string_view v) {
  prior p;
  p.what = prior::kind::inline_value;
  p.size = static_cast<std::uint32_t>(v.size());
  std::memcpy(p.bytes.data(), v.data(), v.size());
  return p;
}
prior item_prior(std::uint64_t offset) {
  prior p;
  p.what = prior::kind::item;
  p.item = offset;
  return p;
}
}  // namespace

TEST_CASE("kv undo journal: taken back newest first above the held position - forgotten below it, kept items "
          "released, its memory bounded",
          "[kv]") {
  std::vector<std::string> seen;
  std::vector<std::uint64_t> released;
  auto record = [&](const undo_journal::before& b) {
    std::string what = b.what == prior::kind::absent ? "(absent)"
                       : b.what == prior::kind::item ? "#" + std::to_string(b.item)
                                                     : S(b.value);
    seen.push_back(std::string(b.key) + "=" + what);
  };
  auto release = [&](std::uint64_t item) { released.push_back(item); };
  undo_journal j;
  j.note("a", inline_prior("a0"));
  j.set_lsn(10);
  j.note("b", item_prior(200));
  j.set_lsn(20);
  j.note("a", item_prior(100));
  j.set_lsn(30);
  j.note("c", inline_prior(""));  // an empty value is a value
  j.set_lsn(40);
  j.note("e", prior{});
  j.set_lsn(50);
  CHECK(j.writes() == 5);
  j.forget_until(15, release);
  CHECK(j.writes() == 4);
  CHECK(released.empty());
  CHECK(j.take_back(20, record, release) == 3);
  CHECK(seen == std::vector<std::string>{"e=(absent)", "c=", "a=#100"});
  CHECK(released == std::vector<std::uint64_t>{200});  // durable: its old item is free again
  CHECK(j.writes() == 0);
  CHECK(j.bytes() == 0);
  j.note("x", item_prior(300));
  j.set_lsn(60);
  j.forget_until(60, release);
  CHECK(released == std::vector<std::uint64_t>{200, 300});
  // Without a position (not appended yet) is above any.
  seen.clear();
  j.note("d", inline_prior("d0"));
  CHECK(j.take_back(~std::uint64_t{0}, record, release) == 1);
  CHECK(seen == std::vector<std::string>{"d=d0"});
  // The last write alone.
  seen.clear();
  j.note("e", inline_prior("e0"));
  j.set_lsn(70);
  j.note("f", prior{});
  j.take_back_last(record);
  CHECK(seen == std::vector<std::string>{"f=(absent)"});
  CHECK(j.writes() == 1);
  CHECK(j.bytes() == 3);  // "e", "e0"
  j.forget_until(70, release);
  CHECK(j.writes() == 0);
  // Kept items spilled into the journal: their values copied, the items released.
  seen.clear();
  released.clear();
  j.note("s", item_prior(500));
  j.set_lsn(80);
  j.note("t", item_prior(600));
  j.set_lsn(90);
  j.note("u", inline_prior("u0"));
  j.set_lsn(100);
  CHECK(j.kept_items() == 2);
  const std::string five(200, '5');
  auto value_of = [&](std::uint64_t item) {
    const std::string_view v = item == 500 ? std::string_view(five) : std::string_view("six");
    return std::as_bytes(std::span(v.data(), v.size()));
  };
  // Among the eligible alone: the newer first here.
  CHECK(j.spill_if(value_of, release, 0, [](std::uint64_t item) { return item == 600; }) == 3);
  CHECK(j.kept_items() == 1);
  CHECK(released == std::vector<std::uint64_t>{600});
  CHECK(j.spill_if(value_of, release, 0, [](std::uint64_t) { return false; }) == 0);  // none eligible
  CHECK(j.kept_items() == 1);
  // As much as asked, oldest first: one item (at least one, even for 0).
  CHECK(j.spill(value_of, release, 0) == 200);
  CHECK(j.kept_items() == 0);
  CHECK(released == std::vector<std::uint64_t>{600, 500});
  CHECK(j.spill(value_of, release) == 0);  // none left
  CHECK(j.take_back(0, record, release) == 3);
  CHECK(seen == std::vector<std::string>{"u=u0", "t=six", "s=" + five});
  CHECK(released.size() == 2);  // (not again)
  // On until at least `at_least` bytes have moved: 4 takes both.
  released.clear();
  j.note("x", item_prior(700));
  j.set_lsn(110);
  j.note("y", item_prior(800));
  j.set_lsn(120);
  CHECK(j.spill(value_of, release, 4) == 6);  // ("six" each: on past the first)
  CHECK(released == std::vector<std::uint64_t>{700, 800});
  CHECK(j.take_back(0, record, release) == 2);
  // A steady load never drains it: what it holds stays near the writes in
  // flight (here 10, 60 bytes of old value each), not everything since it
  // last drained.
  const std::string v(60, 'v');
  std::size_t most = 0;
  for (std::uint64_t i = 1; i <= 100000; ++i) {
    j.note("key" + std::to_string(i % 1000), inline_prior(v));
    j.set_lsn(i);
    if (i > 10) j.forget_until(i - 10, release);
    most = std::max(most, j.footprint());
  }
  CHECK(j.writes() == 10);
  // (moved once 64 are forgotten and they outweigh the rest; without the
  // move it would hold all 100,000)
  CHECK(most <= (64 + 2 * 11) * (v.size() + 8));
  // What it holds after the moves is still each write's key and value.
  seen.clear();
  CHECK(j.take_back(0, record, release) == 10);
  std::vector<std::string> last;
  for (std::uint64_t i = 100000; i > 99990; --i) last.push_back("key" + std::to_string(i % 1000) + "=" + v);
  CHECK(seen == last);
}

TEST_CASE("kv undo journal: a spill starts past the entries that keep no item - and still finds every kept one after "
          "the journal moves its entries",
          "[kv]") {
  undo_journal j;
  std::vector<std::uint64_t> released;
  auto release = [&](std::uint64_t item) { released.push_back(item); };
  auto value_of = [](std::uint64_t) { return std::as_bytes(std::span("vv", 2)); };
  const std::string v(40, 'v');
  for (std::uint64_t i = 1; i <= 100; ++i) {  // inline old values
    j.note("key" + std::to_string(i), inline_prior(v));
    j.set_lsn(i);
  }
  j.note("a", item_prior(7000));
  j.set_lsn(101);
  j.note("b", item_prior(8000));
  j.set_lsn(102);
  j.note("c", item_prior(9000));
  j.set_lsn(103);
  // b alone: a stays kept in front of it.
  CHECK(j.spill_if(value_of, release, 0, [](std::uint64_t item) { return item == 8000; }) == 2);
  CHECK(released == std::vector<std::uint64_t>{8000});
  // The 100 inline writes made durable: the journal moves the rest to its front.
  const std::size_t before = j.footprint();
  j.forget_until(100, release);
  CHECK(j.footprint() < before);  // (moved)
  CHECK(j.writes() == 3);
  CHECK(j.kept_items() == 2);
  CHECK(j.spill(value_of, release, 0) == 2);  // a, the oldest kept
  CHECK(released == std::vector<std::uint64_t>{8000, 7000});
  CHECK(j.spill(value_of, release) == 2);  // then c
  CHECK(released == std::vector<std::uint64_t>{8000, 7000, 9000});
  CHECK(j.kept_items() == 0);
  // Taken back whole, the spilled values as copies.
  std::vector<std::string> seen;
  CHECK(j.take_back(0, [&](const undo_journal::before& b) { seen.push_back(std::string(b.key) + "=" + S(b.value)); },
                    release) == 3);
  CHECK(seen == std::vector<std::string>{"c=vv", "b=vv", "a=vv"});
  CHECK(released.size() == 3);  // (none released again)
}

TEST_CASE("kv store: a put or del told to keep the old value keeps its arena item until released - inline values "
          "copied",
          "[kv]") {
  store st({.max_memory = 1 << 20, .buckets = 1});  // 8 slots: the overflow table too
  const std::string big(300, 'b');
  prior was;
  REQUIRE(st.put("k", B("small"), false, &was) == put_status::ok);
  CHECK(was.what == prior::kind::absent);
  REQUIRE(st.put("k", B(big), false, &was) == put_status::ok);
  CHECK(was.what == prior::kind::inline_value);
  CHECK(S(was.value()) == "small");
  const std::uint64_t one = st.stats().used_bytes;
  REQUIRE(st.put("k", B("tiny"), false, &was) == put_status::ok);
  REQUIRE(was.what == prior::kind::item);
  CHECK(S(st.item_value(was.item)) == big);
  CHECK(st.stats().used_bytes == one);  // kept
  st.release(was.item);
  CHECK(st.stats().used_bytes == 0);
  // A key in the overflow table, overwritten and deleted.
  for (int i = 0; i < 12; ++i) REQUIRE(st.put("o" + std::to_string(i), B(big)) == put_status::ok);
  REQUIRE(st.stats().overflow_keys > 0);
  std::string over;
  for (int i = 0; i < 12 && over.empty(); ++i) {
    if (read_from(st, "o" + std::to_string(i)).kind == outcome::ask_server) over = "o" + std::to_string(i);
  }
  REQUIRE_FALSE(over.empty());
  const std::uint64_t before = st.stats().used_bytes;
  REQUIRE(st.put(over, B(big + "2"), false, &was) == put_status::ok);
  REQUIRE(was.what == prior::kind::item);
  CHECK(S(st.item_value(was.item)) == big);
  CHECK(st.stats().used_bytes > before);
  st.release(was.item);
  CHECK(st.stats().used_bytes == before);
  REQUIRE(st.del(over, &was));
  REQUIRE(was.what == prior::kind::item);
  CHECK(S(st.item_value(was.item)) == big + "2");
  CHECK(st.stats().used_bytes == before);
  st.release(was.item);
  CHECK(st.stats().used_bytes < before);
  CHECK_FALSE(st.del(over, &was));
}

namespace {

// What a log replays: the last value of each key.
std::map<std::string, std::string> replay_of(const std::string& dir) {
  asio::io_context io;
  std::map<std::string, std::string> replayed;
  durable_log log(io, {.dir = dir, .sync = sync_mode::always},
                  [&](record_type t, std::string_view k, std::span<const std::byte> v) {
                    if (t == record_type::put) {
                      replayed[std::string(k)] = S(v);
                    } else {
                      replayed.erase(std::string(k));
                    }
                  });
  log.close();
  return replayed;
}

// Each key's value by RPC and by a one-sided READ of the table: `expect`
// (nullopt: absent).
void check_reads(service& svc, const store& st,
                 const std::vector<std::pair<std::string, std::optional<std::string>>>& expect) {
  for (const auto& [k, v] : expect) {
    INFO(k);
    const auto got = svc.get(k);
    CHECK(got.has_value() == v.has_value());
    if (got && v) CHECK(S(*got) == *v);
    const outcome o = read_from(st, k);
    CHECK(o.kind == (v ? outcome::found : outcome::absent));
    if (v) CHECK(o.value == *v);
  }
}

}  // namespace

TEST_CASE("kv service: the writes a failed log does not hold are taken back - reads by RPC and by READ, and the "
          "restart, show what the log holds",
          "[kv]") {
  // Redis with appendfsync always exits when its AOF cannot be written;
  // this server goes on serving reads, so the writes that never reached
  // the file must not stay in the store: none was acknowledged, and a
  // restart would not have them. A batch of nine writes meets a file size
  // limit (a full disk) after its third record: those three are in the
  // file (a restart replays them), the rest are taken back. With always
  // the log thread writes the batch, with everysec and no the io thread.
  const std::string big0(500, 'b'), big1(700, 'B'), moved1(400, 'm');
  for (const sync_mode mode : {sync_mode::always, sync_mode::everysec, sync_mode::no}) {
  INFO("sync " << to_string(mode));
  const std::string dir = tmpdir();
  std::string told;
  {
    asio::io_context io;
    stderr_capture capture;
    store st({.max_memory = 1 << 20});
    durable_log log(io, {.dir = dir, .sync = mode}, [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{
             {"small", "s0"}, {"big", big0}, {"gone", "g0"}, {"moved", "m0"}, {"kept", "k0"}}) {
      REQUIRE_FALSE(durable_put(io, svc, log, k, v));
    }
    const store_stats before = st.stats();
    const std::uint64_t fits = (kRecordHeader + 5 + 2) + (kRecordHeader + 3 + big1.size()) + (kRecordHeader + 3 + 2);
    const file_size_limit limit(static_cast<rlim_t>(log.stats().file_bytes + fits + 10));
    std::vector<std::error_code> answers;
    auto wait = [&](std::uint64_t lsn) {
      REQUIRE(lsn != 0);
      log.async_wait(lsn, [&](std::error_code ec) { answers.push_back(ec); });
    };
    std::uint64_t lsn = 0;
    bool existed = false;
    REQUIRE(svc.put("small", B("s1"), lsn).is_ok());  // inline, rewritten in place
    wait(lsn);
    REQUIRE(svc.put("big", B(big1), lsn).is_ok());  // arena to arena
    wait(lsn);
    REQUIRE(svc.put("new", B("n1"), lsn).is_ok());  // a key that was absent
    wait(lsn);
    // The limit falls inside the next record.
    REQUIRE(svc.del("gone", existed, lsn).is_ok());
    REQUIRE(existed);
    wait(lsn);
    REQUIRE(svc.put("small", B("s2"), lsn).is_ok());
    wait(lsn);
    REQUIRE(svc.put("moved", B(moved1), lsn).is_ok());  // inline to arena
    wait(lsn);
    REQUIRE(svc.put("big", B("tiny"), lsn).is_ok());  // arena to inline
    wait(lsn);
    REQUIRE(svc.put("new", B("n2"), lsn).is_ok());
    wait(lsn);
    CHECK(svc.put("kept", B(std::string(5000, 'K')), lsn).is_ok());  // inline to arena, a large item
    wait(lsn);
    CHECK(S(*svc.get("small")) == "s2");  // applied (replies wait for the log)
    run_until_failed(io, log);
    REQUIRE(log.failed());
    CHECK(log.error() == std::errc::file_too_large);
    io.restart();
    io.poll();
    REQUIRE(answers.size() == 9);
    for (const auto& ec : answers) CHECK(ec == std::errc::file_too_large);  // none acknowledged
    CHECK(svc.stats().taken_back == 6);
    check_reads(svc, st, {{"small", "s1"}, {"big", big1}, {"new", "n1"}, {"gone", "g0"}, {"moved", "m0"}, {"kept", "k0"}});
    const store_stats after = st.stats();
    CHECK(after.keys == before.keys + 1);
    CHECK(after.inline_keys == before.inline_keys + 1);
    CHECK(after.live_bytes == before.live_bytes + 3 + 2 + big1.size() - big0.size());
    // Writes stay refused, and change nothing.
    CHECK(svc.put("kept", B("k1"), lsn).code() == rpc::errc::unavailable);
    CHECK(S(*svc.get("kept")) == "k0");
    log.close();
    told = capture.text();
  }
  CHECK_THAT(told, Catch::Contains("anydoor-kv: 6 writes the log did not take were taken back: the store holds what the "
                                   "log holds\n"));
  // A restart finds the same (the record cut at the limit is a torn tail).
  CHECK(replay_of(dir) == std::map<std::string, std::string>{
                              {"small", "s1"}, {"big", big1}, {"new", "n1"}, {"gone", "g0"}, {"moved", "m0"}, {"kept", "k0"}});
  std::filesystem::remove_all(dir);
  }
}

namespace {
std::atomic<bool> g_hold_then_fail{false};
std::atomic<int> g_held_then_failed{0};  // fdatasyncs that found the hold on
// fdatasync(2) that, while g_hold_then_fail is on, waits for it to go off
// and then fails with EIO.
int held_then_failing_fdatasync(int fd) {
  if (!g_hold_then_fail.load()) return ::fdatasync(fd);
  ++g_held_then_failed;
  while (g_hold_then_fail.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  errno = EIO;
  return -1;
}
}  // namespace

TEST_CASE("kv service: a failed fdatasync keeps the writes the file holds and takes back those after them - as the "
          "restart finds them",
          "[kv]") {
  // After a failed fdatasync the written records may or may not be on the
  // disk; a restart reads them back (from the page cache) and rewrites the
  // log with them, so the store keeps them too. Those appended while the
  // fdatasync ran never reached the file: taken back.
  g_hold_then_fail = false;
  g_held_then_failed = 0;
  const std::string dir = tmpdir();
  {
    asio::io_context io;
    stderr_capture capture;
    store st({.max_memory = 1 << 20});
    durable_log log(io, {.dir = dir, .sync = sync_mode::always, .fdatasync_hook = &held_then_failing_fdatasync},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    REQUIRE_FALSE(durable_put(io, svc, log, "a", "a0"));
    REQUIRE_FALSE(durable_put(io, svc, log, "b", "b0"));
    struct release_hold {  // a failed REQUIRE must not leave the log thread in the hook (the close joins it)
      ~release_hold() { g_hold_then_fail = false; }
    } guard;
    g_hold_then_fail = true;
    std::uint64_t lsn = 0;
    int answered = 0;
    REQUIRE(svc.put("a", B("a1"), lsn).is_ok());  // written, its fdatasync held
    log.async_wait(lsn, [&](std::error_code ec) {
      CHECK(ec == std::errc::io_error);
      ++answered;
    });
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (g_held_then_failed.load() == 0 && std::chrono::steady_clock::now() < until) {
      io.restart();
      io.run_for(std::chrono::milliseconds(5));
    }
    REQUIRE(g_held_then_failed.load() == 1);
    REQUIRE(svc.put("b", B("b1"), lsn).is_ok());  // behind it, never written
    log.async_wait(lsn, [&](std::error_code ec) {
      CHECK(ec == std::errc::io_error);
      ++answered;
    });
    REQUIRE(svc.put("c", B("c1"), lsn).is_ok());
    log.async_wait(lsn, [&](std::error_code ec) {
      CHECK(ec == std::errc::io_error);
      ++answered;
    });
    io.restart();
    io.poll();  // (their records handed to the log thread, which is busy)
    g_hold_then_fail = false;
    run_until_failed(io, log);
    REQUIRE(log.failed());
    io.restart();
    io.poll();
    CHECK(answered == 3);
    CHECK(svc.stats().taken_back == 2);
    check_reads(svc, st, {{"a", "a1"}, {"b", "b0"}, {"c", std::nullopt}});
    log.close();
    CHECK_THAT(capture.text(), Catch::Contains("2 writes the log did not take were taken back"));
  }
  g_hold_then_fail = false;
  CHECK(replay_of(dir) == std::map<std::string, std::string>{{"a", "a1"}, {"b", "b0"}});
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv service: a write after the log's close is refused and undone - the store keeps the old value", "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 1 << 20});
  durable_log log(io, {.dir = dir, .sync = sync_mode::everysec},
                  [](record_type, std::string_view, std::span<const std::byte>) {});
  service svc(st, &log);
  REQUIRE_FALSE(durable_put(io, svc, log, "k", "old"));
  log.close();
  std::uint64_t lsn = 1;
  const rpc::status put = svc.put("k", B("new"), lsn);
  CHECK(put.code() == rpc::errc::unavailable);
  CHECK(put.message() == "the log is closed");
  CHECK(lsn == 0);
  CHECK(S(*svc.get("k")) == "old");
  CHECK(svc.put("fresh", B("x"), lsn).code() == rpc::errc::unavailable);
  CHECK_FALSE(svc.get("fresh"));
  bool existed = false;
  CHECK(svc.del("k", existed, lsn).code() == rpc::errc::unavailable);
  CHECK(S(*svc.get("k")) == "old");
  CHECK(st.stats().keys == 1);
  std::filesystem::remove_all(dir);
}

// A service with a log over a full arena (64 KiB): `first` (a key and a
// value) put first where given, then 1000-byte values under k0, k1, ...
// until a put fails for memory; each write durable before the next.
struct full_arena {
  std::string dir = tmpdir();
  asio::io_context io;
  stderr_capture quiet;
  store st{{.max_memory = 64 << 10}};
  durable_log log{io, {.dir = dir, .sync = sync_mode::everysec},
                  [](record_type, std::string_view, std::span<const std::byte>) {}};
  service svc{st, &log};
  int n = 0;  // the keys k0 ... k(n-1) hold old_value(i)

  static std::string key(int i) { return "k" + std::to_string(i); }
  static std::string old_value(int i) { return std::string(1000, static_cast<char>('a' + i % 26)); }
  explicit full_arena(const std::string& first_key = "", const std::string& first_value = "") {
    if (!first_key.empty()) durable_put(first_key, first_value);
    while (n < 200 && durable_put(key(n), old_value(n))) ++n;
    REQUIRE(n > 30);
    REQUIRE(svc.stats().oom == 1);
  }
  ~full_arena() {
    log.close();
    std::filesystem::remove_all(dir);
  }
  full_arena(const full_arena&) = delete;
  full_arena& operator=(const full_arena&) = delete;
  bool durable_put(const std::string& k, const std::string& v) {
    std::uint64_t lsn = 0;
    if (!svc.put(k, B(v), lsn).is_ok()) return false;
    wait_durable(lsn);
    return true;
  }
  void wait_durable(std::uint64_t lsn) { REQUIRE_FALSE(wait_answered(io, log, lsn)); }
  // Deletes in this turn (nothing durable meanwhile: their old items stay
  // in the arena, kept for taking the deletes back).
  void del(const std::string& k) {
    bool existed = false;
    std::uint64_t lsn = 0;
    REQUIRE(svc.del(k, existed, lsn).is_ok());
    REQUIRE(existed);
  }
};

TEST_CASE("kv service: writes on their way to the log never make a put fail for memory - their old values move "
          "out of the arena, and are still taken back",
          "[kv]") {
  // --max-memory bounds the live data: the old items kept for taking
  // writes back must not make a put that fits fail.
  full_arena a;
  int n = a.n;
  // The arena is full: room for one item more, made by a delete (a put
  // needs room for its new item before the old one is free).
  --n;
  {
    bool existed = false;
    std::uint64_t lsn = 0;
    REQUIRE(a.svc.del(a.key(n - 1), existed, lsn).is_ok());
    REQUIRE(existed);
    a.wait_durable(lsn);
    --n;
  }
  for (int i = 0; i < n; ++i) REQUIRE(S(*a.svc.get(a.key(i))) == a.old_value(i));
  // Every key overwritten in one turn (nothing durable meanwhile): fits,
  // as the old values leave the arena.
  const file_size_limit limit(static_cast<rlim_t>(a.log.stats().file_bytes));
  for (int i = 0; i < n; ++i) {
    std::uint64_t lsn = 0;
    INFO("key " << i);
    REQUIRE(a.svc.put(a.key(i), B(std::string(1000, 'N')), lsn).is_ok());
  }
  CHECK(a.svc.stats().oom == 1);  // (the fill's last put alone)
  run_until_failed(a.io, a.log);
  REQUIRE(a.log.failed());
  CHECK(a.svc.stats().taken_back == static_cast<std::uint64_t>(n));
  CHECK(a.svc.stats().restore_failures == 0);
  for (int i = 0; i < n; ++i) CHECK(S(*a.svc.get(a.key(i))) == a.old_value(i));
}

TEST_CASE("kv service: a put over a full arena moves only the old items it needs out of the arena - one whose block "
          "fits it, and every write is still taken back",
          "[kv]") {
  // `big`: a 4000-byte item among the kept 1000-byte ones (deleted in the
  // middle), a put of 3000 bytes: only the big block can take it.
  const bool big = GENERATE(false, true);
  INFO((big ? "a 3000-byte put, one 4000-byte item kept among 1000-byte ones" : "a 900-byte put"));
  full_arena a(big ? "big" : "", big ? std::string(4000, 'B') : "");
  // The file takes no more: the turn's write will fail.
  const file_size_limit limit(static_cast<rlim_t>(a.log.stats().file_bytes));
  constexpr int kDeleted = 20;
  for (int i = 0; i < kDeleted; ++i) {
    a.del(a.key(i));
    if (big && i == kDeleted / 2) a.del("big");
  }
  std::uint64_t lsn = 0;
  REQUIRE(a.svc.put("new", B(std::string(big ? 3000 : 900, 'N')), lsn).is_ok());
  INFO("spilled " << a.svc.stats().spilled << " items, " << a.svc.stats().spilled_bytes << " bytes");
  // One moved (all twenty kept did before; oldest first, eleven would
  // have moved before the big one)
  CHECK(a.svc.stats().spilled == 1);
  CHECK(a.svc.stats().spilled_bytes == (big ? 4000u : 1000u));
  CHECK(a.svc.stats().oom == 1);
  // The log fails before any of the turn's records reach the file: every
  // write is taken back, from a spilled value or a kept item alike.
  run_until_failed(a.io, a.log);
  REQUIRE(a.log.failed());
  CHECK(a.svc.stats().taken_back == static_cast<std::uint64_t>(kDeleted + (big ? 2 : 1)));
  CHECK(a.svc.stats().restore_failures == 0);
  for (int i = 0; i < a.n; ++i) CHECK(S(*a.svc.get(a.key(i))) == a.old_value(i));
  if (big) CHECK(S(*a.svc.get("big")) == std::string(4000, 'B'));
  CHECK(!a.svc.get("new").has_value());
}

TEST_CASE("kv service: where no kept block can take a put and the memory limit is not short, none moves - the put "
          "fails for memory as it would have, and nothing is lost",
          "[kv]") {
  // A kept 1000-byte block, with the free ones beside it (none here: the
  // arena is full), cannot take a 3000-byte item, and copying kept items
  // out in the hope that neighbours merge is not tried.
  const std::string big(4000, 'B');
  full_arena a("big", big);
  const file_size_limit limit(static_cast<rlim_t>(a.log.stats().file_bytes));
  constexpr int kDeleted = 20;
  for (int i = 0; i < kDeleted; ++i) a.del(a.key(i));
  for (int attempt = 0; attempt < 2; ++attempt) {  // (the second finds the first's scan remembered)
    std::uint64_t lsn = 0;
    const rpc::status st = a.svc.put("new", B(std::string(3000, 'N')), lsn);
    CHECK(st.code() == rpc::errc::resource_exhausted);
  }
  CHECK(a.svc.stats().oom == 3);
  CHECK(a.svc.stats().spilled == 0);
  // A block that can take it, kept anew (the delete of the 4000-byte
  // item): the next put looks again and finds it.
  a.del("big");
  std::uint64_t lsn = 0;
  CHECK(a.svc.put("new", B(std::string(3000, 'N')), lsn).is_ok());
  CHECK(a.svc.stats().spilled == 1);
  CHECK(a.svc.stats().spilled_bytes == 4000);
  run_until_failed(a.io, a.log);
  REQUIRE(a.log.failed());
  CHECK(a.svc.stats().taken_back == static_cast<std::uint64_t>(kDeleted + 2));
  CHECK(a.svc.stats().restore_failures == 0);
  for (int i = 0; i < a.n; ++i) CHECK(S(*a.svc.get(a.key(i))) == a.old_value(i));
  CHECK(S(*a.svc.get("big")) == big);
  CHECK(!a.svc.get("new").has_value());
}

TEST_CASE("kv service: over --max-memory after a restart (items in the arena's slack), a put moves kept items oldest "
          "first in doubling rounds until the limit lets it in - not all of them",
          "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;
  stderr_capture quiet;
  store st({.max_memory = 64 << 10});
  // As a replay may place them: 1000-byte items up to 72 KiB in use, past
  // the 64 KiB limit (the arena keeps a quarter more for replays).
  int n = 0;
  while (st.stats().used_bytes < (72u << 10)) {
    REQUIRE(st.put(full_arena::key(n), B(full_arena::old_value(n)), /*replay=*/true) == put_status::ok);
    ++n;
  }
  durable_log log(io, {.dir = dir, .sync = sync_mode::everysec},
                  [](record_type, std::string_view, std::span<const std::byte>) {});
  service svc(st, &log);
  const file_size_limit limit(static_cast<rlim_t>(log.stats().file_bytes));
  constexpr int kDeleted = 20;
  for (int i = 0; i < kDeleted; ++i) {
    bool existed = false;
    std::uint64_t lsn = 0;
    REQUIRE(svc.del(full_arena::key(i), existed, lsn).is_ok());
  }
  std::uint64_t lsn = 0;
  REQUIRE(svc.put("new", B(std::string(1000, 'N')), lsn).is_ok());
  INFO("spilled " << svc.stats().spilled << " of " << kDeleted << " kept items; " << n << " items, "
                  << st.stats().used_bytes << " bytes in use");
  // More than the one whose block fits (the limit was short), not all.
  CHECK(svc.stats().spilled > 1);
  CHECK(svc.stats().spilled < static_cast<std::uint64_t>(kDeleted));
  CHECK(st.stats().used_bytes <= (64u << 10));
  run_until_failed(io, log);
  REQUIRE(log.failed());
  CHECK(svc.stats().taken_back == static_cast<std::uint64_t>(kDeleted + 1));
  CHECK(svc.stats().restore_failures == 0);
  for (int i = 0; i < n; ++i) CHECK(S(*svc.get(full_arena::key(i))) == full_arena::old_value(i));
  CHECK(!svc.get("new").has_value());
  log.close();
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv service: any batch a full disk refuses is taken back whole - the store as it was, overflow keys and "
          "memory included",
          "[kv]") {
  // Random writes (inline and arena values, deletes, keys in the overflow
  // table) on a durable base; the next batch finds the file size limit at
  // the end of the log, so nothing of it reaches the file.
  for (unsigned seed = 1; seed <= 6; ++seed) {
    INFO("seed " << seed);
    std::mt19937 rng(seed);
    const std::string dir = tmpdir();
    asio::io_context io;
    stderr_capture quiet;
    store st({.max_memory = 1 << 20, .buckets = 1});  // 8 slots: most keys overflow
    durable_log log(io, {.dir = dir, .sync = seed % 2 == 0 ? sync_mode::always : sync_mode::everysec},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    auto value = [&](int n) {
      const std::size_t len = rng() % 3 == 0 ? 4 : 20 + rng() % 400;
      return std::string(len, static_cast<char>('a' + n % 26)) + std::to_string(n);
    };
    std::map<std::string, std::string> base;
    for (int i = 0; i < 30; ++i) {
      const std::string k = "key" + std::to_string(rng() % 20), v = value(i);
      REQUIRE_FALSE(durable_put(io, svc, log, k, v));
      base[k] = v;
    }
    const store_stats was = st.stats();
    REQUIRE(was.overflow_keys > 0);
    const file_size_limit limit(static_cast<rlim_t>(log.stats().file_bytes));
    int writes = 0;
    for (int i = 0; i < 60; ++i) {
      const std::string k = "key" + std::to_string(rng() % 24);
      std::uint64_t lsn = 0;
      if (rng() % 4 == 0) {
        bool existed = false;
        REQUIRE(svc.del(k, existed, lsn).is_ok());
        writes += existed ? 1 : 0;
      } else {
        REQUIRE(svc.put(k, B(value(100 + i)), lsn).is_ok());
        ++writes;
      }
    }
    run_until_failed(io, log);
    REQUIRE(log.failed());
    CHECK(svc.stats().taken_back == static_cast<std::uint64_t>(writes));
    CHECK(svc.stats().restore_failures == 0);
    std::map<std::string, std::string> now;
    st.for_each([&](std::string_view k, std::span<const std::byte> v) { now[std::string(k)] = S(v); });
    CHECK(now == base);
    for (const auto& [k, v] : base) {
      const outcome o = read_from(st, k);
      CHECK((o.kind == outcome::ask_server || (o.kind == outcome::found && o.value == v)));
    }
    // (A key may come back to another place: a slot, the overflow table.)
    const store_stats after = st.stats();
    CHECK(after.keys == was.keys);
    CHECK(after.live_bytes == was.live_bytes);
    // No item is left kept: with every key deleted, the arena is empty.
    for (const auto& [k, v] : base) REQUIRE(st.del(k));
    CHECK(st.stats().keys == 0);
    CHECK(st.stats().used_bytes == 0);
    log.close();
    std::filesystem::remove_all(dir);
  }
}

namespace {

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

ino_t inode_of(const std::string& path) {
  struct stat st{};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_ino;
}

// A log whose every fdatasync fails after `good` records were put and
// acknowledged (everysec): failed, closed, the marker left.
void fail_a_log(const std::string& dir, int good) {
  g_syncs = 0;
  g_failed_syncs = 0;
  // (An existing log's fdatasync at start passes: what follows fails.)
  const std::string path = dir + "/kv.log";
  g_fail_at = std::filesystem::exists(path) ? static_cast<long long>(std::filesystem::file_size(path)) + 1 : 0;
  asio::io_context io;
  stderr_capture capture;
  store st({.max_memory = 1 << 20});
  durable_log log(io, {.dir = dir, .sync = sync_mode::everysec, .fdatasync_hook = &failing_fdatasync},
                  [](record_type, std::string_view, std::span<const std::byte>) {});
  service svc(st, &log);
  for (int i = 0; i < good; ++i) REQUIRE_FALSE(durable_put(io, svc, log, "k" + std::to_string(i), "v" + std::to_string(i)));
  wait_for_log_error(io, log);
  REQUIRE(log.error() == std::errc::io_error);
  log.close();
}

}  // namespace

TEST_CASE("kv log: a failed fdatasync leaves kv.log.sync-failed - the next start rewrites the log into a new file and "
          "removes it",
          "[kv]") {
  const std::string dir = tmpdir();
  const std::string marker = dir + "/kv.log.sync-failed";
  fail_a_log(dir, 50);
  REQUIRE(std::filesystem::exists(marker));
  CHECK_THAT(file_text(marker), Catch::StartsWith("the fdatasync of kv.log failed: Input/output error (") &&
                                    Catch::EndsWith(" UTC)\n"));
  const ino_t before = inode_of(dir + "/kv.log");
  asio::io_context io;
  std::map<std::string, std::string> seen;
  auto keep = [&](record_type, std::string_view k, std::span<const std::byte> v) {
    seen[std::string(k)] = std::string(reinterpret_cast<const char*>(v.data()), v.size());
  };
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec}, keep);
    CHECK(seen.size() == 50);
    CHECK(seen["k49"] == "v49");
    CHECK(log.replayed().rewritten);
    CHECK_THAT(log.replayed().sync_failed_before,
               Catch::StartsWith("the fdatasync of kv.log failed: Input/output error (") && !Catch::Contains("\n"));
    CHECK_FALSE(std::filesystem::exists(marker));
    CHECK(inode_of(dir + "/kv.log") != before);  // a new file: its pages written and fsynced afresh
    CHECK(log.stats().synced_bytes == std::filesystem::file_size(dir + "/kv.log"));
    store st({.max_memory = 1 << 20});
    service svc(st, &log);
    CHECK_FALSE(durable_put(io, svc, log, "after", "x"));
    log.close();
  }
  // Once: the next start finds no marker and rewrites nothing.
  seen.clear();
  const ino_t rewritten = inode_of(dir + "/kv.log");
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec}, keep);
    CHECK(seen.size() == 51);
    CHECK(seen["after"] == "x");
    CHECK_FALSE(log.replayed().rewritten);
    CHECK(log.replayed().sync_failed_before.empty());
    CHECK(inode_of(dir + "/kv.log") == rewritten);
    log.close();
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a marked log that cannot be rewritten refuses the start - the marker stays until it is", "[kv]") {
  const std::string dir = tmpdir();
  const std::string marker = dir + "/kv.log.sync-failed";
  fail_a_log(dir, 10);
  REQUIRE(std::filesystem::exists(marker));
  std::filesystem::create_directory(dir + "/kv.log.compact");  // the rewrite's open() fails: EISDIR
  asio::io_context io;
  int replayed = 0;
  auto count = [&](record_type, std::string_view, std::span<const std::byte>) { ++replayed; };
  CHECK_THROWS_WITH(durable_log(io, {.dir = dir, .sync = sync_mode::always}, count),
                    Catch::Contains("the last run could not make " + dir + "/kv.log durable (the fdatasync of kv.log "
                                    "failed: Input/output error") &&
                        Catch::Contains("cannot create " + dir + "/kv.log.compact: Is a directory; refusing to start") &&
                        Catch::Contains("removing " + marker + " starts on the log as it is"));
  CHECK(std::filesystem::exists(marker));
  std::filesystem::remove(dir + "/kv.log.compact");
  replayed = 0;
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::always}, count);  // (the LOCK was let go)
    CHECK(replayed == 10);
    CHECK(log.replayed().rewritten);
    CHECK_FALSE(std::filesystem::exists(marker));
    log.close();
  }
  // Removing the marker by hand starts on the log as it is.
  fail_a_log(dir, 3);
  std::filesystem::remove(marker);
  const ino_t before = inode_of(dir + "/kv.log");
  replayed = 0;
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::always}, count);
    CHECK(replayed == 10 + 3);
    CHECK_FALSE(log.replayed().rewritten);
    CHECK(inode_of(dir + "/kv.log") == before);
    log.close();
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a failed fdatasync at start refuses it and leaves the marker - the next start rewrites the log",
          "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;
  {
    store st({.max_memory = 1 << 20});
    durable_log log(io, {.dir = dir, .sync = sync_mode::always}, [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    for (int i = 0; i < 5; ++i) REQUIRE_FALSE(durable_put(io, svc, log, "k" + std::to_string(i), "v"));
    log.close();
  }
  const std::string marker = dir + "/kv.log.sync-failed";
  g_syncs = 0;
  g_fail_at = 0;  // the start's fdatasync of the existing log fails
  int replayed = 0;
  auto count = [&](record_type, std::string_view, std::span<const std::byte>) { ++replayed; };
  CHECK_THROWS_WITH(durable_log(io, {.dir = dir, .sync = sync_mode::always, .fdatasync_hook = &failing_fdatasync}, count),
                    Catch::Contains("fdatasync " + dir + "/kv.log: Input/output error (" + marker +
                                    " makes the next start rewrite it)"));
  CHECK(g_syncs == 1);
  REQUIRE(std::filesystem::exists(marker));
  CHECK_THAT(file_text(marker), Catch::StartsWith("the fdatasync of kv.log at start failed: Input/output error ("));
  // A second failure appends: the first line, the first cause, stays.
  const std::string first = file_text(marker);
  CHECK_THROWS(durable_log(io, {.dir = dir, .sync = sync_mode::always, .fdatasync_hook = &failing_fdatasync}, count));
  const std::string both = file_text(marker);
  CHECK(both.size() > first.size());
  CHECK(both.compare(0, first.size(), first) == 0);
  CHECK(std::count(both.begin(), both.end(), '\n') == 2);
  const ino_t before = inode_of(dir + "/kv.log");
  replayed = 0;
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::always}, count);
    CHECK(replayed == 5);
    CHECK(log.replayed().rewritten);
    CHECK_THAT(log.replayed().sync_failed_before, Catch::StartsWith("the fdatasync of kv.log at start failed"));
    CHECK(inode_of(dir + "/kv.log") != before);
    CHECK_FALSE(std::filesystem::exists(marker));
    log.close();
  }
  // A marker beside an empty data dir: nothing to rewrite, removed.
  const std::string empty = tmpdir();
  std::ofstream(empty + "/kv.log.sync-failed") << "the fdatasync of kv.log failed: staged\n";
  {
    durable_log log(io, {.dir = empty, .sync = sync_mode::always}, count);
    CHECK_FALSE(log.replayed().rewritten);
    CHECK(log.replayed().sync_failed_before == "the fdatasync of kv.log failed: staged");
    CHECK_FALSE(std::filesystem::exists(empty + "/kv.log.sync-failed"));
    log.close();
  }
  std::filesystem::remove_all(empty);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a marker that cannot be left is told on stderr", "[kv]") {
  const std::string dir = tmpdir();
  std::filesystem::create_directories(dir + "/kv.log.sync-failed/x");  // open(O_WRONLY) fails: EISDIR
  std::string told;
  {
    stderr_capture capture;
    asio::io_context io;
    // (A marker that is not a regular file refuses the start: a directory,
    // a symbolic link.)
    CHECK_THROWS_WITH(durable_log(io, {.dir = dir, .sync = sync_mode::everysec},
                                  [](record_type, std::string_view, std::span<const std::byte>) {}),
                      Catch::Contains(dir + "/kv.log.sync-failed is not a regular file; refusing to start (remove it)"));
    std::filesystem::remove_all(dir + "/kv.log.sync-failed");
    std::ofstream(dir + "/elsewhere") << "x\n";
    std::filesystem::create_symlink(dir + "/elsewhere", dir + "/kv.log.sync-failed");
    CHECK_THROWS_WITH(durable_log(io, {.dir = dir, .sync = sync_mode::everysec},
                                  [](record_type, std::string_view, std::span<const std::byte>) {}),
                      Catch::Contains(dir + "/kv.log.sync-failed is not a regular file; refusing to start (remove it)"));
    std::filesystem::remove(dir + "/kv.log.sync-failed");
    std::filesystem::create_directories(dir + "/kv.log.sync-failed/x");
    told = capture.text();
  }
  std::filesystem::remove_all(dir + "/kv.log.sync-failed");
  std::filesystem::remove(dir + "/kv.log");
  {
    stderr_capture capture;
    // Made a directory once the log is open: the marker cannot be created.
    g_syncs = 0;
    g_fail_at = 0;
    asio::io_context io;
    store st({.max_memory = 1 << 20});
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec, .fdatasync_hook = &failing_fdatasync},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    std::filesystem::create_directories(dir + "/kv.log.sync-failed/x");
    service svc(st, &log);
    CHECK_FALSE(durable_put(io, svc, log, "a", "1"));
    wait_for_log_error(io, log);
    REQUIRE(log.error() == std::errc::io_error);
    log.close();
    told = capture.text();
  }
  CHECK_THAT(told, Catch::Contains("anydoor-kv: cannot leave " + dir + "/kv.log.sync-failed (Is a directory): the next "
                                   "start will not rewrite the log unless the file is created"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: the last fdatasync after a failed write fails too - stderr says so, nothing is tried after", "[kv]") {
  constexpr rlim_t kLimit = 64 << 10;
  g_syncs = 0;
  g_failed_syncs = 0;
  g_fail_at = static_cast<long long>(kLimit);  // fdatasync fails once a write has hit the limit
  const std::string dir = tmpdir();
  asio::io_context io;
  std::string told;
  {
    stderr_capture capture;
    store st({.max_memory = 4 << 20});
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec, .fdatasync_hook = &failing_fdatasync},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    {
      const file_size_limit limit(kLimit);
      std::error_code ec;
      for (int i = 0; i < 200 && !ec; ++i) ec = durable_put(io, svc, log, "k" + std::to_string(i), std::string(1000, 'v'));
      REQUIRE(ec == std::errc::file_too_large);
    }
    // The thread's last fdatasync fails (close() joins the thread).
    io.restart();
    io.poll();
    log.close();
    CHECK(g_failed_syncs == 1);
    CHECK(log.error_text() == "the log cannot be written: File too large");  // (the first cause stays)
    told = capture.text();
  }
  // Told once, either way: the failure's line says what may not be on the
  // disk (the fdatasync failed before it was printed), or it promised the
  // fdatasync and a second line says it failed.
  const bool promised = occurrences(told, "and one more fdatasync is made to put it on the disk") == 1;
  const bool caveat = occurrences(told, "but what was acknowledged since the last fsync may not be on the disk") == 1;
  const bool second = occurrences(told, "kv.log cannot be made durable either: fdatasync: Input/output error; writes "
                                        "acknowledged since the last fsync may not be on the disk") == 1;
  INFO(told);
  CHECK(occurrences(told, "writes are refused from now on") == 1);
  CHECK(((promised && second && !caveat) || (caveat && !promised && !second)));
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a failure of the last writes - at the close, with no io_context to run - is told on stderr", "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;  // never run: the records stay pending until the close writes them
  stderr_capture err;
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::no},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    const file_size_limit limit(8 << 10);
    for (int i = 0; i < 20; ++i) {
      CHECK(log.append(record_type::put, "k" + std::to_string(i), B(std::string(1000, 'v'))) != 0);
    }
    log.close();
    CHECK(log.error() == std::errc::file_too_large);
  }
  const std::string text = err.text();
  CHECK_THAT(text, Catch::Contains("cannot be written: File too large; writes are refused from now on"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a compaction that fails keeps the old log, loses nothing, and is retried later", "[kv]") {
  const std::string dir = tmpdir();
  const log_stats s = write_compact_replay(dir, true);
  CHECK(s.compactions == 0);
  CHECK(s.compaction_failures == 1);
  CHECK(std::filesystem::file_size(dir + "/kv.log") > 300 * 200);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a write is answered only once the file holds it - in every sync mode (kill -9 loses nothing answered)",
          "[kv]") {
  for (const sync_mode mode : {sync_mode::always, sync_mode::everysec, sync_mode::no}) {
    INFO("sync " << to_string(mode));
    const std::string dir = tmpdir();
    asio::io_context io;
    store st({.max_memory = 1 << 20});
    {
      durable_log log(io, {.dir = dir, .sync = mode},
                      [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
      service svc(st, &log);
      int answered = 0, short_file = 0;
      for (int i = 0; i < 100; ++i) {
        std::uint64_t lsn = 0;
        REQUIRE(svc.put("key" + std::to_string(i), B("value-" + std::to_string(i)), lsn).is_ok());
        REQUIRE(lsn != 0);
        CHECK(svc.must_wait(lsn));  // the service waits in every mode
        log.async_wait(lsn, [&, lsn](std::error_code ec) {
          CHECK_FALSE(ec);
          // The log's sequence numbers count record bytes after the file
          // header; the file holds them as good records (not just its size:
          // with always it is reserved ahead).
          if (logged_end(dir + "/kv.log") < kLogHeader + lsn) ++short_file;
          ++answered;
        });
        io.restart();
        io.run();
      }
      CHECK(answered == 100);
      CHECK(short_file == 0);
      const std::uint64_t fsyncs = log.stats().fsyncs;
      if (mode == sync_mode::always) CHECK(fsyncs == 100);
      if (mode == sync_mode::everysec) CHECK(fsyncs <= 5);  // about once a second, not once per write
      if (mode == sync_mode::no) CHECK(fsyncs == 0);
      log.close();
    }
    std::filesystem::remove_all(dir);
  }
}


TEST_CASE("kv log: with everysec the io thread's writes wake the log thread once per fsync, not once per write", "[kv]") {
  // The log thread fsyncs about once a second. It used to consume the io
  // thread's "written, not synced" flag at each wake-up, so every write
  // after one woke it again (a futex and a thread switch per PUT).
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 1 << 20});
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    service svc(st, &log);
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t rounds = log.stats().thread_rounds;
    int answered = 0;
    for (int i = 0; i < 200; ++i) {
      std::uint64_t lsn = 0;
      REQUIRE(svc.put("key" + std::to_string(i), B("value-" + std::to_string(i)), lsn).is_ok());
      log.async_wait(lsn, [&](std::error_code ec) {
        CHECK_FALSE(ec);
        ++answered;
      });
      io.restart();
      io.run();
      std::this_thread::sleep_for(std::chrono::microseconds(500));  // (time for the thread to wake, were it woken)
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(answered == 200);
    const std::uint64_t woke = log.stats().thread_rounds - rounds;
    INFO("200 writes in " << std::chrono::duration<double>(took).count() << " s: " << woke << " log thread rounds, "
                          << log.stats().fsyncs << " fsyncs");
    // One round for the first write and one per fsync since (about one a
    // second: at most one per started second), plus one spare.
    const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(took).count();
    CHECK(woke <= static_cast<std::uint64_t>(2 * (seconds + 1) + 1));
    // And the thread still makes them durable about a second later, while
    // the log runs (not only at the close).
    const auto synced_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (log.stats().synced_bytes < log.stats().file_bytes && std::chrono::steady_clock::now() < synced_by) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    CHECK(log.stats().synced_bytes == log.stats().file_bytes);
    log.close();
    // Everything written was made durable at the close.
    CHECK(log.stats().synced_bytes == log.stats().file_bytes);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a write the file cannot take fails the log - nothing after it is acknowledged, reads go on, replay "
          "keeps every acknowledged write",
          "[kv]") {
  constexpr rlim_t kLimit = 64 << 10;
  auto key = [](int i) { return "full" + std::to_string(i); };
  auto value = [](int i) { return std::string(1000, static_cast<char>('a' + i % 26)); };
  for (const sync_mode mode : {sync_mode::always, sync_mode::everysec, sync_mode::no}) {
    INFO("sync " << to_string(mode));
    const std::string dir = tmpdir();
    asio::io_context io;
    int acked = 0;
    std::uint64_t acked_bytes = 0;
    std::error_code failure;
    std::string text_at_failure;
    {
      store st({.max_memory = 4 << 20});
      durable_log log(io, {.dir = dir, .sync = mode},
                      [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
      service svc(st, &log);
      const file_size_limit limit(kLimit);
      for (int i = 0; i < 200 && !failure; ++i) {
        std::uint64_t lsn = 0;
        const std::string k = key(i), v = value(i);
        const rpc::status put = svc.put(k, B(v), lsn);
        REQUIRE(put.is_ok());  // (refused only once the failure is known)
        log.async_wait(lsn, [&, n = kRecordHeader + k.size() + v.size()](std::error_code ec) {
          if (ec) {
            failure = ec;
            text_at_failure = log.error_text();  // what the writer is answered with
          } else {
            ++acked;
            acked_bytes += n;
          }
        });
        io.restart();
        io.run();
      }
      REQUIRE(failure == std::errc::file_too_large);
      CHECK(acked > 50);
      // The write the file took in part is taken back: no read shows it.
      CHECK(svc.stats().taken_back == 1);
      CHECK_FALSE(svc.get(key(acked)));
      CHECK(svc.get(key(acked - 1)));
      CHECK(log.error() == failure);
      CHECK(text_at_failure == "the log cannot be written: File too large");  // (the data dir's path kept from clients)
      CHECK(log.error_text() == text_at_failure);
      // Every later write is refused before the store is touched.
      std::uint64_t lsn = 0;
      const rpc::status after = svc.put("after", B("x"), lsn);
      CHECK(after.code() == rpc::errc::unavailable);
      CHECK(after.message() == log.error_text());
      CHECK(lsn == 0);
      CHECK_FALSE(svc.get("after"));
      bool existed = true;
      CHECK(svc.del(key(0), existed, lsn).code() == rpc::errc::unavailable);
      // A waiter that comes later learns of the failure too.
      std::error_code late;
      log.async_wait(std::uint64_t{1} << 40, [&](std::error_code ec) { late = ec; });
      io.restart();
      io.run();
      CHECK(late == failure);
      // What was written before the failure is made durable once more: with
      // everysec it was acknowledged after the write alone, and no later
      // fsync would come. With no the OS decides.
      const std::uint64_t written = kLogHeader + acked_bytes;
      if (mode == sync_mode::no) {
        CHECK(log.stats().synced_bytes == kLogHeader);  // (the new file's header)
      } else {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (log.stats().synced_bytes != written && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        CHECK(log.stats().synced_bytes == written);
      }
      // Reads go on.
      const auto v0 = svc.get(key(0));
      REQUIRE(v0);
      CHECK(S(*v0) == value(0));
      log.close();
    }
    // Without the limit: every acknowledged write is back, the record cut at
    // the limit is a torn tail, and the log takes writes again.
    store st({.max_memory = 4 << 20});
    int replayed = 0;
    bool in_order = true;
    durable_log log(io, {.dir = dir, .sync = mode}, [&](record_type t, std::string_view k, std::span<const std::byte> v) {
      if (t != record_type::put || k != key(replayed) || S(v) != value(replayed)) in_order = false;
      ++replayed;
    });
    CHECK(replayed == acked);
    CHECK(in_order);
    CHECK(log.replayed().bytes == kLogHeader + acked_bytes);
    CHECK(log.replayed().torn_bytes == kLimit - kLogHeader - acked_bytes);  // what fit of the refused record
    CHECK(log.replayed().torn_bytes > 0);
    service svc(st, &log);
    CHECK_FALSE(durable_put(io, svc, log, "after", "restart"));
    log.close();
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("kv log: sync always reserves the file ahead - a clean stop cuts the reserve, a crash leaves zeros replay skips",
          "[kv]") {
  const std::string dir = tmpdir(), crash = tmpdir();
  {
    // Where the file system cannot reserve (fallocate), appends are plain.
    const int fd = ::open((dir + "/probe").c_str(), O_RDWR | O_CREAT, 0644);
    REQUIRE(fd >= 0);
    const bool can = ::fallocate(fd, 0, 0, 4096) == 0;
    ::close(fd);
    std::filesystem::remove(dir + "/probe");
    if (!can) {
      WARN("skipped: the file system under " << dir << " has no fallocate (" << std::strerror(errno) << ")");
      return;
    }
  }
  asio::io_context io;
  store st({.max_memory = 1 << 20});
  std::uint64_t last = 0;
  auto put_and_wait = [&](durable_log& log, service& svc, const std::string& key) {
    std::uint64_t lsn = 0;
    REQUIRE(svc.put(key, B("value of " + key), lsn).is_ok());
    bool done = false;
    log.async_wait(lsn, [&](std::error_code ec) {
      CHECK_FALSE(ec);
      done = true;
    });
    io.restart();
    io.run();
    REQUIRE(done);
    last = lsn;
  };
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::always},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    service svc(st, &log);
    for (int i = 0; i < 50; ++i) put_and_wait(log, svc, "k" + std::to_string(i));
    // Reserved ahead: 4 MiB past the first write.
    CHECK(std::filesystem::file_size(dir + "/kv.log") >= (std::uint64_t{4} << 20));
    CHECK(logged_end(dir + "/kv.log") == kLogHeader + last);
    // What a crash now would leave: the records, then zeros.
    std::filesystem::copy_file(dir + "/kv.log", crash + "/kv.log");
    log.close();
    CHECK(std::filesystem::file_size(dir + "/kv.log") == kLogHeader + last);  // the reserve cut off
  }
  // After the crash: the zeros are skipped, not cut off as a torn tail, and
  // writes continue where the records end.
  std::size_t replayed = 0;
  {
    store back({.max_memory = 1 << 20});
    durable_log log(io, {.dir = crash, .sync = sync_mode::always},
                    [&](record_type t, std::string_view k, std::span<const std::byte> v) {
                      CHECK(t == record_type::put);
                      back.put(k, v, true);
                      ++replayed;
                    });
    CHECK(log.replayed().torn_bytes == 0);
    CHECK(log.replayed().bytes == kLogHeader + last);
    service svc(back, &log);
    put_and_wait(log, svc, "after-crash");
    log.close();
  }
  CHECK(replayed == 50);
  for (const auto& e : std::filesystem::directory_iterator(crash)) {
    CHECK(e.path().filename().string().rfind("kv.log.torn", 0) == std::string::npos);
  }
  std::size_t records = 0;
  const log_parse p = parse_log(file_bytes(crash + "/kv.log"), [&](record_type, std::string_view k, std::span<const std::byte>) {
    ++records;
    (void)k;
  });
  CHECK(p.result == log_parse::outcome::ok);
  CHECK(records == 51);
  CHECK(p.zero_tail == 0);  // cut at the clean stop
  CHECK(std::filesystem::file_size(crash + "/kv.log") == p.valid_end);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(crash);
}

namespace {
// Puts `key` and runs the io context until the write is answered.
void put_answered(asio::io_context& io, durable_log& log, service& svc, const std::string& key, const std::string& value) {
  std::uint64_t lsn = 0;
  REQUIRE(svc.put(key, B(value), lsn).is_ok());
  bool done = false;
  log.async_wait(lsn, [&](std::error_code ec) {
    CHECK_FALSE(ec);
    done = true;
  });
  while (!done) {
    if (io.run_one() == 0) io.restart();
  }
}
// 1500 keys of 16 KiB, written over until the log passes twice the live
// data (24 MiB): a compaction of a 24 MiB snapshot starts.
void fill_until_compacting(asio::io_context& io, durable_log& log, service& svc) {
  for (int n = 0; n < 3 * 1500 && !log.compacting(); ++n) {
    put_answered(io, log, svc, "big" + std::to_string(n % 1500), std::string(16 << 10, static_cast<char>('a' + n / 1500)));
  }
  REQUIRE(log.stats().compactions == 0);
}
}  // namespace

TEST_CASE("kv log: a compaction that starts before the records it covers are written copies from where they end",
          "[kv]") {
  // everysec: the io thread writes the records at the end of its turn; the
  // turn is held back here while the compaction's thread writes the
  // snapshot and comes to copy what followed it. It waits for them (copying
  // from an offset not yet written would put records in twice and its
  // offsets out of step: the next compaction would copy from mid-record).
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 4 << 20});
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec, .compact_min = 16 << 10},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    service svc(st, &log);
    int acked = 0, started_at = -1;
    for (int i = 0; i < 300; ++i) {
      std::uint64_t lsn = 0;
      REQUIRE(svc.put("key" + std::to_string(i % 10), B(std::to_string(i) + std::string(200, 'x')), lsn).is_ok());
      if (log.compacting() && started_at < 0) started_at = i;
      log.async_wait(lsn, [&](std::error_code ec) {
        CHECK_FALSE(ec);
        ++acked;
      });
    }
    REQUIRE(started_at >= 0);
    // The snapshot is written and fsynced meanwhile (with the io context
    // idle, the only fsync under everysec is the snapshot's); the compactor
    // then comes to copy what followed it, not written yet.
    for (int i = 0; i < 1000 && log.stats().fsyncs == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    CHECK(log.stats().fsyncs >= 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    io.run();
    CHECK(acked == 300);
    CHECK(log.stats().compactions >= 1);
    CHECK(log.stats().compaction_failures == 0);
    log.close();
    CHECK(std::filesystem::file_size(dir + "/kv.log") == log.stats().file_bytes);
  }
  expect_replay_equals(io, dir, sync_mode::everysec, st);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: writes are answered while a compaction runs - only the swap of the files holds them", "[kv]") {
  for (const sync_mode mode : {sync_mode::everysec, sync_mode::no}) {
    INFO("sync " << to_string(mode));
    const std::string dir = tmpdir();
    asio::io_context io;
    store st({.max_memory = 64 << 20});
    {
      durable_log log(io, {.dir = dir, .sync = mode, .compact_min = 1 << 20},
                      [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
      service svc(st, &log);
      fill_until_compacting(io, log, svc);
      REQUIRE(log.compacting());
      // Writes go on to the old log while the snapshot is written and
      // fsynced, answered as they come; only the swap of the files (the
      // last records copied, an fsync, the rename) holds them. Before,
      // every write waited for the whole compaction.
      using clock = std::chrono::steady_clock;
      const auto began = clock::now();
      clock::duration longest{};
      int during = 0;
      for (int n = 0; log.compacting() && n < 1000000; ++n) {
        const auto t0 = clock::now();
        put_answered(io, log, svc, "small" + std::to_string(n % 500), "v" + std::to_string(n));
        longest = std::max(longest, clock::now() - t0);
        if (log.compacting()) ++during;
      }
      const auto took = clock::now() - began;
      using ms = std::chrono::duration<double, std::milli>;
      INFO("the compaction took " << ms(took).count() << " ms; " << during << " writes answered meanwhile, the slowest in "
                                  << ms(longest).count() << " ms");
      CHECK(during > 10);
      CHECK(longest < took / 2);
      while (log.compacting()) {
        if (io.run_one() == 0) io.restart();
      }
      CHECK(log.stats().compactions == 1);
      CHECK(log.stats().compaction_failures == 0);
      // And after it, into the new log.
      put_answered(io, log, svc, "after", "compaction");
      log.close();
      CHECK(std::filesystem::file_size(dir + "/kv.log") == log.stats().file_bytes);
      CHECK(std::filesystem::file_size(dir + "/kv.log") < (std::uint64_t{32} << 20));  // was 48 MiB and more
      CHECK_FALSE(std::filesystem::exists(dir + "/kv.log.compact"));
    }
    expect_replay_equals(io, dir, mode, st, 64 << 20);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("kv log: a key written while the snapshot was taken is in the new log before it replaces the old one - a "
          "crash right after the swap loses nothing",
          "[kv]") {
  // The snapshot leaves out a key written after it began: that write's
  // record holds the key. Should it still wait in memory when the new file
  // is renamed over the old one, a crash then would lose the key, its
  // acknowledged value included.
  using clock = std::chrono::steady_clock;
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 16 << 20, .buckets = 4096});  // (a snapshot of two steps: 2 MiB of buckets, 5 MB of records)
  constexpr int n = 5000;
  auto value = [](int i, char c) { return std::string(1000, c) + std::to_string(i); };
  std::string crash_copy;  // kv.log's bytes as soon as the new file took its place
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::no, .compact_min = 1 << 20},
                    [](record_type, std::string_view, std::span<const std::byte>) {});
    service svc(st, &log);
    std::uint64_t lsn = 0;
    // Every key twice: the log holds twice the live data, one write more
    // starts a compaction.
    for (const char c : {'a', 'b'}) {
      for (int i = 0; i < n; ++i) {
        REQUIRE(svc.put("key" + std::to_string(i), B(value(i, c)), lsn).is_ok());
        if (i % 100 == 0) {
          io.restart();
          io.run();
        }
      }
    }
    io.restart();
    io.run();
    REQUIRE_FALSE(log.compacting());
    REQUIRE(svc.put("key0", B(value(0, 'c')), lsn).is_ok());  // its first snapshot step runs inside
    REQUIRE(log.snapshotting());
    io.restart();
    REQUIRE(io.poll_one() == 1);  // the turn's end: that record written, the next step still queued
    REQUIRE(log.snapshotting());
    // Every key again: those the snapshot has not reached are left out of
    // it; their records wait for the turn's end.
    for (int i = 0; i < n; ++i) REQUIRE(svc.put("key" + std::to_string(i), B(value(i, 'd')), lsn).is_ok());
    REQUIRE(io.poll_one() == 1);  // the snapshot's last step: the compactor starts
    REQUIRE_FALSE(log.snapshotting());
    REQUIRE(log.compacting());
    // The io thread rests (those records stay in memory) until the new
    // file holds the snapshot and 1 s more, then runs: the file as soon as
    // the swap happened.
    const ino_t old_file = inode_of(dir + "/kv.log");
    const std::uint64_t snapshot = log.stats().last_snapshot_bytes;
    REQUIRE(snapshot > (std::uint64_t{1} << 20));
    std::optional<clock::time_point> rest_until;
    const auto until = clock::now() + std::chrono::seconds(30);
    while (clock::now() < until) {
      struct stat now{};
      if (::stat((dir + "/kv.log").c_str(), &now) == 0 && now.st_ino != old_file) {
        crash_copy = file_text(dir + "/kv.log");
        break;
      }
      if (!rest_until && (::stat((dir + "/kv.log.compact").c_str(), &now) != 0 ||
                          static_cast<std::uint64_t>(now.st_size) >= snapshot)) {
        rest_until = clock::now() + std::chrono::seconds(1);  // (written, or gone: renamed meanwhile)
      }
      if (rest_until && clock::now() > *rest_until) {
        io.restart();
        io.poll();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE_FALSE(crash_copy.empty());
    while (log.compacting()) {
      if (io.run_one() == 0) io.restart();
    }
    CHECK(log.stats().compactions == 1);
    log.close();
  }
  // The copy replays every key, with a value it was given.
  const std::string crashed = tmpdir();
  std::ofstream(crashed + "/kv.log", std::ios::binary).write(crash_copy.data(), static_cast<std::streamsize>(crash_copy.size()));
  const std::map<std::string, std::string> replayed = replay_of(crashed);
  CHECK(replayed.size() == static_cast<std::size_t>(n));
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    const auto it = replayed.find("key" + std::to_string(i));
    if (it == replayed.end() || (it->second != value(i, 'b') && it->second != value(i, 'd') &&
                                 (i != 0 || it->second != value(0, 'c')))) {
      ++wrong;
    }
  }
  CHECK(wrong == 0);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(crashed);
}

TEST_CASE("kv log: stop_compaction (the server's shutdown) ends a compaction under way and starts none", "[kv]") {
  const std::string dir = tmpdir();
  asio::io_context io;
  store st({.max_memory = 64 << 20});
  {
    durable_log log(io, {.dir = dir, .sync = sync_mode::everysec, .compact_min = 1 << 20},
                    [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
    service svc(st, &log);
    fill_until_compacting(io, log, svc);
    REQUIRE(log.compacting());
    log.stop_compaction();
    while (log.compacting()) {
      if (io.run_one() == 0) io.restart();
    }
    // Given up (unless it was swapping the files already): not a failure.
    CHECK(log.stats().compaction_failures == 0);
    const auto done = log.stats().compactions;
    // Writes go on; no compaction starts again, however far past the bound.
    for (int i = 0; i < 1500; ++i) put_answered(io, log, svc, "big" + std::to_string(i), std::string(16 << 10, 'z'));
    CHECK_FALSE(log.compacting());
    CHECK(log.stats().compactions == done);
    log.close();
    CHECK(std::filesystem::file_size(dir + "/kv.log") == log.stats().file_bytes);
    CHECK_FALSE(std::filesystem::exists(dir + "/kv.log.compact"));
  }
  expect_replay_equals(io, dir, sync_mode::everysec, st, 64 << 20);
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv log: a stop during a compaction keeps a complete log - nothing answered is lost", "[kv]") {
  for (const sync_mode mode : {sync_mode::always, sync_mode::everysec}) {
    INFO("sync " << to_string(mode));
    const std::string dir = tmpdir();
    asio::io_context io;
    store st({.max_memory = 64 << 20});
    {
      durable_log log(io, {.dir = dir, .sync = mode, .compact_min = 1 << 20},
                      [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
      service svc(st, &log);
      fill_until_compacting(io, log, svc);
      REQUIRE(log.compacting());
      put_answered(io, log, svc, "last", "write");
      log.close();  // the compaction gives up (or, swapping already, finishes)
      io.restart();
      io.poll();  // its end, posted here
      CHECK_FALSE(log.compacting());
      CHECK(log.stats().compaction_failures == 0);  // a stop is not a failure
      CHECK_FALSE(std::filesystem::exists(dir + "/kv.log.compact"));
    }
    expect_replay_equals(io, dir, mode, st, 64 << 20);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("kv log: everysec and no - writes by the io thread, compactions by the log thread, in order", "[kv]") {
  for (const sync_mode mode : {sync_mode::everysec, sync_mode::no}) {
    INFO("sync " << to_string(mode));
    const std::string dir = tmpdir();
    asio::io_context io;
    store st({.max_memory = 4 << 20});
    log_stats stats;
    {
      durable_log log(io, {.dir = dir, .sync = mode, .compact_min = 16 << 10},
                      [](record_type, std::string_view, std::span<const std::byte>) { FAIL("an empty log replays nothing"); });
      service svc(st, &log);
      std::uint64_t acked = 0, writes = 0;
      std::mt19937 rng(7);
      for (int turn = 0; turn < 400; ++turn) {
        // 1 to 8 writes per io_context turn, some while a compaction runs
        const int n = 1 + static_cast<int>(rng() % 8);
        for (int i = 0; i < n; ++i) {
          std::uint64_t lsn = 0;
          const std::string key = "key" + std::to_string(rng() % 12);
          if (rng() % 9 == 0) {
            bool existed = false;
            REQUIRE(svc.del(key, existed, lsn).is_ok());
            if (!existed) continue;
          } else {
            REQUIRE(svc.put(key, B(std::to_string(turn) + std::string(200, static_cast<char>('a' + i))), lsn).is_ok());
          }
          ++writes;
          log.async_wait(lsn, [&](std::error_code ec) {
            CHECK_FALSE(ec);
            ++acked;
          });
        }
        io.restart();
        if (turn % 3 == 0) io.poll(); else io.run();  // sometimes a turn ends with the thread still busy
      }
      io.restart();
      io.run();
      CHECK(acked == writes);
      stats = log.stats();
      log.close();
      CHECK(std::filesystem::file_size(dir + "/kv.log") == log.stats().file_bytes);  // (each compaction's offsets exact)
    }
    CHECK(stats.compactions >= 2);  // ~90 KB of records for 12 live keys
    CHECK(stats.compaction_failures == 0);
    expect_replay_equals(io, dir, mode, st);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("kv resp: pipelined, split and inline requests parse - broken ones are errors", "[kv]") {
  const resp_limits lim{.max_args = 8, .max_bulk = 100, .max_inline = 64};
  std::vector<std::string_view> args;
  std::size_t used = 0;
  std::string why;
  // One command from the front of `in`, by a fresh parser that stays alive
  // while its arguments are looked at.
  std::optional<resp_parser> parser;
  auto parse_resp = [&](std::string_view in, const resp_limits& l, std::vector<std::string_view>& a,
                        std::size_t& u, std::string& w) {
    parser.emplace(l);
    return parser->next(in, a, u, w);
  };
  const std::string two = "*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n";
  REQUIRE(parse_resp(two, lim, args, used, why) == resp_parse::command);
  CHECK(args == std::vector<std::string_view>{"GET", "k"});
  REQUIRE(parse_resp(std::string_view(two).substr(used), lim, args, used, why) == resp_parse::command);
  CHECK(args == std::vector<std::string_view>{"PING"});
  // Every prefix of a command is incomplete, never an error or a command.
  const std::string one = "*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nva\r\nl\r\n";
  for (std::size_t cut = 0; cut < one.size(); ++cut) {
    INFO("cut " << cut);
    CHECK(parse_resp(std::string_view(one).substr(0, cut), lim, args, used, why) == resp_parse::incomplete);
  }
  REQUIRE(parse_resp(one, lim, args, used, why) == resp_parse::command);
  CHECK(args[2] == "va\r\nl");  // binary-safe
  CHECK(used == one.size());
  REQUIRE(parse_resp("set k \"a \\\"b\\\" c\"  x\r\n", lim, args, used, why) == resp_parse::command);
  CHECK(args == std::vector<std::string_view>{"set", "k", "a \"b\" c", "x"});
  REQUIRE(parse_resp("\r\n", lim, args, used, why) == resp_parse::command);
  CHECK(args.empty());
  REQUIRE(parse_resp("*0\r\n", lim, args, used, why) == resp_parse::command);
  CHECK(args.empty());
  const std::pair<std::string, std::string> errors[] = {
      {"*x\r\n", "invalid multibulk length"},
      {"*9\r\n", "invalid multibulk length"},  // above max_args
      {"*1\r\n$-1\r\n", "invalid bulk length"},
      {"*1\r\n$101\r\n", "invalid bulk length"},
      {"*1\r\n$2x\r\n", "invalid bulk length"},
      {"*1\r\n+OK\r\n", "expected '$', got '+'"},
      {"*1\r\n$2\r\nabcd", "expected CRLF"},
      {"\"open\r\n", "unbalanced quotes"},
      {std::string(65, 'x'), "too big inline request"},
      {"*" + std::string(40, '1'), "invalid multibulk length"},
  };
  for (const auto& [in, want] : errors) {
    INFO(in);
    why.clear();
    CHECK(parse_resp(in, lim, args, used, why) == resp_parse::error);
    CHECK(why.find(want) != std::string::npos);
  }
}

TEST_CASE("kv service: with a home thread set, the store refuses writes from any other thread", "[kv]") {
  asio::io_context home;
  store st({.max_memory = 1 << 20, .max_key = 16, .max_value = 64});
  service svc(st, nullptr);
  svc.set_home(home.get_executor());
  const std::array<std::byte, 3> v{std::byte{1}, std::byte{2}, std::byte{3}};
  std::uint64_t lsn = 0;
  bool existed = false;
  // This thread does not run `home`: refused, the store untouched.
  anydoor::rpc::status p = svc.put("k", v, lsn);
  CHECK(p.code() == anydoor::rpc::errc::internal);
  CHECK(svc.del("k", existed, lsn).code() == anydoor::rpc::errc::internal);
  CHECK(st.stats().keys == 0);
  // On the home thread: served.
  anydoor::rpc::status on_home;
  asio::post(home, [&] { on_home = svc.put("k", v, lsn); });
  home.run();
  CHECK(on_home.is_ok());
  CHECK(st.stats().keys == 1);
}

TEST_CASE("kv resp: commands answer as Redis does", "[kv]") {
  asio::io_context io;
  store st({.max_memory = 1 << 20, .max_key = 16, .max_value = 64});
  service svc(st, nullptr);
  resp_door door(io, svc, "127.0.0.1", 0);
  auto run = [&](std::vector<std::string_view> a) {
    std::string out;
    std::uint64_t lsn = 0;
    const bool keep = door.execute(a, out, lsn);
    CHECK(lsn == 0);  // memory-only: nothing to wait for
    return keep ? out : "(closed)" + out;
  };
  CHECK(run({"PING"}) == "+PONG\r\n");
  CHECK(run({"ping", "hi"}) == "$2\r\nhi\r\n");
  CHECK(run({"SET", "a", "1"}) == "+OK\r\n");
  CHECK(run({"set", "a", "2", "NX"}) == "$-1\r\n");
  CHECK(run({"set", "b", "2", "XX"}) == "$-1\r\n");
  CHECK(run({"set", "a", "5", "XX"}) == "+OK\r\n");
  CHECK(run({"set", "a", "1", "EX", "10"}).find("-ERR expiry") == 0);
  CHECK(run({"set", "a", "1", "BOGUS"}) == "-ERR syntax error\r\n");
  CHECK(run({"INCR", "a"}) == ":6\r\n");
  CHECK(run({"INCR", "fresh"}) == ":1\r\n");
  CHECK(run({"SET", "n", "9223372036854775807"}) == "+OK\r\n");
  CHECK(run({"INCR", "n"}) == "-ERR increment or decrement would overflow\r\n");
  CHECK(run({"SET", "t", "text"}) == "+OK\r\n");
  CHECK(run({"INCR", "t"}) == "-ERR value is not an integer or out of range\r\n");
  CHECK(run({"GET", "a"}) == "$1\r\n6\r\n");
  CHECK(run({"GET", "zz"}) == "$-1\r\n");
  CHECK(run({"GET", std::string_view("waytoolongakeyname")}) == "$-1\r\n");
  CHECK(run({"MSET", "x", "1", "y", "2"}) == "+OK\r\n");
  CHECK(run({"MSET", "x", "1", "y"}) == "-ERR wrong number of arguments for 'mset' command\r\n");
  CHECK(run({"MGET", "x", "nope", "y"}) == "*3\r\n$1\r\n1\r\n$-1\r\n$1\r\n2\r\n");
  CHECK(run({"EXISTS", "x", "y", "nope", "x"}) == ":3\r\n");
  CHECK(run({"DEL", "x", "nope"}) == ":1\r\n");
  CHECK(run({"DBSIZE"}) == ":5\r\n");  // a, fresh, n, t, y
  CHECK(run({"SET", "big", std::string_view(std::string(65, 'v'))}).find("-ERR value of 65 bytes is above") == 0);
  CHECK(run({"SET", std::string_view("k2345678901234567"), "v"}).find("-ERR key of 17 bytes") == 0);
  CHECK(run({"SELECT", "0"}) == "+OK\r\n");
  CHECK(run({"SELECT", "3"}) == "-ERR DB index is out of range\r\n");
  CHECK(run({"ECHO", "a\r\nb"}) == "$4\r\na\r\nb\r\n");
  CHECK(run({"GET"}) == "-ERR wrong number of arguments for 'get' command\r\n");
  CHECK(run({"NOPE", "x\r\ny"}) == "-ERR unknown command 'NOPE', with args beginning with: 'x  y' \r\n");
  CHECK(run({"COMMAND", "DOCS"}) == "*0\r\n");
  CHECK(run({"CONFIG", "GET", "append*"}) ==
        "*4\r\n$10\r\nappendonly\r\n$2\r\nno\r\n$11\r\nappendfsync\r\n$2\r\nno\r\n");
  CHECK(run({"CONFIG", "SET", "x", "y"}).find("-ERR only CONFIG GET") == 0);
  const std::string info = run({"INFO"});
  CHECK(info.find("redis_version:") != std::string::npos);
  CHECK(info.find("db0:keys=5,expires=0,avg_ttl=0") != std::string::npos);
  // An MGET reply is bounded like a request (4 MiB here).
  CHECK(run({"SET", "wide", std::string_view(std::string(64, 'w'))}) == "+OK\r\n");
  std::vector<std::string_view> mget(80000, "wide");
  mget[0] = "MGET";
  CHECK(run(mget).find("-ERR the MGET reply would exceed") == 0);
  CHECK(run({"QUIT"}) == "(closed)+OK\r\n");
  // OOM in Redis's words.
  store tiny({.max_memory = 4096, .max_value = 200});
  service tsvc(tiny, nullptr);
  resp_door tdoor(io, tsvc, "127.0.0.1", 0);
  std::string out;
  std::uint64_t lsn = 0;
  for (int i = 0; i < 200 && out.find("-OOM") == std::string::npos; ++i) {
    const std::string k = "k" + std::to_string(i);
    const std::string v(100, 'x');  // not inline: in the arena
    tdoor.execute({"SET", k, v}, out, lsn);
  }
  CHECK(out.find("-OOM command not allowed when used memory > 'maxmemory'") != std::string::npos);
  door.stop();
  tdoor.stop();
  io.run();
}

TEST_CASE("kv resp: a request trickling in byte by byte parses in linear time, pipelined after it", "[kv]") {
  // 40000 arguments (about 280 KB), one byte per read: a parser that
  // started over on every read would do ~4e10 steps here.
  std::string cmd = "*40000\r\n";
  for (int i = 0; i < 40000; ++i) cmd += "$1\r\nx\r\n";
  cmd += "PING\r\n";
  resp_parser p({});
  std::vector<std::string_view> args;
  std::size_t used = 0;
  std::string why;
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t fed = 1;
  resp_parse r = resp_parse::incomplete;
  for (; fed <= cmd.size(); ++fed) {
    r = p.next(std::string_view(cmd).substr(0, fed), args, used, why);
    if (r != resp_parse::incomplete) break;
  }
  REQUIRE(r == resp_parse::command);
  CHECK(args.size() == 40000);
  CHECK(used == cmd.size() - 6);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  REQUIRE(p.next(std::string_view(cmd).substr(used), args, used, why) == resp_parse::command);
  CHECK(args == std::vector<std::string_view>{"PING"});
  // The 40000 arguments' list was let go of (a connection does not keep
  // what its largest command took); a small command's is kept.
  CHECK(p.memory() <= resp_parser::kKeptArgs * sizeof(std::pair<std::size_t, std::size_t>));
  // An inline line trickling in is not rescanned either.
  std::string line(60000, 'a');
  line += "\r\n";
  resp_parser q({});
  for (fed = 1; fed <= line.size(); ++fed) {
    r = q.next(std::string_view(line).substr(0, fed), args, used, why);
    if (r != resp_parse::incomplete) break;
  }
  CHECK(r == resp_parse::command);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("kv resp: a connection's input buffer grown for a large request goes back to 16 KiB once it is served - "
          "so does the parser's list of many arguments",
          "[kv]") {
  asio::io_context io;
  store st({.max_memory = 8 << 20, .max_value = 1 << 20});
  service svc(st, nullptr);
  resp_door door(io, svc, "127.0.0.1", 0);
  failure f;
  std::uint64_t at_rest = 0, grown = 0, after = 0, after_args = 0, closed = 0;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    asio::ip::tcp::socket c(io);
    co_await c.async_connect({asio::ip::make_address("127.0.0.1"), door.port()}, asio::use_awaitable);
    auto roundtrip = [&](std::string req, std::size_t reply_size) -> asio::awaitable<std::string> {
      co_await asio::async_write(c, asio::buffer(req), asio::use_awaitable);
      std::string reply(reply_size, '\0');
      co_await asio::async_read(c, asio::buffer(reply), asio::use_awaitable);
      co_return reply;
    };
    std::string r = co_await roundtrip("PING\r\n", 7);
    CHECK(r == "+PONG\r\n");
    at_rest = door.stats().input_buffer_bytes;
    // A 900 KB value: the buffer grows to hold the request.
    const std::string value(900 * 1000, 'v');
    std::string set = "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$" + std::to_string(value.size()) + "\r\n" + value + "\r\n";
    co_await asio::async_write(c, asio::buffer(set.data(), set.size() / 2), asio::use_awaitable);
    while (door.stats().input_buffer_bytes == at_rest) {
      asio::steady_timer t(io, std::chrono::milliseconds(1));
      co_await t.async_wait(asio::use_awaitable);
    }
    grown = door.stats().input_buffer_bytes;
    r = co_await roundtrip(set.substr(set.size() / 2), 5);
    CHECK(r == "+OK\r\n");
    r = co_await roundtrip("PING\r\n", 7);
    CHECK(r == "+PONG\r\n");
    after = door.stats().input_buffer_bytes;
    // 20000 arguments (MSET of 10000 keys): served, then let go of.
    std::string mset = "*20001\r\n$4\r\nMSET\r\n";
    for (int i = 0; i < 10000; ++i) {
      const std::string k = "m" + std::to_string(i);
      mset += "$" + std::to_string(k.size()) + "\r\n" + k + "\r\n$1\r\nx\r\n";
    }
    r = co_await roundtrip(mset, 5);
    CHECK(r == "+OK\r\n");
    r = co_await roundtrip("PING\r\n", 7);
    CHECK(r == "+PONG\r\n");
    after_args = door.stats().input_buffer_bytes;
    c.close();
    while (door.stats().connections != 0) {
      asio::steady_timer t(io, std::chrono::milliseconds(1));
      co_await t.async_wait(asio::use_awaitable);
    }
    closed = door.stats().input_buffer_bytes;
    door.stop();
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(at_rest == 16 * 1024);
  CHECK(grown > 900 * 1000 / 2);
  CHECK(after == 16 * 1024);
  CHECK(after_args == 16 * 1024);
  CHECK(closed == 0);
  CHECK(S(*st.get("m9999")) == "x");
}

TEST_CASE("kv read: a key that exists before and after an update is never read as absent, whatever mix of old and "
          "new bytes a READ sees",
          "[kv]") {
  store st({.max_memory = 1 << 20, .buckets = 1});
  std::mt19937 rng(3);
  std::vector<std::string> keys;
  for (int i = 0; i < 6; ++i) {
    keys.push_back("key" + std::to_string(i));
    REQUIRE(st.put(keys.back(), B("v" + std::to_string(i))) == put_status::ok);
  }
  const auto mem = st.memory();
  std::size_t mixes = 0, torn = 0;
  for (int round = 0; round < 300; ++round) {
    const std::string& k = keys[rng() % keys.size()];
    // Free a slot now and then (a delete and re-insert of another key), so
    // that free slots lie before and after the key's own.
    if (round % 7 == 0) {
      const std::string& other = keys[rng() % keys.size()];
      if (other != k) {
        st.del(other);
        REQUIRE(st.put(other, B("back")) == put_status::ok);
      }
    }
    const std::vector<std::byte> before(mem.begin(), mem.begin() + static_cast<std::ptrdiff_t>(kNeighbourhoodBytes));
    const std::size_t len = rng() % 2 == 0 ? 1 + rng() % 40 : 100 + rng() % 200;  // inline or arena
    REQUIRE(st.put(k, B(std::string(len, 'n'))) == put_status::ok);
    const std::vector<std::byte> after(mem.begin(), mem.begin() + static_cast<std::ptrdiff_t>(kNeighbourhoodBytes));
    for (std::size_t cut = 0; cut <= kNeighbourhoodBytes; cut += 8) {
      for (int order = 0; order < 2; ++order) {
        std::vector<std::byte> mix = order == 0 ? before : after;
        const auto& tail = order == 0 ? after : before;
        std::copy(tail.begin() + static_cast<std::ptrdiff_t>(cut), tail.end(),
                  mix.begin() + static_cast<std::ptrdiff_t>(cut));
        const outcome o = read_from(st, k, &mix);
        ++mixes;
        CHECK(o.kind != outcome::absent);
        if (o.kind == outcome::torn) ++torn;
      }
    }
  }
  CHECK(torn > 0);
  INFO(mixes);
}

TEST_CASE("kv store: a snapshot's steps see each key once, and none written since it began - slots and overflow",
          "[kv]") {
  store st({.max_memory = 8 << 20, .buckets = 1024});  // 4100 slots for 6000 keys: many overflow
  auto value = [](int k, char c) { return std::string(k % 3 == 0 ? 20 : 300, c); };  // inline and arena items
  for (int k = 0; k < 6000; ++k) REQUIRE(st.put("key" + std::to_string(k), B(value(k, 'a'))) == put_status::ok);
  const std::uint64_t every = ~std::uint64_t{0};
  // In steps of a small budget: every key exactly once.
  std::map<std::string, int> in_slots, in_overflow;
  std::uint64_t next = 0;
  int steps = 0;
  while (next < st.slot_buckets()) {
    std::size_t budget = 4096;
    next = st.for_each_from(next, budget, every, [&](std::string_view k, std::span<const std::byte> v) {
      ++in_slots[std::string(k)];
      return 16 + k.size() + v.size();
    });
    ++steps;
  }
  std::string after;
  for (bool done = false; !done;) {
    std::size_t budget = 4096;
    done = st.for_each_overflow_from(after, budget, every, [&](std::string_view k, std::span<const std::byte> v) {
      ++in_overflow[std::string(k)];
      return 16 + k.size() + v.size();
    });
    ++steps;
  }
  CHECK(steps > 20);
  CHECK(in_slots.size() + in_overflow.size() == 6000);
  CHECK(in_overflow.size() == st.stats().overflow_keys);
  CHECK(in_overflow.size() > 1000);
  bool once = true;
  for (const auto& [k, n] : in_slots) once = once && n == 1 && in_overflow.count(k) == 0;
  for (const auto& [k, n] : in_overflow) once = once && n == 1;
  CHECK(once);
  // A snapshot begins; then every other key of each kind is rewritten
  // (same sizes: they stay where they are) and new keys are put.
  const std::uint64_t before = st.next_version();
  std::set<std::string> rewritten;
  int i = 0;
  for (const auto* part : {&in_slots, &in_overflow}) {
    for (const auto& [k, n] : *part) {
      if (i++ % 2 != 0) continue;
      const int id = std::stoi(k.substr(3));
      REQUIRE(st.put(k, B(value(id, 'b'))) == put_status::ok);
      rewritten.insert(k);
    }
  }
  for (int k = 6000; k < 6100; ++k) st.put("key" + std::to_string(k), B(value(k, 'c')));  // (some may not fit: fine)
  std::set<std::string> seen;
  bool all_old = true;
  auto take = [&](std::string_view k, std::span<const std::byte> v) {
    seen.insert(std::string(k));
    all_old = all_old && !v.empty() && v[0] == std::byte{'a'};
    return std::size_t{0};
  };
  std::size_t budget = ~std::size_t{0};
  (void)st.for_each_from(0, budget, before, take);
  budget = ~std::size_t{0};
  after.clear();
  CHECK(st.for_each_overflow_from(after, budget, before, take));
  CHECK(all_old);  // nothing written since it began
  CHECK(seen.size() == 6000 - rewritten.size());
  bool exact = true;
  for (const auto* part : {&in_slots, &in_overflow}) {
    for (const auto& [k, n] : *part) exact = exact && (seen.count(k) == 1) == (rewritten.count(k) == 0);
  }
  CHECK(exact);
}

TEST_CASE("kv store: memory freed in one size class serves other sizes", "[kv]") {
  store st({.max_memory = 1 << 20, .max_value = 4096});
  const std::string big(1000, 'b');
  int n = 0;
  while (st.put("big" + std::to_string(n), B(big)) == put_status::ok) ++n;
  for (int i = 0; i < n; ++i) REQUIRE(st.del("big" + std::to_string(i)));
  CHECK(st.stats().used_bytes == 0);
  const std::string small(200, 's');
  int m = 0;
  while (m < 2 * n && st.put("small" + std::to_string(m), B(small)) == put_status::ok) ++m;
  CHECK(m >= n);  // at least one per freed block
  for (int i = 0; i < m; ++i) CHECK(S(*st.get("small" + std::to_string(i))) == small);
}

TEST_CASE("kv store: a client that fills the store with small items and deletes them leaves room for the largest "
          "value",
          "[kv]") {
  // The attack a size-class arena without merging falls to: every block
  // freed stays a small one, and a larger value never fits again.
  store st({.max_memory = 1 << 20, .max_value = 256 << 10});
  const std::string small(90, 's');  // (past the inline limit: arena items)
  int n = 0;
  while (st.put("k" + std::to_string(n), B(small)) == put_status::ok) ++n;
  REQUIRE(n > 1000);
  REQUIRE(st.check_arena().empty());
  for (int i = 0; i < n; ++i) REQUIRE(st.del("k" + std::to_string(i)));
  CHECK(st.stats().used_bytes == 0);
  CHECK(st.free_blocks() == 0);  // every block back in the top
  INFO(st.check_arena());
  CHECK(st.check_arena().empty());
  const std::string big(256 << 10, 'b');
  int m = 0;
  while (st.put("big" + std::to_string(m), B(big)) == put_status::ok) ++m;
  CHECK(m == 3);  // (1 MiB: three items of a 320 KiB class)
  for (int i = 0; i < m; ++i) CHECK(S(*st.get("big" + std::to_string(i))) == big);
  // Every other small item deleted: the holes merge pairwise only where
  // neighbours are free, and still take a value twice their size.
  for (int i = 0; i < m; ++i) REQUIRE(st.del("big" + std::to_string(i)));
  for (int i = 0; i < 4000; ++i) REQUIRE(st.put("k" + std::to_string(i), B(small)) == put_status::ok);
  for (int i = 0; i < 4000; i += 2) REQUIRE(st.del("k" + std::to_string(i)));
  for (int i = 1; i < 4000; i += 4) REQUIRE(st.del("k" + std::to_string(i)));  // (k0..k2 of each four now free)
  CHECK(st.check_arena().empty());
  const std::string mid(250, 'm');  // two small blocks and more
  for (int i = 0; i < 900; ++i) REQUIRE(st.put("m" + std::to_string(i), B(mid)) == put_status::ok);
  CHECK(st.check_arena().empty());
}

TEST_CASE("kv store: freed blocks merge with free neighbours above and below, and a large one is split for small items",
          "[kv]") {
  store st({.max_memory = 1 << 20, .max_value = 64 << 10});
  const std::string v(1000, 'v');
  for (const char* k : {"a", "b", "c", "d"}) REQUIRE(st.put(k, B(v)) == put_status::ok);
  const std::uint64_t one = st.stats().used_bytes / 4;
  REQUIRE(st.del("a"));
  REQUIRE(st.del("c"));
  CHECK(st.free_blocks() == 2);
  REQUIRE(st.del("b"));  // merges with both
  CHECK(st.free_blocks() == 1);
  INFO(st.check_arena());
  CHECK(st.check_arena().empty());
  // The merged block (three items' worth, below d) takes an item of a
  // class nearly three times theirs (3584 bytes against 1280): from it,
  // not from the top.
  REQUIRE(one == 1280);
  const std::string big(3500, 'B');
  REQUIRE(st.put("big", B(big)) == put_status::ok);
  CHECK(st.stats().used_bytes <= 4 * one + 8);  // (d and the big one: no room past them used)
  CHECK(st.check_arena().empty());
  // Split: the big block freed serves small items, several per block.
  REQUIRE(st.del("big"));
  const std::uint64_t before = st.stats().used_bytes;
  for (int i = 0; i < 20; ++i) REQUIRE(st.put("s" + std::to_string(i), B(std::string(100, 's'))) == put_status::ok);
  CHECK(st.check_arena().empty());
  CHECK(st.free_blocks() == 1);  // what is left of it
  CHECK(st.stats().used_bytes - before <= 20 * 160);
  // d, the highest, freed: with the free block below it, back to the top.
  for (int i = 0; i < 20; ++i) REQUIRE(st.del("s" + std::to_string(i)));
  REQUIRE(st.del("d"));
  CHECK(st.free_blocks() == 0);
  CHECK(st.stats().used_bytes == 0);
  CHECK(st.check_arena().empty());
}

TEST_CASE("kv store: random puts and deletes keep the arena consistent and every value intact", "[kv]") {
  store st({.max_memory = 2 << 20, .max_value = 64 << 10});
  std::mt19937_64 rng(GENERATE(1u, 2u, 3u));
  std::map<std::string, std::string> model;
  std::uniform_int_distribution<int> key(0, 599);
  // Mostly small values, some large: sizes from inline to 40 KiB.
  auto size = [&rng] {
    const auto r = rng() % 100;
    return static_cast<std::size_t>(r < 60 ? rng() % 300 : r < 95 ? rng() % 4000 : rng() % 40000);
  };
  std::uint64_t ooms = 0;
  for (int op = 0; op < 20000; ++op) {
    const std::string k = "key" + std::to_string(key(rng));
    if (rng() % 3 == 0) {
      CHECK(st.del(k) == (model.erase(k) == 1));
    } else {
      const std::string v(size(), static_cast<char>('a' + op % 26));
      const put_status r = st.put(k, B(v));
      if (r == put_status::ok) {
        model[k] = v;
      } else {
        REQUIRE(r == put_status::out_of_memory);
        ++ooms;
      }
    }
    if (op % 1000 == 999) {
      INFO("after " << op + 1 << " operations");
      REQUIRE(st.check_arena().empty());
      CHECK(st.stats().used_bytes <= (2u << 20));
    }
  }
  INFO(ooms << " puts refused for memory");
  for (const auto& [k, v] : model) REQUIRE(S(*st.get(k)) == v);
  CHECK(st.stats().keys == model.size());
  for (const auto& [k, v] : model) REQUIRE(st.del(k));
  CHECK(st.stats().used_bytes == 0);
  CHECK(st.free_blocks() == 0);
  CHECK(st.check_arena().empty());
}

TEST_CASE("kv store: keys in the overflow table are charged to max_memory with their items", "[kv]") {
  // One bucket: eight slots, every later key overflows (a client that
  // knows the seed can aim keys at one neighbourhood). Its table's heap
  // counts against the limit, so the limit bounds what the store holds.
  constexpr std::uint64_t kMax = 256 << 10;
  store st({.max_memory = kMax, .buckets = 1});
  const std::string key_tail(40, 'k');  // (keys past the string's own bytes)
  int n = 0;
  while (st.put(std::to_string(n) + key_tail, B("v")) == put_status::ok) ++n;
  const store_stats ss = st.stats();
  INFO(n << " keys, " << ss.overflow_keys << " in the overflow table: " << ss.used_bytes << " arena bytes, "
         << ss.overflow_bytes << " for the table");
  CHECK(ss.overflow_keys + 8 == static_cast<std::uint64_t>(n));
  CHECK(ss.overflow_bytes >= ss.overflow_keys * 96);
  CHECK(ss.used_bytes + ss.overflow_bytes <= kMax);
  CHECK(ss.used_bytes < kMax - 4096);  // (the arena alone would have taken more)
  for (int i = 0; i < n; ++i) REQUIRE(st.del(std::to_string(i) + key_tail));
  CHECK(st.stats().overflow_bytes == 0);
  CHECK(st.stats().used_bytes == 0);
}

TEST_CASE("kv store: a deleted value's bytes do not stay in the registered arena", "[kv]") {
  store st({.max_memory = 1 << 20});
  const std::string secret(3000, 'Q');
  REQUIRE(st.put("a", B(secret)) == put_status::ok);
  REQUIRE(st.put("b", B(std::string(3000, 'b'))) == put_status::ok);  // (a stays below the top)
  const std::span<const std::byte> mem = st.memory();
  auto holds = [&] {
    const std::string_view all(reinterpret_cast<const char*>(mem.data()), mem.size());
    return all.find(std::string(64, 'Q')) != std::string_view::npos;
  };
  REQUIRE(holds());
  REQUIRE(st.del("a"));
  CHECK(!holds());
  // Overwritten: the old value goes the same way.
  REQUIRE(st.put("c", B(secret)) == put_status::ok);
  REQUIRE(st.put("c", B(std::string(3000, 'c'))) == put_status::ok);
  CHECK(!holds());
  // Small values that live in their slot: deleted, overwritten by a
  // shorter one, grown into an arena item.
  auto small_held = [&](std::string_view what) {
    const std::string_view all(reinterpret_cast<const char*>(mem.data()), mem.size());
    return all.find(what) != std::string_view::npos;
  };
  REQUIRE(st.put("pin", B("SECRET-TOKEN-1234")) == put_status::ok);
  REQUIRE(small_held("SECRET-TOKEN-1234"));
  REQUIRE(st.del("pin"));
  CHECK(!small_held("SECRET-TOKEN-1234"));
  REQUIRE(st.put("pin", B("SECRET-TOKEN-5678")) == put_status::ok);
  REQUIRE(st.put("pin", B("short")) == put_status::ok);
  CHECK(!small_held("TOKEN-5678"));
  REQUIRE(st.put("pin2", B("SECRET-TOKEN-9999")) == put_status::ok);
  REQUIRE(st.put("pin2", B(std::string(500, 'g'))) == put_status::ok);  // (to the arena)
  CHECK(!small_held("TOKEN-9999"));
}

namespace {
std::atomic<bool> g_hold_syncs{false};
std::atomic<int> g_held_syncs{0};  // fdatasyncs that found the hold on
int held_fdatasync(int fd) {
  if (g_hold_syncs.load()) {
    ++g_held_syncs;
    while (g_hold_syncs.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return ::fdatasync(fd);
}
}  // namespace

TEST_CASE("kv service: no reply shows a write before its fsync - GET and DEL by RPC and the Redis door wait for it",
          "[kv]") {
  // As Redis sends no reply before the AOF holds (with always: fsynced)
  // every command run before it: a reader never sees a value, or the
  // absence of one, that a crash could take back.
  const std::string dir = tmpdir();
  asio::io_context io;
  g_hold_syncs = false;
  durable_log log(io, {.dir = dir, .sync = sync_mode::always, .fdatasync_hook = &held_fdatasync},
                  [](record_type, std::string_view, std::span<const std::byte>) {});
  anydoor::test::kv_rig rig(io, {.max_memory = 1 << 20}, &log);
  resp_door door(io, rig.svc, "127.0.0.1", 0);
  failure f;
  // Whatever happens, the hold ends: on the coroutine's way out (a failed
  // REQUIRE), or after 15 s (a read that waits for no reason).
  struct release_hold {
    ~release_hold() { g_hold_syncs = false; }
  };
  asio::steady_timer watchdog(io, std::chrono::seconds(15));
  watchdog.async_wait([](anydoor::error_code ec) {
    if (!ec) g_hold_syncs = false;
  });
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    release_hold guard;
    client writer(rig.cfab, co_await rig.cfab.async_connect(rig.where, asio::use_awaitable), std::chrono::seconds(20));
    client reader(rig.cfab, co_await rig.cfab.async_connect(rig.where, asio::use_awaitable), std::chrono::seconds(20));
    REQUIRE((co_await writer.put("k", B("v1"))).is_ok());
    asio::ip::tcp::socket redis(io);
    co_await redis.async_connect({asio::ip::make_address("127.0.0.1"), door.port()}, asio::use_awaitable);
    // The next fsync is held: a PUT of v2 is applied and waits for it.
    g_hold_syncs = true;
    const int held_before = g_held_syncs.load();
    bool put_done = false, get_done = false, miss_done = false, del_done = false;
    std::string got, missing;
    bool existed = true;
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      CHECK((co_await writer.put("k", B("v2"))).is_ok());
      put_done = true;
    }, asio::detached);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (g_held_syncs.load() == held_before && std::chrono::steady_clock::now() < until) {
      asio::steady_timer t(io, std::chrono::milliseconds(1));
      co_await t.async_wait(asio::use_awaitable);
    }
    REQUIRE(g_held_syncs.load() > held_before);  // the log thread sits in the fsync of v2
    const std::uint64_t calls_before = rig.srv.stats().calls;
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      CHECK((co_await reader.get("k", got)).is_ok());
      get_done = true;
    }, asio::detached);
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      CHECK((co_await reader.get("nope", missing)).code() == rpc::errc::not_found);
      miss_done = true;
    }, asio::detached);
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      CHECK((co_await reader.del("nope", existed)).is_ok());
      del_done = true;
    }, asio::detached);
    const std::string_view ask = "GET k\r\n";
    co_await asio::async_write(redis, asio::buffer(ask), asio::use_awaitable);
    std::string answer(64, '\0');
    std::size_t have = 0;
    bool resp_done = false;
    redis.async_read_some(asio::buffer(answer), [&](anydoor::error_code ec, std::size_t n) {
      CHECK_FALSE(ec);
      have = n;
      resp_done = true;
    });
    // Once the server has taken the three calls and the command, they wait.
    const auto until1 = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((rig.srv.stats().calls < calls_before + 3 || door.stats().commands < 1) &&
           std::chrono::steady_clock::now() < until1) {
      asio::steady_timer t(io, std::chrono::milliseconds(1));
      co_await t.async_wait(asio::use_awaitable);
    }
    CHECK(rig.srv.stats().calls == calls_before + 3);
    CHECK(door.stats().commands == 1);
    asio::steady_timer pause(io, std::chrono::milliseconds(200));
    co_await pause.async_wait(asio::use_awaitable);
    CHECK_FALSE(put_done);
    CHECK_FALSE(get_done);   // it would show v2
    CHECK_FALSE(miss_done);  // a miss too: an unsynced DEL could be why
    CHECK_FALSE(del_done);
    CHECK_FALSE(resp_done);
    g_hold_syncs = false;
    const auto until2 = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!(put_done && get_done && miss_done && del_done && resp_done) &&
           std::chrono::steady_clock::now() < until2) {
      asio::steady_timer t(io, std::chrono::milliseconds(1));
      co_await t.async_wait(asio::use_awaitable);
    }
    CHECK(put_done);
    CHECK(get_done);
    CHECK(got == "v2");
    CHECK(miss_done);
    CHECK(del_done);
    CHECK_FALSE(existed);
    CHECK(resp_done);
    CHECK(answer.substr(0, have) == "$2\r\nv2\r\n");
    // Nothing pending: reads wait for no fsync (one held now would stop them).
    g_hold_syncs = true;
    const auto t0 = std::chrono::steady_clock::now();
    CHECK((co_await reader.get("k", got)).is_ok());
    co_await asio::async_write(redis, asio::buffer(ask), asio::use_awaitable);
    const std::size_t n = co_await redis.async_read_some(asio::buffer(answer), asio::use_awaitable);
    CHECK(answer.substr(0, n) == "$2\r\nv2\r\n");
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    g_hold_syncs = false;
    watchdog.cancel();
    redis.close();
    door.stop();
    rig.srv.stop();
  }, f.handler());
  io.run();
  f.check();
  g_hold_syncs = false;
  log.close();
  std::filesystem::remove_all(dir);
}

TEST_CASE("kv client: a layout reply it cannot use is refused and GETs go by RPC", "[kv]") {
  // A server that answers kv.layout with what the test chooses, and GET
  // with a fixed value: the client must refuse a short reply, a layout that
  // does not describe a table it reads, and a table larger than the region
  // it names, and then get by RPC (no READ of anything).
  asio::io_context io;
  anydoor::fabric sfab(io, test_options());
  anydoor::fabric cfab(io, test_options());
  layout good = layout_of(1024, 1 << 16, 64, 1024);
  const std::size_t table_bytes = good.arena_offset + good.arena_size;
  std::vector<std::byte> table_mem(table_bytes);
  anydoor::memory_region table = sfab.register_memory(std::span<std::byte>(table_mem), anydoor::access::remote_read);
  const std::vector<std::byte> packed = table.remote().pack();
  REQUIRE(packed.size() == sizeof good.region);
  std::memcpy(good.region, packed.data(), packed.size());
  std::vector<std::byte> reply;
  auto as_reply = [](const layout& l) {
    const auto* p = reinterpret_cast<const std::byte*>(&l);
    return std::vector<std::byte>(p, p + sizeof l);
  };
  rpc::server srv;
  srv.add(kLayoutMethod, [&](rpc::server_call& call) -> rpc::status {
    call.reply(std::span<const std::byte>(reply));
    return {};
  });
  srv.add(kGetMethod, [](rpc::server_call& call) -> rpc::status {
    call.reply(B("by-rpc"));
    return {};
  });
  anydoor::acceptor acc = sfab.listen(test_host(), 0);
  const std::string where = addr(acc);
  srv.async_serve(std::move(acc), [](anydoor::error_code) {});
  failure f;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    client cli(cfab, co_await cfab.async_connect(where, asio::use_awaitable), std::chrono::seconds(10));
    struct refused_case {
      const char* what;
      std::vector<std::byte> bytes;
      rpc::errc code;
      const char* message;
    };
    const std::vector<std::byte> zeros(sizeof(layout));
    layout past_region = good;  // the arena runs one byte past the region
    past_region.arena_size += 1;
    layout other_magic = good;
    other_magic.magic = layout::kMagic + 1;
    layout no_region = good;  // a region that does not unpack
    std::memset(no_region.region, 0xff, sizeof no_region.region);
    std::vector<std::byte> long_reply = as_reply(good);
    long_reply.push_back(std::byte{0});
    const std::vector<refused_case> cases{
        {"an empty reply", {}, rpc::errc::internal, "malformed layout reply"},
        {"a short reply", std::vector<std::byte>(10), rpc::errc::internal, "malformed layout reply"},
        {"a reply one byte too long", long_reply, rpc::errc::internal, "malformed layout reply"},
        {"all zeros", zeros, rpc::errc::failed_precondition, "not one this client reads"},
        {"another magic", as_reply(other_magic), rpc::errc::failed_precondition, "not one this client reads"},
        {"an arena past the region", as_reply(past_region), rpc::errc::failed_precondition,
         "not one this client reads"},
        {"a region that does not unpack", as_reply(no_region), rpc::errc::failed_precondition,
         "not one this client reads"},
    };
    for (const refused_case& c : cases) {
      INFO(c.what);
      reply = c.bytes;
      const rpc::status st = co_await cli.fetch_layout();
      CHECK(st.code() == c.code);
      CHECK(st.message().find(c.message) != std::string::npos);
      CHECK_FALSE(cli.can_read());
      client::reader r = cli.make_reader();
      std::string got;
      const rpc::status g = co_await cli.read_get(r, "key", got);
      CHECK(g.is_ok());
      CHECK(got == "by-rpc");
      CHECK(cli.reads().reads == 0);
    }
    // The same layout, whole: taken.
    reply = as_reply(good);
    const rpc::status st = co_await cli.fetch_layout();
    CHECK(st.is_ok());
    CHECK(cli.can_read());
    // A later refusal does not undo it (the layout taken stays), and is said.
    reply = zeros;
    const rpc::status again = co_await cli.fetch_layout();
    CHECK(again.code() == rpc::errc::failed_precondition);
    CHECK(cli.can_read());
    srv.stop();
  }, f.handler());
  run_to_completion(io);
  f.check();
}

TEST_CASE("kv client: the location cache READs an item beside its neighbourhood - a moved item is READ again and "
          "never taken stale",
          "[kv]") {
  asio::io_context io;
  anydoor::test::kv_rig rig(io, {.max_memory = 1 << 20, .max_key = 64, .max_value = 4096});
  anydoor::fabric& cfab = rig.cfab;
  const std::string& where = rig.where;
  failure f;
  auto text = [](char c, std::size_t n, int ver) { return std::string(n, c) + "#" + std::to_string(ver); };
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    for (const std::size_t entries : {kLocationCache, std::size_t{0}}) {
      INFO("location cache entries: " << entries);
      client cli(cfab, co_await cfab.async_connect(where, asio::use_awaitable), std::chrono::seconds(10), entries);
      anydoor::rpc::status st1 = co_await cli.fetch_layout();
      REQUIRE(st1.is_ok());
      client::reader r = cli.make_reader();
      std::string got;
      const std::string key = "k" + std::to_string(entries);
      // An arena item (200 B): the first GET reads neighbourhood, then item.
      st1 = co_await cli.put(key, B(text('a', 200, 1)));
      REQUIRE(st1.is_ok());
      st1 = co_await cli.read_get(r, key, got);
      REQUIRE(st1.is_ok());
      CHECK(got == text('a', 200, 1));
      CHECK(cli.reads().reads == 2);
      CHECK(cli.reads().ahead == 0);
      // Unchanged: the item READ beside the neighbourhood is taken.
      st1 = co_await cli.read_get(r, key, got);
      REQUIRE(st1.is_ok());
      CHECK(got == text('a', 200, 1));
      CHECK(cli.reads().ahead == (entries != 0 ? 1u : 0u));
      CHECK(cli.reads().ahead_hits == cli.reads().ahead);
      // Updated four times (out of place: the item moves; a later version
      // may land in memory an older one left, sizes alike): the guess is
      // stale, or holds an older version; the value is the new one.
      for (int ver = 2; ver <= 5; ++ver) {
        const auto before = cli.reads();
        st1 = co_await cli.put(key, B(text('b', 200, ver)));
        REQUIRE(st1.is_ok());
        st1 = co_await cli.read_get(r, key, got);
        REQUIRE(st1.is_ok());
        CHECK(got == text('b', 200, ver));
        if (entries != 0) {
          CHECK(cli.reads().ahead == before.ahead + 1);
          // Taken only if the slot points at the very place READ ahead
          // (memory reused for this version): then it must be this version.
          if (cli.reads().ahead_hits != before.ahead_hits) {
            CHECK(cli.reads().reads == before.reads + 2);
          } else {
            CHECK(cli.reads().reads == before.reads + 3);  // READ again after the slot
          }
        } else {
          CHECK(cli.reads().reads == before.reads + 2);
        }
      }
      // Inline now (a small value): the slot holds it; nothing is READ ahead after.
      st1 = co_await cli.put(key, B("tiny"));
      REQUIRE(st1.is_ok());
      st1 = co_await cli.read_get(r, key, got);
      REQUIRE(st1.is_ok());
      CHECK(got == "tiny");
      const auto after_inline = cli.reads();
      st1 = co_await cli.read_get(r, key, got);
      REQUIRE(st1.is_ok());
      CHECK(got == "tiny");
      CHECK(cli.reads().ahead == after_inline.ahead);
      CHECK(cli.reads().reads == after_inline.reads + 1);
      // The slot points at the very place cached, with a newer version
      // than the item there holds (forged in the table: the slot's version
      // is raised, its CRC recomputed): the bytes READ ahead are an older
      // version and are never taken, nor the same bytes READ after the
      // slot; the GET reads again, then asks by RPC.
      st1 = co_await cli.put(key, B(text('c', 300, 9)));
      REQUIRE(st1.is_ok());
      st1 = co_await cli.read_get(r, key, got);  // caches the item's place
      REQUIRE(st1.is_ok());
      if (entries != 0) {
        const layout l = rig.st.describe();
        const std::uint64_t h = key_hash(l.seed, key);
        const auto mem = rig.st.memory();
        slot* forged = nullptr;
        for (std::size_t b = 0; b < kNeighborhood && forged == nullptr; ++b) {
          for (std::size_t i = 0; i < kSlotsPerBucket; ++i) {
            const std::size_t at = ((h & (l.buckets - 1)) + b) * kBucketSize + kBucketHeader + i * kSlotSize;
            auto* sl = reinterpret_cast<slot*>(mem.data() + at);
            if (sl->version != 0 && sl->hash == h) forged = sl;
          }
        }
        REQUIRE(forged != nullptr);
        const slot saved = *forged;
        forged->version += 1000;
        forged->crc = slot_crc(*forged);
        const auto before = cli.reads();
        st1 = co_await cli.read_get(r, key, got);
        REQUIRE(st1.is_ok());
        CHECK(got == text('c', 300, 9));  // by RPC: the store's own
        CHECK(cli.reads().ahead == before.ahead + 1);
        CHECK(cli.reads().ahead_hits == before.ahead_hits);
        CHECK(cli.reads().retries == before.retries + kReadAttempts - 1);
        CHECK(cli.reads().fallbacks == before.fallbacks + 1);
        CHECK(cli.reads().reads == before.reads + 2 + 1 + 2 * (kReadAttempts - 1));
        *forged = saved;
        // The fallback forgot the place: the next GET reads after the slot.
        const auto again = cli.reads();
        st1 = co_await cli.read_get(r, key, got);
        REQUIRE(st1.is_ok());
        CHECK(got == text('c', 300, 9));
        CHECK(cli.reads().ahead == again.ahead);
        CHECK(cli.reads().reads == again.reads + 2);
      }
      // Deleted: not found, whatever was cached.
      bool existed = false;
      st1 = co_await cli.del(key, existed);
      REQUIRE(st1.is_ok());
      CHECK(existed);
      st1 = co_await cli.read_get(r, key, got);
      CHECK(st1.code() == anydoor::rpc::errc::not_found);
      if (entries == 0) {
        CHECK(cli.reads().fallbacks == 0);
        CHECK(cli.reads().retries == 0);
      }
    }
    rig.srv.stop();
  }, f.handler());
  run_to_completion(io);
  f.check();
}

TEST_CASE("kv server with a progress thread: GETs by READ are served while the server's io thread does not run",
          "[kv]") {
  // anydoor-kv-server --progress-thread: on tcp the server's process is the
  // NIC; its thread serves the READs while the io thread is busy (here: is
  // not run at all once the client has the layout).
  asio::io_context sio, cio;
  store st({.max_memory = 1 << 20});
  service svc(st, nullptr);
  anydoor::fabric_options so = test_options();
  so.progress_thread = true;
  anydoor::fabric sfab(sio, so);
  anydoor::fabric cfab(cio, test_options());
  anydoor::memory_region table = sfab.register_memory(st.memory(), anydoor::access::remote_read);
  anydoor::rpc::server srv;
  svc.add_methods(srv, table);
  anydoor::acceptor acc = sfab.listen(test_host(), 0);
  const std::string where = addr(acc);
  srv.async_serve(std::move(acc), [](anydoor::error_code) {});
  const std::string big(300, 'b');
  REQUIRE(st.put("small", B("s1")) == put_status::ok);
  REQUIRE(st.put("big", B(big)) == put_status::ok);
  std::unique_ptr<client> cli;
  failure f;
  bool ready = false;
  asio::co_spawn(cio, [&]() -> asio::awaitable<void> {
    cli = std::make_unique<client>(cfab, co_await cfab.async_connect(where, asio::use_awaitable),
                                   std::chrono::seconds(10));
    const anydoor::rpc::status st1 = co_await cli->fetch_layout();
    REQUIRE(st1.is_ok());
    ready = true;
  }, f.handler());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!ready && !f.e && std::chrono::steady_clock::now() < until) {
    sio.restart();
    sio.poll();
    cio.restart();
    cio.run_for(std::chrono::milliseconds(2));
  }
  f.check();
  REQUIRE(ready);
  // From here on only the client's io_context runs.
  std::string got_small, got_big, got_missing;
  anydoor::rpc::status s_small, s_big, s_missing;
  bool done = false;
  asio::co_spawn(cio, [&]() -> asio::awaitable<void> {
    client::reader r = cli->make_reader();
    s_small = co_await cli->read_get(r, "small", got_small);
    s_big = co_await cli->read_get(r, "big", got_big);
    s_missing = co_await cli->read_get(r, "missing", got_missing);
    done = true;
  }, f.handler());
  const auto until2 = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done && !f.e && std::chrono::steady_clock::now() < until2) {
    cio.restart();
    cio.run_for(std::chrono::milliseconds(5));
  }
  f.check();
  REQUIRE(done);
  CHECK(s_small.is_ok());
  CHECK(got_small == "s1");
  CHECK(s_big.is_ok());
  CHECK(got_big == big);
  CHECK(s_missing.code() == anydoor::rpc::errc::not_found);
  CHECK(cli->reads().reads >= 4);
  CHECK(cli->reads().fallbacks == 0);  // (none asked by RPC: the server's io thread could not have answered)
  // Teardown: both io_contexts run again.
  cli.reset();
  srv.stop();
  for (int i = 0; i < 50; ++i) {
    sio.restart();
    sio.poll();
    cio.restart();
    cio.poll();
  }
}
