"""Command-line entry points (hal-probe, hal-bench, hal-scales); thin shims live in tools/."""
