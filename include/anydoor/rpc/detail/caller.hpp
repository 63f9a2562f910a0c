// The async_call overloads rpc::client and rpc::channel share (CRTP): the
// derived class names the engine a call goes to and the io executor.
//   client_impl* call_target(std::error_code& why);  // null: fail with why
//   asio::io_context::executor_type call_executor() const;
#pragma once

#include <anydoor/rpc/codec.hpp>
#include <anydoor/rpc/detail/call_op.hpp>

#include <boost/asio/async_result.hpp>

#include <system_error>
#include <utility>

namespace anydoor::rpc::detail {

template <class Derived>
class caller {
 public:
  // Untyped: void(error_code, rpc::reply).
  template <class Token>
  auto async_call(std::uint64_t method, asio::const_buffer request, Token&& token) {
    return async_call(method, request, call_options{}, std::forward<Token>(token));
  }
  template <class Token>
  auto async_call(std::uint64_t method, asio::const_buffer request, const call_options& o, Token&& token) {
    return asio::async_initiate<Token, void(error_code, reply)>(
        [this](auto handler, std::uint64_t m, asio::const_buffer req, const call_options& opts) {
          std::error_code why;
          client_impl* c = self().call_target(why);
          initiate_untyped(c, why, self().call_executor(), std::move(handler), m, req, opts);
        },
        token, method, request, o);
  }
  // Typed: void(error_code, M::reply_type).
  template <typed_method M, class Token>
  auto async_call(const M& m, const typename M::request_type& request, Token&& token) {
    return async_call(m, request, call_options{}, std::forward<Token>(token));
  }
  template <typed_method M, class Token>
  auto async_call(const M& m, const typename M::request_type& request, const call_options& o, Token&& token) {
    return asio::async_initiate<Token, void(error_code, typename M::reply_type)>(
        [this](auto handler, const M& method, const typename M::request_type& req, const call_options& opts) {
          std::error_code why;
          client_impl* c = self().call_target(why);
          initiate_typed(c, why, self().call_executor(), std::move(handler), method, req, opts);
        },
        token, m, request, o);
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace anydoor::rpc::detail
