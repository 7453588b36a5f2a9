"""CUDA-graph capture: size policy and dummy-run capture (filled by the compiler issue)."""
