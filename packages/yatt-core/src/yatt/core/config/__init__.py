"""The config family: a trainer's settings from YAML and the command line, typed and checked.

    _yaml       config text as YAML: duplicate keys, alias bombs and bad bytes refused, by line
    _cli        --config FILE, key.sub=value overrides, --help from field docs, one-line errors
    _from_dict  config dataclasses from plain dicts (unknown keys and wrong types refused)
    _describe   one --help line per field, from the comment beside it

It imports no other family (policy builds its config classes through it). Public names are
re-exported by `yatt.core`; import them from there.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
