"""Compile tooling of the CUDA kernels (NVRTC compile check, PTX facts): development only, never
imported by the runtime (an import-linter contract holds that)."""
