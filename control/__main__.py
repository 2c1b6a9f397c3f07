import argparse
import sys

from ttserve.logs import setup_logging

from .config import add_arguments, run

parser = argparse.ArgumentParser(prog="ttserve control", description="ttserve control plane")
add_arguments(parser)
setup_logging()
sys.exit(run(parser.parse_args()))
