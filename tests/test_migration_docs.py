"""docs/migrating.md names only real config keys: every backticked name in a column whose
header says "yatt" is a field of the trainer's config (tests/trainer_config_fields.txt, the
list --help prints), given as `key` or `key=value`."""

NUM_GPUS = 0

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "migrating.md"
FIELDS = set((ROOT / "tests" / "trainer_config_fields.txt").read_text().split())


def yatt_cells(text: str) -> list[str]:
    """The cells of every table column headed "... yatt ...", row by row."""
    cells, columns = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            columns = None  # a table ends at its first non-table line
            continue
        row = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if columns is None:  # the header
            columns = [i for i, head in enumerate(row) if "yatt" in head]
        elif not set(line) <= set("|-: "):  # not the --- separator
            cells += [row[i] for i in columns if i < len(row)]
    return cells


def named_keys(cell: str) -> list[str]:
    return [span.partition("=")[0].strip() for span in re.findall(r"`([^`]+)`", cell)]


def test_every_yatt_key_the_page_names_is_a_config_field():
    cells = yatt_cells(PAGE.read_text())
    keys = [key for cell in cells for key in named_keys(cell)]
    assert len(keys) > 60  # the tables were found (TRL, verl, defaults, batch sizes)
    unknown = sorted({key for key in keys if key not in FIELDS})
    assert unknown == [], f"docs/migrating.md names keys the config does not have: {unknown}"


def test_the_checker_catches_a_misspelled_key():
    table = "| TRL | yatt key |\n|---|---|\n| `beta` | `loss.kl_coeff` |\n"
    assert named_keys(yatt_cells(table)[0]) == ["loss.kl_coeff"]
    assert "loss.kl_coeff" not in FIELDS and "loss.kl_coef" in FIELDS
