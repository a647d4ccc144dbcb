// Loads the NCCL communicator's plugin, libdstrain_nccl.so (nccl_communicator.cpp), on first use
// and forwards nccl_communicator.h to it. Looked for, in order: $DSTRAIN_NCCL_PLUGIN; the library
// directory beside the executable's (bin/../lib, where the build and the GPU bundle put it); the
// dynamic loader's search path. The handle is never closed.
#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <mutex>

#include "engine/comm/nccl_communicator.h"
#include "engine/comm/watchdog.h"
#include "engine/common/error.h"

namespace dstrain::comm {
namespace {

struct Plugin {
  std::string error;  // why it is not there
  Communicator* (*make)(Communicator*, void*, const char*, double, const NcclHooks*, std::string*) = nullptr;
  void (*version)(std::string*) = nullptr;
};

#if defined(DSTRAIN_NCCL_PLUGIN_NAME)
std::string beside_executable() {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "";
  std::string dir(self, size_t(n));
  dir = dir.substr(0, dir.rfind('/'));  // .../bin
  return dir.substr(0, dir.rfind('/')) + "/lib/" + DSTRAIN_NCCL_PLUGIN_NAME;
}
#endif

const Plugin& plugin() {
  static Plugin p;
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(DSTRAIN_NCCL_PLUGIN_NAME)
    std::string tried;
    void* handle = nullptr;
    const char* env = std::getenv("DSTRAIN_NCCL_PLUGIN");
    for (const std::string& path :
         {std::string(env ? env : ""), beside_executable(), std::string(DSTRAIN_NCCL_PLUGIN_NAME)}) {
      if (path.empty()) continue;
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle) break;
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why ? why : path.c_str());
    }
    if (!handle) {
      p.error = "the NCCL communicator's plugin could not be loaded (" + tried + ")";
      return;
    }
    const auto abi = reinterpret_cast<int (*)()>(dlsym(handle, "dstrain_nccl_plugin_abi"));
    p.make = reinterpret_cast<decltype(p.make)>(dlsym(handle, "dstrain_nccl_make_communicator"));
    p.version = reinterpret_cast<decltype(p.version)>(dlsym(handle, "dstrain_nccl_version"));
    if (!abi || !p.make || !p.version || abi() != kNcclPluginAbi) {
      p.error = std::string("the NCCL communicator's plugin is not this dstrain's (interface ") +
                (abi ? std::to_string(abi()) : "missing") + ", expected " + std::to_string(kNcclPluginAbi) + ")";
      p.make = nullptr, p.version = nullptr;
    }
#else
    p.error = "this build has no NCCL communicator (it is built with the CUDA backend where NCCL is found)";
#endif
  });
  return p;
}

}  // namespace

bool nccl_available(std::string* why) {
  const Plugin& p = plugin();
  if (!p.make && why) *why = p.error;
  return p.make != nullptr;
}

std::unique_ptr<Communicator> make_nccl_communicator(
    Communicator& bootstrap, void* compute_stream, std::string name, CommOptions options,
    std::function<void(const void*, std::shared_ptr<kernels::StreamUse>)> record_use) {
  const Plugin& p = plugin();
  if (!p.make) throw CommError("group " + name + ": " + p.error);
  NcclHooks hooks;
  hooks.record_use = std::move(record_use);
  hooks.watch = [](std::string what, double timeout_s, std::function<int(std::string*)> poll) {
    Watchdog::instance().add(std::move(what), timeout_s, std::move(poll));
  };
  std::string error;
  Communicator* c = p.make(&bootstrap, compute_stream, name.c_str(), options.timeout_s, &hooks, &error);
  if (!c) throw CommError(error);
  return std::unique_ptr<Communicator>(c);
}

std::string nccl_version() {
  const Plugin& p = plugin();
  std::string v;
  if (p.version) p.version(&v);
  return v;
}

}  // namespace dstrain::comm
