"""``python -m asyncckpt``: the command-line tool (see :mod:`asyncckpt.cli`)."""

from __future__ import annotations

from asyncckpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
