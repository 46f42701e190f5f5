// What the C++ benchmarks print about the machine and how they time: the CPU model (from
// /proc/cpuinfo, Linux) and the TSC's rate, calibrated against CLOCK_MONOTONIC. The Python
// benchmarks' counterpart is _machine.py.
#pragma once

#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>

namespace bench_machine {

// The CPU's model name, "unknown" where /proc/cpuinfo does not say.
inline std::string cpu_model() {
  std::ifstream info("/proc/cpuinfo");
  std::string line;
  while (std::getline(info, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// Whether /proc/cpuinfo lists `flag` (e.g. "avx512_bf16", "amx_tile") among the CPU's flags.
inline bool cpu_has(const std::string& flag) {
  std::ifstream info("/proc/cpuinfo");
  std::string line;
  while (std::getline(info, line))
    if (line.rfind("flags", 0) == 0) return (line + " ").find(" " + flag + " ") != std::string::npos;
  return false;
}

// CLOCK_MONOTONIC in seconds.
inline double seconds() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// TSC ticks per microsecond, over 100 ms of wall time.
inline double ticks_per_us() {
  const double t0 = seconds();
  const uint64_t c0 = __rdtsc();
  while (seconds() - t0 < 0.1) {
  }
  return static_cast<double>(__rdtsc() - c0) / ((seconds() - t0) * 1e6);
}

// Prints the CPU model, whether it has AVX512_BF16 and AMX tiles, and the TSC's rate (one
// line); false, with a line on stderr, where the CPU lacks `needed` (a /proc/cpuinfo flag).
inline bool announce(const std::string& needed) {
  std::printf("CPU: %s; avx512_bf16: %s, amx_tile: %s; TSC: %.0f ticks a microsecond\n", cpu_model().c_str(),
              cpu_has("avx512_bf16") ? "yes" : "no", cpu_has("amx_tile") ? "yes" : "no", ticks_per_us());
  if (cpu_has(needed)) return true;
  std::fprintf(stderr, "this CPU has no %s\n", needed.c_str());
  return false;
}

}  // namespace bench_machine
