"""Command-line entry points (hal-probe, hal-bench, hal-scales, hal-eval, hal-demo); thin shims live in tools/."""
