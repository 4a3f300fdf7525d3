"""`ferry` and `python -m ferry`: the command line, loaded where a Ctrl-C during its second of
imports exits 130 with one line, as it does once a command runs."""

import sys


def main() -> None:
    try:
        from ferry.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
