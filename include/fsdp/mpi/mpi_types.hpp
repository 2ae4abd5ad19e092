#pragma once
// fsdp dtypes and reduce ops as MPI datatypes and MPI_Ops, and MPI error codes as text.
// f16 and bf16 have no MPI type: each is a 2-byte contiguous datatype of its own, reduced
// by user ops that compute in float and round to the dtype (nearest even) after every
// step, exactly as detail::host_combine does on the host.
//
// The one fsdp header that includes <mpi.h>; the others get it from here. OpenMPI's mpi.h
// would also declare its deprecated C++ bindings, which need libmpi_cxx: skip them.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <string>

#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

// "MPI_ERR_TRUNCATE: message truncated".
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

// MPI_User_function for a 16-bit float dtype: inout[i] = inout[i] (op) in[i].
template <DType T, ReduceOp Op>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  host_combine(inout, in, static_cast<std::size_t>(*len), T, Op);
}

// Created after MPI_Init and freed before MPI_Finalize, by MpiRuntime.
class MpiTypes {
 public:
  void create() {
    f16_ = half_type("fsdp_f16");
    bf16_ = half_type("fsdp_bf16");
    // Commutative: IEEE addition, max and min are; MPI may then group the terms its own
    // way, as it does for MPI_SUM on MPI_FLOAT.
    MPI_Op_create(&half_reduce<DType::f16, ReduceOp::sum>, 1, &ops_[0][0]);
    MPI_Op_create(&half_reduce<DType::f16, ReduceOp::max>, 1, &ops_[0][1]);
    MPI_Op_create(&half_reduce<DType::f16, ReduceOp::min>, 1, &ops_[0][2]);
    MPI_Op_create(&half_reduce<DType::bf16, ReduceOp::sum>, 1, &ops_[1][0]);
    MPI_Op_create(&half_reduce<DType::bf16, ReduceOp::max>, 1, &ops_[1][1]);
    MPI_Op_create(&half_reduce<DType::bf16, ReduceOp::min>, 1, &ops_[1][2]);
  }
  void free() {
    for (auto& per_type : ops_)
      for (auto& op : per_type)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    if (f16_ != MPI_DATATYPE_NULL) MPI_Type_free(&f16_);
    if (bf16_ != MPI_DATATYPE_NULL) MPI_Type_free(&bf16_);
  }

  MPI_Datatype datatype(DType t) const {
    switch (t) {
      case DType::f32: return MPI_FLOAT;
      case DType::f64: return MPI_DOUBLE;
      case DType::f16: return f16_;
      case DType::bf16: return bf16_;
      case DType::i8: return MPI_INT8_T;
      case DType::u8: return MPI_UINT8_T;
      case DType::i32: return MPI_INT32_T;
      case DType::i64: return MPI_INT64_T;
      case DType::f8e4m3: case DType::f8e5m2: case DType::e8m0: return MPI_UINT8_T;  // moved as bytes
    }
    fail("MPI adapter: unknown dtype ", static_cast<int>(t));
  }

  // avg is refused: MpiComm reduces it as a sum and divides afterwards.
  MPI_Op op(DType t, ReduceOp op) const {
    const int slot = op == ReduceOp::sum ? 0 : op == ReduceOp::max ? 1 : op == ReduceOp::min ? 2 : -1;
    if (slot < 0) fail("MPI adapter: reduce op ", name_of(op), " has no MPI_Op (MpiComm sums, then divides)");
    if (is_half(t)) return ops_[t == DType::f16 ? 0 : 1][slot];
    if (t == DType::f8e4m3 || t == DType::f8e5m2)
      fail("MPI adapter: ", name_of(op), " of ", name_of(t), ": MpiComm has no 8-bit float arithmetic (it moves them; "
           "TcpComm, ThreadComm and NcclComm reduce them)");
    return slot == 0 ? MPI_SUM : slot == 1 ? MPI_MAX : MPI_MIN;
  }

 private:
  static MPI_Datatype half_type(const char* name) {
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(2, MPI_BYTE, &t);
    MPI_Type_set_name(t, name);
    MPI_Type_commit(&t);
    return t;
  }

  MPI_Datatype f16_ = MPI_DATATYPE_NULL;
  MPI_Datatype bf16_ = MPI_DATATYPE_NULL;
  MPI_Op ops_[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
};

}  // namespace fsdp::detail
