# What each part of fsdp needs, found through the dependencies' own CMake packages. Used by
# the top-level CMakeLists.txt (which parts to build) and by the installed fsdpConfig.cmake
# (the same finds on the user's machine), so that both agree.
#
#   fsdp_find_dependencies(<part> <missing-var>)
#
# Finds what <part> needs (quietly) and sets <missing-var> to the list of what was not found,
# each entry naming the CMake package and the Debian package that provides it; empty when
# everything was found. Parts: core, checkpoint, asio, mpi, cuda, nccl, torch, separate. The
# imported targets the parts link (Threads::Threads, nlohmann_json::nlohmann_json,
# xxHash::xxhash, Boost::headers, MPI::MPI_CXX, CUDA::cudart, CUDA::nvrtc, NCCL::nccl,
# Torch::Torch) exist after a call that leaves <missing-var> empty.
#
# xxHash and NCCL ship no CMake package on Debian or with the CUDA toolkit: xxHash is taken
# from its own CMake package when there is one (an xxHash built with CMake) and otherwise
# from its header, NCCL from its header and library next to the CUDA toolkit's (NCCL_ROOT or
# CUDAToolkit_ROOT or /usr/local/cuda point there); both become imported targets here.
# libtorch's CMake package (TorchConfig.cmake) defines variables (TORCH_LIBRARIES,
# TORCH_INCLUDE_DIRS, TORCH_CXX_FLAGS) and unnamespaced targets (torch, c10, ...) rather than
# one target to link; Torch::Torch, made here, carries all three (see _fsdp_find_torch).
# Parts whose dependencies are found here, in the order they are built and loaded (a part
# comes after the part it needs: nccl after cuda, torch after checkpoint).
set(FSDP_KNOWN_COMPONENTS checkpoint asio mpi cuda nccl torch separate)

function(fsdp_find_dependencies part out)
  set(missing "")
  if(part STREQUAL "core" OR part STREQUAL "separate")
    if(NOT TARGET Threads::Threads)
      set(THREADS_PREFER_PTHREAD_FLAG ON)
      find_package(Threads QUIET)
    endif()
    if(NOT TARGET Threads::Threads)
      list(APPEND missing "Threads (the system's threads library)")
    endif()
  elseif(part STREQUAL "checkpoint")
    if(NOT TARGET nlohmann_json::nlohmann_json)
      find_package(nlohmann_json 3.2 CONFIG QUIET)
    endif()
    if(NOT TARGET nlohmann_json::nlohmann_json)
      list(APPEND missing "nlohmann_json >= 3.2 (CMake package nlohmann_json, Debian: nlohmann-json3-dev)")
    endif()
    _fsdp_find_xxhash()
    if(NOT TARGET xxHash::xxhash)
      list(APPEND missing "xxHash (xxhash.h, Debian: libxxhash-dev, or set xxHash_ROOT)")
    endif()
  elseif(part STREQUAL "asio")
    # Boost.Asio and Boost.Interprocess are header-only (Boost.System too since 1.69); Asio's
    # io_context needs 1.66. Boost.Interprocess's shm_open is in libc from glibc 2.34 on.
    if(NOT TARGET Boost::headers)
      find_package(Boost 1.66 CONFIG QUIET)  # Boost's own package (1.70 and later)
    endif()
    if(NOT TARGET Boost::headers)
      find_package(Boost 1.66 QUIET)  # CMake's FindBoost, for older Boosts
    endif()
    if(NOT TARGET Boost::headers)
      list(APPEND missing "Boost >= 1.66 headers (CMake package Boost, Debian: libboost-dev)")
    endif()
  elseif(part STREQUAL "mpi")
    if(NOT TARGET MPI::MPI_CXX)
      find_package(MPI QUIET COMPONENTS CXX)
    endif()
    if(NOT TARGET MPI::MPI_CXX)
      list(APPEND missing "MPI with C++ (CMake's FindMPI, component CXX, Debian: libopenmpi-dev)")
    endif()
  elseif(part STREQUAL "cuda" OR part STREQUAL "nccl")
    if(NOT TARGET CUDA::cudart OR NOT TARGET CUDA::nvrtc)
      find_package(CUDAToolkit QUIET)
    endif()
    if(NOT TARGET CUDA::cudart OR NOT TARGET CUDA::nvrtc)
      list(APPEND missing "CUDA toolkit with cudart and nvrtc (CMake's FindCUDAToolkit, set CUDAToolkit_ROOT, e.g. /usr/local/cuda)")
    elseif(part STREQUAL "nccl")
      _fsdp_find_nccl()
      if(NOT TARGET NCCL::nccl)
        list(APPEND missing "NCCL (nccl.h and libnccl next to the CUDA toolkit, or set NCCL_ROOT)")
      endif()
    endif()
  elseif(part STREQUAL "torch")
    _fsdp_find_torch()
    if(NOT TARGET Torch::Torch)
      list(APPEND missing "Torch (libtorch's CMake package TorchConfig.cmake, Debian: libtorch-dev, or set Torch_DIR)")
    endif()
  else()
    list(JOIN FSDP_KNOWN_COMPONENTS ", " known)
    list(APPEND missing "a part named '${part}', which fsdp does not have (parts: core, ${known})")
  endif()
  set(${out} "${missing}" PARENT_SCOPE)
