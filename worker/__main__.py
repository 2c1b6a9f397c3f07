import argparse
import sys

from ttserve.logs import setup_logging

from .config import add_arguments, parse_args, run

parser = argparse.ArgumentParser(prog="ttserve worker", description="ttserve device worker")
add_arguments(parser)
setup_logging()
sys.exit(run(parse_args(parser)))
