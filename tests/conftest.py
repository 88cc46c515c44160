import os

pytest_plugins = ["warmgate_devcluster.pytest_plugin"]

# Models load from local folders only; nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    # A SIGTERM (a CI timeout, `kill`) would end pytest without tearing fixtures down, leaving the
    # devcluster and pod processes running; turn it into an interrupt, which pytest tears down.
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
