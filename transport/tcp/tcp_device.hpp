// The tcp provider's device: a name, capabilities and a connection manager.
#pragma once

#include <anydoor/transport/provider.hpp>

#include "tcp/tcp_provider.hpp"

#include <memory>
#include <string>

namespace anydoor::transport::tcp {

class tcp_device final : public device {
 public:
  // faults: what its queue pairs inject (faults.hpp); inactive by default.
  explicit tcp_device(std::string name, fault_plan faults = {});
  std::string_view provider() const noexcept override { return "tcp"; }
  std::string_view name() const noexcept override { return name_; }
  const capabilities& caps() const noexcept override { return caps_; }
  device_counters counters() const override;
  std::unique_ptr<protection_domain> alloc_pd() override;
  using device::create_cq;
  std::unique_ptr<completion_queue> create_cq(std::uint32_t depth, const cq_options& options) override;
  std::unique_ptr<listener> listen(const std::string& host, std::uint16_t port,
                                   const listen_options& options) override;
  using device::connect;
  connect_result connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                         std::span<const std::byte> private_data, std::chrono::milliseconds timeout,
                         std::stop_token stop) noexcept override;

 private:
  static capabilities make_caps() noexcept;
  std::string name_;
  capabilities caps_;
  std::shared_ptr<device_state> shared_ = std::make_shared<device_state>();
};

}  // namespace anydoor::transport::tcp
