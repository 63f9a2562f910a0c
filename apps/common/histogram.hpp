// A latency histogram with about 1.5 % resolution over 1 ns .. 2^47 ns
// (log buckets of 64 linear steps each), constant memory, no allocation
// per sample: for the percentiles the apps print.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>

namespace anydoor::apps {

class histogram {
 public:
  void record(std::uint64_t ns) noexcept {
    ++counts_[index(ns)];
    ++count_;
    sum_ += ns;
    max_ = std::max(max_, ns);
    min_ = std::min(min_, ns);
  }
  void merge(const histogram& o) noexcept {
    for (std::size_t i = 0; i < kBuckets; ++i) counts_[i] += o.counts_[i];
    count_ += o.count_;
    sum_ += o.sum_;
    max_ = std::max(max_, o.max_);
    min_ = std::min(min_, o.min_);
  }
  std::uint64_t count() const noexcept { return count_; }
  std::uint64_t max() const noexcept { return max_; }
  std::uint64_t min() const noexcept { return count_ == 0 ? 0 : min_; }
  double mean() const noexcept { return count_ == 0 ? 0.0 : static_cast<double>(sum_) / static_cast<double>(count_); }
  // The q-quantile (0 < q <= 1): the smallest bucket holding at least
  // q * count samples, as that bucket's midpoint (capped at max()).
  std::uint64_t quantile(double q) const noexcept {
    if (count_ == 0) return 0;
    auto want = static_cast<std::uint64_t>(q * static_cast<double>(count_) + 0.999999);
    want = std::clamp<std::uint64_t>(want, 1, count_);
    std::uint64_t seen = 0;
    for (std::size_t i = 0; i < kBuckets; ++i) {
      seen += counts_[i];
      if (seen >= want) return std::min(midpoint(i), max_);
    }
    return max_;
  }

 private:
  static constexpr unsigned kSub = 6;  // 64 steps per power of two
  static constexpr std::size_t kLinear = std::size_t{1} << (kSub + 1);  // 0..127 exact
  static constexpr unsigned kMaxExp = 47;
  static constexpr std::size_t kBuckets = kLinear + (kMaxExp - kSub) * (std::size_t{1} << kSub);

  static std::size_t index(std::uint64_t v) noexcept {
    if (v < kLinear) return static_cast<std::size_t>(v);
    unsigned e = static_cast<unsigned>(std::bit_width(v)) - 1;  // >= kSub + 1
    if (e > kMaxExp) {
      e = kMaxExp;
      v = (std::uint64_t{1} << (kMaxExp + 1)) - 1;
    }
    const std::uint64_t sub = (v >> (e - kSub)) & ((std::uint64_t{1} << kSub) - 1);
    return kLinear + (e - kSub - 1) * (std::size_t{1} << kSub) + static_cast<std::size_t>(sub);
  }
  static std::uint64_t midpoint(std::size_t i) noexcept {
    if (i < kLinear) return i;
    const std::size_t k = i - kLinear;
    const unsigned e = static_cast<unsigned>(k >> kSub) + kSub + 1;
    const std::uint64_t sub = k & ((std::size_t{1} << kSub) - 1);
    const std::uint64_t lo = (std::uint64_t{1} << e) | (sub << (e - kSub));
    return lo + (std::uint64_t{1} << (e - kSub)) / 2;
  }

  std::array<std::uint64_t, kBuckets> counts_{};
  std::uint64_t count_ = 0;
  std::uint64_t sum_ = 0;
  std::uint64_t max_ = 0;
  std::uint64_t min_ = ~std::uint64_t{0};
};

}  // namespace anydoor::apps
