"""Argument definitions for `hotstart bench ...` and `hotstart make-model` (argparse only: stays light)."""

from __future__ import annotations

import argparse


def add_bench_commands(sub) -> None:
    sub.add_parser("bench", help="benchmarks (startup, serve)")
    sub.add_parser("make-model", help="write a random-weight checkpoint with real architecture shapes")


def run_bench_command(args: argparse.Namespace) -> int:
    raise SystemExit("hotstart: error: not implemented yet")
