"""Opt-in compatibility shims that expose w8a8_cpu under other projects' op names (see compat.sglang)."""