endfunction()

# xxHash::xxhash: upstream's CMake package if installed, else xxhash.h (fsdp uses xxHash
# header-only, XXH_INLINE_ALL, so no library is linked).
function(_fsdp_find_xxhash)
  if(TARGET xxHash::xxhash)
    return()
  endif()
  find_package(xxHash 0.8 CONFIG QUIET)
  if(TARGET xxHash::xxhash)
    return()
  endif()
  find_path(FSDP_XXHASH_INCLUDE_DIR xxhash.h
    HINTS ${xxHash_ROOT} ENV xxHash_ROOT
    PATH_SUFFIXES include
    DOC "Directory holding xxhash.h (fsdp::checkpoint)")
  mark_as_advanced(FSDP_XXHASH_INCLUDE_DIR)
  if(FSDP_XXHASH_INCLUDE_DIR)
    add_library(xxHash::xxhash INTERFACE IMPORTED)
    set_target_properties(xxHash::xxhash PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${FSDP_XXHASH_INCLUDE_DIR}")
  endif()
endfunction()

# NCCL::nccl: nccl.h and libnccl, looked for under NCCL_ROOT, then next to the CUDA
# toolkit found by FindCUDAToolkit, then /usr/local/cuda; links CUDA::cudart.
function(_fsdp_find_nccl)
  if(TARGET NCCL::nccl)
    return()
  endif()
  set(hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR}
    /usr/local/cuda)
  find_path(FSDP_NCCL_INCLUDE_DIR nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} ${hints}
    PATH_SUFFIXES include
    DOC "Directory holding nccl.h (fsdp::nccl)")
  find_library(FSDP_NCCL_LIBRARY nccl
    HINTS ${CUDAToolkit_LIBRARY_DIR} ${hints}
    PATH_SUFFIXES lib64 lib
    DOC "libnccl (fsdp::nccl)")
  mark_as_advanced(FSDP_NCCL_INCLUDE_DIR FSDP_NCCL_LIBRARY)
  if(FSDP_NCCL_INCLUDE_DIR AND FSDP_NCCL_LIBRARY)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES
      IMPORTED_LOCATION "${FSDP_NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${FSDP_NCCL_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES CUDA::cudart)
  endif()
endfunction()

# Torch::Torch: libtorch as one imported target, from its CMake package (find_package(Torch):
# TorchConfig.cmake, Debian's in /usr/lib/<arch>/cmake/Torch; a pip or downloaded libtorch's
# through Torch_DIR or CMAKE_PREFIX_PATH). The package sets TORCH_LIBRARIES (its own
# targets torch and torch_library, and libc10), TORCH_INCLUDE_DIRS (the include root and
# torch/csrc/api/include, the C++ frontend's <torch/torch.h>) and TORCH_CXX_FLAGS (the
# -D_GLIBCXX_USE_CXX11_ABI=0|1 that libtorch was built with, which every file that includes
# its headers must agree with); Torch::Torch links, includes (as system headers: libtorch's
# warnings are not ours) and compiles with all three. Its targets bring the compile
# definitions libtorch's types depend on (USE_DISTRIBUTED, ...), as Bazel's @torch does.
function(_fsdp_find_torch)
  if(TARGET Torch::Torch)
    return()
  endif()
  find_package(Torch QUIET)
  if(NOT Torch_FOUND OR NOT TORCH_LIBRARIES)
    return()
  endif()
  # libtorch's targets name each other in generator expressions
  # ($<TARGET_PROPERTY:torch_cpu,...> in torch_cpu_library, $<TARGET_FILE:torch> in
  # torch_library), which are evaluated where a program links them: from another directory
  # (fsdp as a subproject: add_subdirectory, FetchContent) they would not be found, as
  # imported targets are visible only in their own directory and below. Those created here
  # become global (a target created in a parent directory is visible to it already).
  foreach(target IN ITEMS c10 torch_cpu torch_cpu_library torch torch_library)
    if(TARGET ${target})
      get_target_property(global ${target} IMPORTED_GLOBAL)
      get_target_property(dir ${target} SOURCE_DIR)
      if(NOT global AND dir STREQUAL CMAKE_CURRENT_SOURCE_DIR)
        set_property(TARGET ${target} PROPERTY IMPORTED_GLOBAL TRUE)
      endif()
    endif()
  endforeach()
  add_library(Torch::Torch INTERFACE IMPORTED)
  target_include_directories(Torch::Torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
  separate_arguments(flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(Torch::Torch INTERFACE ${flags})
  target_link_libraries(Torch::Torch INTERFACE ${TORCH_LIBRARIES})
endfunction()
