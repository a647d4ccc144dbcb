// Errors of dstrain. Every failure that a user can cause (a config, a data file, a checkpoint,
// a launch with the wrong rank count) is reported as one of these, with a message that names
// the thing at fault, its value and what would be valid. The launcher prints the message on one
// line and exits non-zero on every rank; nothing catches and continues.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace dstrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad configuration: a YAML file, a --set override or a layout that does not fit the world size.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// An error every rank of the job raises at the same point of the run — a divergence seen in
// all-reduced losses, a checkpoint failure broadcast from rank 0 — so the ranks can agree on it
// and exit together. Any other error raised while the ranks are inside their collectives ends
// the job with MPI_Abort instead (launcher/main.cpp), since the other ranks cannot hear of it.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// A failed MPI (later NCCL) call or a communicator that does not match the plan.
class CommError : public Error {
 public:
  using Error::Error;
};

}  // namespace dstrain

// Internal invariant: a failure is a bug in dstrain, reported with file:line.
#define DS_CHECK(cond, ...)                                                               \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw ::dstrain::Error(fmt::format("{}:{}: internal check failed: {}: {}", __FILE__, \
                                         __LINE__, #cond, fmt::format(__VA_ARGS__)));     \
  } while (0)
