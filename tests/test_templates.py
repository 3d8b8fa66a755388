"""The project's templates live in templates/ at the top of the tree (the design card's layout),
are found through TEMPLATES['DIRS'], and ship inside the installed package."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from django.template import engines
from django.template.loader import get_template

ROOT = Path(__file__).resolve().parent.parent
PROJECT_TEMPLATES = ("scheduler/dashboard.html", "scheduler/login.html")


def test_project_templates_come_from_the_top_level_directory_through_dirs():
    dirs = [Path(d).resolve() for d in engines["django"].engine.dirs]
    assert (ROOT / "templates").resolve() in dirs
    for name in PROJECT_TEMPLATES:
        assert Path(get_template(name).origin.name).resolve() == (ROOT / "templates" / name).resolve()


@pytest.mark.slow
def test_the_wheel_carries_the_templates(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("telemachus-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"telemachus/templates/{name}" for name in PROJECT_TEMPLATES} <= names
