"""Log set-up shared by every service: one line per event, with the service name."""
import logging
import os


def setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("TTSERVE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
