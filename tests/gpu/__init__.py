"""The GPU checks (docs/gpu.md): a package, so that its conftest and modules keep their own names."""
