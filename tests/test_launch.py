"""Launch files work on a fresh clone: every path SLURM opens before the job starts already exists."""

import re
import subprocess

from tests.conftest import ROOT


def _exists_in_a_fresh_clone(folder) -> bool:
    """The submit directory (the repository root), or a folder holding files that git tracks."""
    if folder == ROOT:
        return True
    tracked = subprocess.run(["git", "ls-files", str(folder)], cwd=ROOT, capture_output=True, text=True).stdout
    return bool(tracked.strip())


def test_slurm_logs_go_to_a_folder_that_exists_before_the_job_runs():
    scripts = list((ROOT / "launch").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        paths = re.findall(r"^#SBATCH --(output|error)=(\S+)", script.read_text(), re.M)
        assert paths, script.name
        for key, path in paths:  # SLURM does not create folders
            assert _exists_in_a_fresh_clone((ROOT / path).parent), f"{script.name}: --{key}={path}"
