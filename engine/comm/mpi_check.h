// Every MPI call goes through DS_MPI_CHECK: a failure throws CommError with file:line, the call
// and MPI's own error text (the world communicator is set to MPI_ERRORS_RETURN for this).
#pragma once

#include <mpi.h>

#include <string>

#include "engine/common/error.h"

namespace dstrain::comm {

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, len);
}

}  // namespace dstrain::comm

#define DS_MPI_CHECK(call)                                                                 \
  do {                                                                                     \
    const int ds_mpi_rc_ = (call);                                                         \
    if (ds_mpi_rc_ != MPI_SUCCESS)                                                         \
      throw ::dstrain::CommError(fmt::format("{}:{}: {} failed: {}", __FILE__, __LINE__, #call, \
                                             ::dstrain::comm::mpi_error_text(ds_mpi_rc_)));  \
  } while (0)
