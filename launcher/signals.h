// The "save and stop" signals for the whole process: SIGTERM and SIGINT, and SIGUSR1 / SIGUSR2
// (what Slurm's --signal and Open MPI's mpirun forward to every rank without ending the job).
// The signals are blocked in every thread (OpenMP, oneDNN and MPI threads inherit the mask), and
// one watcher thread receives them with sigwait: during training it asks the loop to save a
// checkpoint and stop after the current step (the run then exits 0); otherwise, or on a second
// signal 2 s or more after the first (signals closer together are one stop arriving by several
// paths), the process exits at once with 128 + signal.
#pragma once

namespace dstrain::launcher {

// Call first thing in main, before any thread exists.
void install_stop_signals();

}  // namespace dstrain::launcher
