// What header_warnings_test.sh compiles (-fsyntax-only, -Werror) besides each header on its
// own: the library's templates instantiated the way an engine instantiates them (the
// reference engine of examples/engine), so that a warning inside a template body shows. A
// header alone instantiates nothing. Never run; it only has to compile clean.
#include <filesystem>
#include <span>

#include <fsdp/checkpoint/checkpoint.hpp>
#include <fsdp/comm/async_communicator.hpp>
#include <fsdp/core/trace_json.hpp>
#include <fsdp/fsdp.hpp>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"

namespace {

const engine::ModelConfig kConfig{.in = 4, .dim = 8, .hidden = 16, .out = 2, .blocks = 2, .seed = 1};

// One rank's training: shard, steps (plain, fp16 with the scaler, micro-batches, clipping),
// optimizer in backward, a sharded and a full checkpoint saved and loaded, summon.
template <class Precision, class Offload>
void train(fsdp::ThreadComm& comm, const std::filesystem::path& dir) {
  fsdp::Trace trace(comm.rank());
  fsdp::AsyncCommunicator stream(comm, &trace);
  fsdp::CountingCommunicator counted(stream);
  fsdp::DeviceMesh mesh(counted, {1, comm.size()});
  engine::Model model(kConfig);
  fsdp::HostDevice device;
  fsdp::ShardedModel sharded = fsdp::shard<fsdp::FullShard, Precision, Offload>(model, mesh, device, engine::Wrap{});
  sharded.set_trace(&trace);
  engine::DeviceAllocator<fsdp::HostDevice> alloc(device, fsdp::MemorySpace::host);
  engine::AdamW adamw(engine::AdamW::Options{}, alloc);
  engine::AdamWState state(adamw, sharded);
  fsdp::ShardedGradScaler scaler(stream, device);
  const auto batch = engine::make_batch(kConfig, 0, comm.rank() * 2, 2);
  engine::sharded_step(model, sharded, adamw, batch, [&] { fsdp::clip_grad_norm(sharded, mesh, device, {.max_norm = 1.0}); });
  engine::sharded_scaled_step(model, sharded, adamw, scaler, std::span<const engine::Batch>(&batch, 1));
  fsdp::save_sharded_checkpoint(dir / "sharded", sharded, &state);
  fsdp::load_sharded_checkpoint(dir / "sharded", sharded, &state);
  fsdp::AsyncCheckpointer checkpointer(sharded, &state);
  checkpointer.save_sharded(dir / "async", {});
  checkpointer.wait();
  {
    engine::OptimizerInBackward<engine::Sgd> inside(sharded, [] { return std::make_unique<engine::Sgd>(0.1f); });
    engine::sharded_forward_backward(model, sharded, batch);
  }
  fsdp::save_full_checkpoint(dir / "full.safetensors", sharded, &state);
  fsdp::load_full_checkpoint(dir / "full.safetensors", sharded, &state);
  engine::gather_full_parameters(model, sharded);
  fsdp::write_chrome_json(trace, (dir / "trace.json").string());
}

}  // namespace

int main() {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    train<fsdp::FullPrecision, fsdp::NoOffload>(comm, "/tmp/a");
    train<fsdp::MixedPrecision<fsdp::bf16>, fsdp::OffloadParams>(comm, "/tmp/b");
    train<fsdp::MixedPrecision<fsdp::f16, float>, fsdp::NoOffload>(comm, "/tmp/c");
  });
}
