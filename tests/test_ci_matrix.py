"""The emulation matrix lives in one file, ci/emulation-matrix.tsv, which both CI stages read; the README's table of
emulated runs must say the same (model -> variant, and the pytest subset)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEVELS = {"cpp": "C++ kernel tests", "python": "Python tests"}
COLUMNS = {"aarch64": 3, "ppc64le": 4}  # cells of a README table row: "", level, x86_64, aarch64, ppc64le, ""


def matrix_rows():
    for line in (ROOT / "ci" / "emulation-matrix.tsv").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            yield line.split()


def test_readme_table_matches_the_emulation_matrix():
    table = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        for stage, level in LEVELS.items():
            if line.startswith(f"| {level}"):
                table[stage] = line.split("|")
    rows = list(matrix_rows())
    assert {r[0] for r in rows} == set(LEVELS) and set(table) == set(LEVELS)
    for stage, arch, model, variant, subset in rows:
        cell = table[stage][COLUMNS[arch]]
        assert f"`{model}` → {variant}" in cell, (stage, arch, model, variant, cell)
        if stage == "python":
            assert subset in cell, (model, subset, cell)
    # and every model the README names for an arch is a row of the matrix
    for stage, cells in table.items():
        for arch, column in COLUMNS.items():
            named = set(re.findall(r"`([\w-]+)` →", cells[column]))
            assert named == {r[2] for r in rows if r[0] == stage and r[1] == arch}, (stage, arch, named)
