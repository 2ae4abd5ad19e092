// The emulated NVRTC: "compiling" keeps the program's text as the image (behind a marker
// line), so the emulated runtime loads only kernels the program really defines. Its
// version is 0.0, so no key of CudaDevice's on-disk kernel cache matches a real NVRTC's;
// and a program linked with the emulator never uses that cache (FSDP_KERNEL_CACHE=off is
// set before main), so an emulated image can never reach a real GPU's run.
#include <nvrtc.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "tools/cuda_emulator/state.hpp"

namespace cuda_emulator::detail {

extern const char kImageMagic[] = "fsdp CUDA runtime emulator image\n";

namespace {

constexpr int kArch = kComputeMajor * 10 + kComputeMinor;  // the emulated GPU's, the only one

struct Program {
  std::string source;
  std::string image;
  std::string log;
};

const bool cache_off = [] {
  setenv("FSDP_KERNEL_CACHE", "off", 1);
  return true;
}();

}  // namespace

}  // namespace cuda_emulator::detail

using cuda_emulator::detail::kArch;
using cuda_emulator::detail::Program;

extern "C" {

const char* nvrtcGetErrorString(nvrtcResult result) {
  switch (result) {
    case NVRTC_SUCCESS: return "NVRTC_SUCCESS (emulated)";
    case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT (emulated)";
    case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM (emulated)";
    case NVRTC_ERROR_INVALID_OPTION: return "NVRTC_ERROR_INVALID_OPTION (emulated)";
    case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION (emulated)";
    default: return "NVRTC error (emulated)";
  }
}
nvrtcResult nvrtcVersion(int* major, int* minor) {
  *major = 0;
  *minor = 0;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetNumSupportedArchs(int* n) {
  *n = 1;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetSupportedArchs(int* archs) {
  archs[0] = kArch;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char* src, const char*, int, const char* const*,
                               const char* const*) {
  if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
  *prog = reinterpret_cast<nvrtcProgram>(new Program{src, {}, {}});
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
  if (!prog) return NVRTC_ERROR_INVALID_PROGRAM;
  delete reinterpret_cast<Program*>(*prog);
  *prog = nullptr;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int num_options, const char* const* options) {
  auto* p = reinterpret_cast<Program*>(prog);
  if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
  const std::string sm = "--gpu-architecture=sm_" + std::to_string(kArch);
  const std::string compute = "--gpu-architecture=compute_" + std::to_string(kArch);
  bool arch = false;
  for (int i = 0; i < num_options; ++i) {
    const std::string_view o(options[i]);
    if (o == sm || o == compute) arch = true;
    else if (o.rfind("--gpu-architecture=", 0) == 0) return p->log = "emulated NVRTC: only " + sm, NVRTC_ERROR_INVALID_OPTION;
  }
  if (!arch) return p->log = "emulated NVRTC: no --gpu-architecture", NVRTC_ERROR_INVALID_OPTION;
  p->image = std::string(cuda_emulator::detail::kImageMagic) + p->source;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, std::size_t* size) {
  *size = reinterpret_cast<Program*>(prog)->log.size() + 1;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char* log) {
  const std::string& l = reinterpret_cast<Program*>(prog)->log;
  std::memcpy(log, l.c_str(), l.size() + 1);
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, std::size_t* size) {
  *size = reinterpret_cast<Program*>(prog)->image.size() + 1;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char* cubin) {
  const std::string& image = reinterpret_cast<Program*>(prog)->image;
  std::memcpy(cubin, image.c_str(), image.size() + 1);
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, std::size_t* size) { return nvrtcGetCUBINSize(prog, size); }
nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char* ptx) { return nvrtcGetCUBIN(prog, ptx); }

}  // extern "C"
