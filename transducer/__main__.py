"""``python -m transducer [NAME ...]``: each public entry's signature and docstring ``Args`` section as the source must
spell them (transducer/entries.py), for NAME or for every declared entry."""

import sys

from .entries import DECLARED, args_section, signature_source


def main(names):
    for name in names or sorted(DECLARED):
        if name not in DECLARED:
            raise SystemExit(f"{name}: not a declared entry; expected one of {', '.join(sorted(DECLARED))}")
        entry = DECLARED[name]
        print(signature_source(entry, method=name[0].isupper()))
        print(f"\n    Args:\n{args_section(entry)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
