// SIGTERM / SIGINT handling for the whole process. The signals are blocked in every thread
// (OpenMP, oneDNN and MPI threads inherit the mask), and one watcher thread receives them with
// sigwait: during training it asks the loop to save a checkpoint and stop after the current step;
// otherwise, or on a second signal, the process exits at once with 128 + signal.
#pragma once

namespace dstrain::launcher {

// Call first thing in main, before any thread exists.
void install_stop_signals();

}  // namespace dstrain::launcher
