"""Helpers shared by test modules (tests/ is on sys.path: `from helpers.cli import ...`)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout's root
