#pragma once
// TCP endpoints as TcpComm publishes them in the store ("1.2.3.4:5", "[::1]:5"), and the
// socket options every ring link gets.
#include <cstdint>
#include <optional>
#include <string>

#include <boost/asio/ip/tcp.hpp>

namespace fsdp::detail {

inline std::string format_endpoint(const boost::asio::ip::address& a, std::uint16_t port) {
  return a.is_v6() ? "[" + a.to_string() + "]:" + std::to_string(port) : a.to_string() + ":" + std::to_string(port);
}

// "1.2.3.4:5" or "[::1]:5"; empty on anything else.
inline std::optional<boost::asio::ip::tcp::endpoint> parse_endpoint(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 >= s.size()) return std::nullopt;
  std::string host = s.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  boost::system::error_code ec;
  const auto addr = boost::asio::ip::make_address(host, ec);
  const std::string port_text = s.substr(colon + 1);
  if (ec || port_text.find_first_not_of("0123456789") != std::string::npos || port_text.size() > 5) return std::nullopt;
  const long port = std::stol(port_text);
  if (port < 1 || port > 65535) return std::nullopt;
  return boost::asio::ip::tcp::endpoint(addr, static_cast<std::uint16_t>(port));
}

inline void tune_socket(boost::asio::ip::tcp::socket& s, int buffer_bytes) {
  boost::system::error_code ignored;
  s.set_option(boost::asio::ip::tcp::no_delay(true), ignored);  // frames are written whole: never wait to coalesce
  if (buffer_bytes > 0) {
    s.set_option(boost::asio::socket_base::send_buffer_size(buffer_bytes), ignored);
    s.set_option(boost::asio::socket_base::receive_buffer_size(buffer_bytes), ignored);
  }
}

}  // namespace fsdp::detail
