#pragma once
// The benchmark's Runner (see measure.hpp) over any fsdp::Communicator: thread, TCP, MPI.
#include <cstddef>

#include "fsdp/core/communicator.hpp"

namespace bench {

template <fsdp::Communicator C>
class FsdpRunner {
 public:
  explicit FsdpRunner(C& comm) : comm_(comm) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  void all_gather(const float* send, float* recv, std::size_t count) {
    comm_.all_gather(send, recv, count, fsdp::DType::f32).wait();
  }
  const float* reduce_scatter(float* send, float* recv, std::size_t count) {
    comm_.reduce_scatter(send, recv, count, fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
    return recv;
  }
  void barrier() { comm_.barrier().wait(); }
  void all_gather_f64(const double* send, double* recv, std::size_t count) {
    comm_.all_gather(send, recv, count, fsdp::DType::f64).wait();
  }

 private:
  C& comm_;
};

}  // namespace bench
