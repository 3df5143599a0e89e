# aarch64 ISA variants: none yet, so this arch builds the portable reference variant only.
