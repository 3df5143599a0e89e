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


def output_folder_parent(text: str) -> str:
    """A folder the run will create or fill: its parent must exist and be writable now, and it must not be a file."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.isdir(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text
