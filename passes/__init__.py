"""FX passes run by the compiled_spec torch.compile backend (filled by the compiler issue)."""
