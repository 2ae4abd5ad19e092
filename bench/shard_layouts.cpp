// What each shard layout (fsdp::ShardOptions::shard_layout) costs in memory, against the
// element-flat layout of the same parameters in the same run: the per-rank shard (the
// largest rank's, which sizes every rank's) against an even split, and the padded elements
// that every all-gather moves and every gather buffer holds. Computed from the layouts
// themselves (fsdp::FlatParamLayout), no training: the parameter lists of the example's
// model, wrapped as examples/train wraps it (one unit per block) and with its blocks in one
// unit, and of GPT-2 small (n_embd 768, 4x MLP, vocabulary 50257, context 1024), one unit
// per block, 12 and 24 blocks in one unit, and the whole model in one.
//
//   bazel run -c opt //bench:shard_layouts            (-- --json for one JSON object per row)
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fsdp/core/flat_param.hpp>

#include "examples/engine/model.hpp"

namespace {

using Unit = std::vector<std::int64_t>;  // its parameters' element counts, in order

struct Model {
  std::string name;
  std::vector<Unit> units;
};

// The example's model with examples/train's defaults, one unit per block (the root: embed
// and head; the gain its own), or with the blocks in one unit.
Model example_model(bool blocks_in_one) {
  engine::ModelConfig c;
  c.in = 16, c.dim = 64, c.hidden = 256, c.out = 4, c.blocks = 8;  // examples/train's defaults
  engine::Model model(c);
  Unit root, blocks, gain;
  std::vector<Unit> per_block(static_cast<std::size_t>(c.blocks));
  for (const auto& p : engine::named_parameters(model)) {
    const std::int64_t n = p.param->numel();
    if (p.fqn.starts_with("blocks.")) {
      const auto i = std::stoul(p.fqn.substr(7));
      per_block[i].push_back(n);
      blocks.push_back(n);
    } else if (p.fqn.starts_with("gain.")) {
      gain.push_back(n);
    } else {
      root.push_back(n);
    }
  }
  Model m{blocks_in_one ? "example, 8 blocks in one unit" : "example, one unit per block", {root}};
  if (blocks_in_one) m.units.push_back(blocks);
  else m.units.insert(m.units.end(), per_block.begin(), per_block.end());
  m.units.push_back(gain);
  return m;
}

// GPT-2 small's parameters (Hugging Face's names in order): a block's ln_1, attention
// (qkv 768x2304, projection 768x768), ln_2, MLP (768x3072, 3072x768), weights then biases.
Unit gpt2_block() {
  const std::int64_t d = 768;
  return {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d};
}
Model gpt2(const std::string& name, int blocks, bool blocks_in_one, bool embeddings_in_one) {
  const std::int64_t d = 768;
  const Unit embeddings{50257 * d, 1024 * d, d, d};  // wte, wpe, ln_f
  Model m{name, {}};
  Unit all = embeddings_in_one ? embeddings : Unit{};
  for (int b = 0; b < blocks; ++b) {
    const Unit u = gpt2_block();
    if (blocks_in_one || embeddings_in_one) all.insert(all.end(), u.begin(), u.end());
    else m.units.push_back(u);
  }
  if (!all.empty()) m.units.push_back(all);
  return m;
}

struct Cost {
  std::int64_t shard = 0;     // per rank: the sum of the units' shard_numel()
  std::int64_t padded = 0;    // the sum of the units' padded_numel(): what the all-gathers move
  std::int64_t elements = 0;  // the parameters' own elements
};

Cost cost_of(const Model& m, int ranks, fsdp::ShardLayout layout) {
  Cost c;
  for (const Unit& u : m.units) {
    std::vector<fsdp::ParamInfo> params;
    for (std::size_t i = 0; i < u.size(); ++i)
      params.push_back({.fqn = "p" + std::to_string(i), .shape = {u[i]}, .numel = u[i], .offset = 0, .aliases = {}});
    const fsdp::FlatParamLayout L(fsdp::DType::f32, std::move(params), ranks, layout);
    c.shard += L.shard_numel();
    c.padded += L.padded_numel();
    c.elements += L.param_numel();
  }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Memory cost of each shard layout against element-flat, per parameter list and rank count"};
  bool json = false;
  app.add_flag("--json", json, "one JSON object per row instead of the table");
  CLI11_PARSE(app, argc, argv);

  const std::vector<Model> models{example_model(false), example_model(true),
                                  gpt2("GPT-2 small, one unit per block", 12, false, false),
                                  gpt2("GPT-2 small, 12 blocks in one unit", 12, true, false),
                                  gpt2("GPT-2 small, 24 blocks in one unit", 24, true, false),
                                  gpt2("GPT-2 small, all in one unit (embeddings too)", 12, true, true)};
  const std::vector<fsdp::ShardLayout> layouts{fsdp::ShardLayout::element_flat(), fsdp::ShardLayout::block_aligned(128),
                                               fsdp::ShardLayout::param_atomic(), fsdp::ShardLayout::param_atomic(128)};
  if (!json) {
    fmt::print("| parameters | ranks | layout | per-rank shard (elements) | vs an even split | padded (all-gather) vs flat |\n");
    fmt::print("|---|---:|---|---:|---:|---:|\n");
  }
  for (const Model& m : models)
    for (int ranks : {4, 8}) {
      const Cost flat = cost_of(m, ranks, fsdp::ShardLayout::element_flat());
      for (const auto& layout : layouts) {
        const Cost c = cost_of(m, ranks, layout);
        const double even = static_cast<double>(c.elements) / ranks;  // the parameters split evenly, no padding
        const double balance = static_cast<double>(c.shard) / even;
        const double padded = static_cast<double>(c.padded) / static_cast<double>(flat.padded);
        if (json)
          fmt::print("{}\n", nlohmann::json{{"parameters", m.name}, {"ranks", ranks}, {"layout", fsdp::name_of(layout)},
                                            {"shard", c.shard}, {"balance", balance}, {"padded_vs_flat", padded}}
                                 .dump());
        else
          fmt::print("| {} | {} | {} | {} | {:.3f} | {:.3f} |\n", m.name, ranks, fsdp::name_of(layout), c.shard, balance,
                     padded);
      }
    }
  return 0;
}
