# What each part of fsdp needs, found through the dependencies' own CMake packages. Used by
# the top-level CMakeLists.txt (which parts to build) and by the installed fsdpConfig.cmake
# (the same finds on the user's machine), so that both agree.
#
#   fsdp_find_dependencies(<part> <missing-var>)
#
# Finds what <part> needs (quietly) and sets <missing-var> to the list of what was not found,
# each entry naming the CMake package and the Debian package that provides it; empty when
# everything was found. Parts: core, checkpoint, asio, mpi, cuda, nccl, separate. The imported
# targets the parts link (Threads::Threads, nlohmann_json::nlohmann_json, xxHash::xxhash,
# Boost::headers, MPI::MPI_CXX, CUDA::cudart, CUDA::nvrtc, NCCL::nccl) exist after a call
# that leaves <missing-var> empty.
#
# xxHash and NCCL ship no CMake package on Debian or with the CUDA toolkit: xxHash is taken
# from its own CMake package when there is one (an xxHash built with CMake) and otherwise
# from its header, NCCL from its header and library next to the CUDA toolkit's (NCCL_ROOT or
# CUDAToolkit_ROOT or /usr/local/cuda point there); both become imported targets here.
# Parts whose dependencies are found here, in the order they are built and loaded.
# torch: the libtorch adapter (fsdp::torch, find_package(Torch)) goes here once it exists.
set(FSDP_KNOWN_COMPONENTS checkpoint asio mpi cuda nccl separate)

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
