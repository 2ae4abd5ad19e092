#pragma once
// The benchmark's Runner (see measure.hpp) over Gloo, PyTorch's CPU collectives: the TCP
// transport on 127.0.0.1, rendezvous through gloo::rendezvous::FileStore in a directory
// every rank of the run shares.
//
// all_gather is gloo::allgather (what ProcessGroupGloo calls). Gloo has one dedicated
// reduce-scatter, ReduceScatterHalvingDoubling; it reduces in place in the input and
// leaves this rank's chunk at its start. It is built once per buffer and size, as Gloo
// intends (construction registers the buffers with every peer), and not timed; nor is
// the copy of the input a non-destructive API would need. Both favour Gloo.
#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <climits>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"

namespace bench {

class GlooRunner {
 public:
  GlooRunner(const std::string& store_dir, int rank, int size, std::chrono::milliseconds timeout) : rank_(rank) {
    guarded("rendezvous (file store '" + store_dir + "')", [&] {
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto device = gloo::transport::tcp::CreateDevice(attr);
      gloo::rendezvous::FileStore store(store_dir);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(timeout);
      context->connectFullMesh(store, device);
      context_ = std::move(context);
    });
  }

  int rank() const { return rank_; }
  int size() const { return context_->size; }

  void all_gather(const float* send, float* recv, std::size_t count) { gather(send, recv, count); }
  void all_gather_f64(const double* send, double* recv, std::size_t count) { gather(send, recv, count); }

  const float* reduce_scatter(float* send, float* /*recv*/, std::size_t count) {
    const std::size_t total = count * static_cast<std::size_t>(size());
    if (total > static_cast<std::size_t>(INT_MAX))
      fsdp::detail::fail("gloo reduce_scatter on rank ", rank_, ": ", total,
                         " elements exceed ReduceScatterHalvingDoubling's int count");
    guarded("reduce_scatter", [&] {
      if (!reduce_scatter_ || rs_buffer_ != send || rs_count_ != count) {
        reduce_scatter_.reset();  // its buffers' slots go before the new ones are registered
        reduce_scatter_ = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
            context_, std::vector<float*>{send}, static_cast<int>(total), std::vector<int>(size(), static_cast<int>(count)));
        rs_buffer_ = send;
        rs_count_ = count;
      }
      reduce_scatter_->run();
    });
    return send;
  }

  void barrier() {
    guarded("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      gloo::barrier(opts);
    });
  }

 private:
  template <class T>
  void gather(const T* send, T* recv, std::size_t count) {
    guarded("allgather", [&] {
      gloo::AllgatherOptions opts(context_);
      opts.setInput(const_cast<T*>(send), count);  // Gloo only reads it
      opts.setOutput(recv, count * static_cast<std::size_t>(size()));
      gloo::allgather(opts);
    });
  }

  // Gloo throws its own exception types; the benchmark reports fsdp::Error with the rank.
  template <class Fn>
  void guarded(const std::string& what, Fn&& fn) {
    try {
      fn();
    } catch (const gloo::Exception& e) {
      fsdp::detail::fail("gloo ", what, " on rank ", rank_, ": ", e.what());
    }
  }

  int rank_;
  std::shared_ptr<gloo::Context> context_;
  std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>> reduce_scatter_;
  const float* rs_buffer_ = nullptr;
  std::size_t rs_count_ = 0;
};

}  // namespace bench
