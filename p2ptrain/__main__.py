"""``python -m p2ptrain``: the ``p2ptrain`` command."""

from p2ptrain.app.cli import console_main

if __name__ == "__main__":
    console_main()
