"""Placeholder until this command is built; replaced by its owner."""

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=lambda args: 2)
