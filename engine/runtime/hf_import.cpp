#include "engine/runtime/hf_import.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "engine/common/checksum.h"
#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"
#include "engine/io/safetensors.h"
#include "engine/plan/param_table.h"
#include "engine/runtime/checkpoint.h"

namespace dstrain::runtime {
namespace fs = std::filesystem;
namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot be read", p.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Tensors written by other DeepSeek code that are not weights: the rotary tables some
// checkpoints of the original remote code carry.
bool not_a_weight(const std::string& name) {
  return name.size() >= 20 && name.compare(name.size() - 20, 20, "rotary_emb.inv_freq") == 0;
}

}  // namespace

HfImport import_hf_checkpoint(const std::string& hf_dir, const std::string& out) {
  const fs::path dir(hf_dir);
  if (!fs::is_directory(dir)) throw ConfigError(fmt::format("{}: not a directory (a Hugging Face model directory: "
                                                            "config.json and safetensors files)", hf_dir));
  const fs::path config_path = dir / "config.json";
  if (!fs::exists(config_path)) throw ConfigError(fmt::format("{}: no config.json", hf_dir));
  HfImport result;
  config::ModelConfig m = config::model_from_hf_config(read_text(config_path), config_path.string(),
                                                       &result.ignored_keys);
  if (fs::exists(out)) throw ConfigError(fmt::format("{} exists; valid: a new file path", out));

  // Which file holds each tensor.
  std::map<std::string, std::unique_ptr<io::SafetensorsFile>> files;
  std::map<std::string, std::pair<io::SafetensorsFile*, const io::SafetensorsEntry*>> where;
  const fs::path index_path = dir / "model.safetensors.index.json", single = dir / "model.safetensors";
  if (fs::exists(index_path)) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(read_text(index_path));
    } catch (const nlohmann::json::exception&) {
      throw ConfigError(fmt::format("{}: not valid JSON", index_path.string()));
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw ConfigError(fmt::format("{}: no weight_map object", index_path.string()));
    std::map<std::string, int64_t> named;  // file -> tensors the index puts in it
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        throw ConfigError(fmt::format("{}: tensor '{}' maps to {}, not a file name of the directory",
                                      index_path.string(), name, file.dump()));
      ++named[file.get<std::string>()];
    }
    for (const auto& [file, count] : named) {
      const fs::path p = dir / file;
      if (!fs::exists(p))
        throw ConfigError(fmt::format("{}: missing (model.safetensors.index.json names it for {} tensors)", p.string(),
                                      count));
      files[file] = std::make_unique<io::SafetensorsFile>(p.string());
    }
    for (const auto& [name, file] : index["weight_map"].items()) {
      io::SafetensorsFile* f = files[file.get<std::string>()].get();
      const io::SafetensorsEntry* e = f->find(name);
      if (!e)
        throw ConfigError(fmt::format("{}: holds no tensor '{}', which model.safetensors.index.json puts there",
                                      f->path(), name));
      where[name] = {f, e};
    }
  } else if (fs::exists(single)) {
    auto f = std::make_unique<io::SafetensorsFile>(single.string());
    for (const io::SafetensorsEntry& e : f->tensors()) where[e.name] = {f.get(), &e};
    files["model.safetensors"] = std::move(f);
  } else {
    throw ConfigError(fmt::format("{}: neither model.safetensors nor model.safetensors.index.json", hf_dir));
  }

  // FP8 weights (DeepSeek-V3's release: F8_E4M3 matrices with weight_scale_inv beside them).
  for (const auto& [name, loc] : where) {
    const bool scale = name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0;
    if (scale || loc.second->dtype.rfind("F8_", 0) == 0)
      throw ConfigError(fmt::format("{}: tensor '{}' ({}) belongs to FP8-quantized weights: dequantize them to bf16 "
                                    "first (DeepSeek's fp8_cast_bf16.py); dstrain imports F32, BF16 and F16 tensors",
                                    loc.first->path(), name, loc.second->dtype));
  }
  // transformers does not save the multi-token-prediction layers: without any of their tensors,
  // the model is imported without them.
  if (m.num_nextn_predict_layers > 0) {
    bool any = false;
    for (const plan::ParamInfo& p : plan::build_param_table(m))
      any = any || (p.layer >= m.num_hidden_layers && p.layer < m.num_hidden_layers + m.num_nextn_predict_layers &&
                    where.count(p.name));
    if (!any) {
      m.num_nextn_predict_layers = 0;
      result.mtp_dropped = true;
    }
  }
  const std::vector<plan::ParamInfo> table = plan::build_param_table(m);
  std::set<std::string> wanted;
  for (const plan::ParamInfo& p : table) wanted.insert(p.name);
  // DeepSeek's releases store the MTP layers' embedding and output head as copies of the main
  // ones (model.layers.61.embed_tokens / .shared_head.head); dstrain's MTP modules share them.
  // A copy is skipped when it equals the main tensor, refused when it does not.
  std::map<std::string, std::string> copies;  // copy -> the main tensor
  for (int64_t d = 0; d < m.num_nextn_predict_layers; ++d) {
    const std::string p = fmt::format("model.layers.{}.", m.num_hidden_layers + d);
    copies[p + "embed_tokens.weight"] = "model.embed_tokens.weight";
    copies[p + "shared_head.head.weight"] = "lm_head.weight";
  }
  for (const auto& [copy, main] : copies) {
    const auto c = where.find(copy), w = where.find(main);
    if (c == where.end() || w == where.end()) continue;
    if (c->second.second->shape != w->second.second->shape ||
        c->second.first->read_f32(*c->second.second) != w->second.first->read_f32(*w->second.second))
      throw ConfigError(fmt::format("{}: tensor '{}' differs from '{}', which dstrain's MTP modules share",
                                    c->second.first->path(), copy, main));
    wanted.insert(copy);  // (checked, not imported)
  }
  for (const auto& [name, loc] : where)
    if (!wanted.count(name) && !not_a_weight(name))
      throw ConfigError(fmt::format("{}: tensor '{}' is not part of the model config.json describes (another "
                                    "architecture, or a config.json that does not match the weights)",
                                    loc.first->path(), name));
  for (const plan::ParamInfo& p : table) {
    const auto it = where.find(p.name);
    if (it == where.end())
      throw ConfigError(fmt::format("{}: no file holds tensor '{}', which the model config.json describes needs",
                                    hf_dir, p.name));
    if (it->second.second->shape != p.shape)
      throw ConfigError(fmt::format("{}: tensor '{}' is [{}], config.json's model makes it [{}]",
                                    it->second.first->path(), p.name, fmt::join(it->second.second->shape, ", "),
                                    fmt::join(p.shape, ", ")));
  }

  // The checkpoint: weights only, at step 0, with the imported model as its config.
  config::TrainConfig cfg =
      config::load_config_text("train_batch_size: 1\ntrain_micro_batch_size_per_gpu: 1\nseq_length: 1\n", out);
  cfg.model = m;
  const std::string tmp = out + ".tmp";
  struct Cleanup {
    std::string path;
    bool done = false;
    ~Cleanup() {
      std::error_code ec;
      if (!done) fs::remove(path, ec);
    }
  } cleanup{tmp};
  {
    io::H5File f(tmp, io::H5File::Mode::kCreate);
    std::set<std::string> dtypes;
    for (const plan::ParamInfo& p : table) {
      const auto [file, entry] = where.at(p.name);
      dtypes.insert(entry->dtype);
      const std::vector<float> data = file->read_f32(*entry);
      for (size_t i = 0; i < data.size(); ++i)
        if (!std::isfinite(data[i]))
          throw ConfigError(fmt::format("{}: tensor '{}' holds {} at element {}", file->path(), p.name, data[i], i));
      write_checkpoint_tensor(f, "model/" + p.name, data.data(), p.shape);
      ++result.tensors;
      result.bytes += 4.0 * double(data.size());
    }
    result.dtypes.assign(dtypes.begin(), dtypes.end());
    f.set_attr("format", std::string("dstrain-checkpoint"));
    f.set_attr("format_version", double(kCheckpointFormatVersion));
    f.set_attr("weights_only", 1.0);
    f.set_attr("source", "Hugging Face " + fs::absolute(dir).lexically_normal().string());
    f.set_attr("step", 0.0);
    f.set_attr("tokens_seen", 0.0);
    f.set_attr("samples_seen", 0.0);
    f.set_attr("lr_last_batch_iteration", -1.0);
    f.set_attr("loss_scale", 1.0);
    f.set_attr("seed", 0.0);
    f.set_attr("data_tokenizer", std::string());  // (not checked at a resume)
    f.set_attr("data_vocab_size", 0.0);
    f.set_attr("optimizer", std::string("none (weights only)"));
    f.set_attr("layout", std::string("imported (full tensors)"));
    f.set_attr("config_yaml", config::to_yaml(cfg));
    f.set_attr("hf_config", config::to_hf_config_json(m));
    f.set_attr(kAttributesChecksumAttr, hex64(attributes_digest(f)));
    f.close();
  }
  io::fsync_path(tmp);
  fs::rename(tmp, out);
  cleanup.done = true;
  result.model = m;
  return result;
}

}  // namespace dstrain::runtime
