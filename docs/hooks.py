"""mkdocs hook: serve the plots of experiments/results/ at experiments/results/<name>.png.

The plots stay where the experiments write them (nothing is copied into docs/): ``on_files`` adds each PNG to the
site's files with the repository root as its source directory, so a page in docs/ embeds
``experiments/results/NAME.png`` and `mkdocs build --strict` checks that the file exists like any other link.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = "experiments/results"


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).resolve().parent
    for png in sorted((root / RESULTS).glob("*.png")):
        files.append(File(f"{RESULTS}/{png.name}", src_dir=str(root), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files
