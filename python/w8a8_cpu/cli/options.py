"""Option types shared by every command: a bad value is an argparse error (usage, exit 2) before any work starts."""
from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """An int >= 1 (thread counts, token counts, repetitions)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def output_file(text: str) -> str:
    """A file the run will write at its end: its folder must exist and be writable now, so that a long run does not
    end by losing its results."""
    folder = os.path.dirname(os.path.abspath(text)) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} is not writable")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    return text
