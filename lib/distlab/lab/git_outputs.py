"""Running a notebook never dirties the git tree: outputs stay on disk, out of git's view.

JupyterLab saves a notebook's outputs into its .ipynb (that is how a reload shows them again),
and the .ipynb files are tracked, so one Run All used to leave every notebook "modified". This
installs a git *clean filter* in the checkout (nbstripout's, a git mechanism: git passes every
tracked .ipynb through it before comparing or committing), so git sees each notebook without
outputs, execution counts and the metadata the kernel adds, exactly as committed; the file on
disk keeps its outputs for the next reload. A change to a cell's source still shows as a change.

A filter alone leaves `git status` listing a saved notebook (git sees the file's size change
and does not look further; `git diff` shows nothing). So the install also gives JupyterLab a
post-save hook (`post_save`, in this environment's jupyter_server_config.json): after a save
whose only changes are outputs, it re-adds the file, which stages nothing new and lets git
record that the file matches; after a save that changed a cell it does nothing.

    python -m distlab.lab.git_outputs     # in the checkout (the README's first command runs it)

It writes to the checkout's own .git/config and .git/info/attributes, nothing global, and is
safe to run again. `git config --unset-all filter.nbstripout.clean` (and the two lines in
.git/info/attributes) undo it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# What nbstripout removes beyond its defaults: the kernel's language_info details (a Run All
# writes them; the committed notebooks carry only the language's name). --keep-id keeps the
# cell ids the committed notebooks have (nbstripout renumbers them otherwise).
KERNEL_KEYS = " ".join(f"metadata.language_info.{k}" for k in (
    "codemirror_mode", "file_extension", "mimetype", "nbconvert_exporter", "pygments_lexer",
    "version"))
ATTRIBUTES = ("*.ipynb filter=nbstripout", "*.ipynb diff=ipynb")


def filter_command(python: str = sys.executable) -> str:
    return f'"{python}" -m nbstripout --keep-id --extra-keys "{KERNEL_KEYS}"'


def install(repo: str = ".", prefix: str = sys.prefix) -> str:
    """Configure the filter in the git checkout that holds `repo` and the post-save hook in
    the Jupyter config of the environment at `prefix`; returns the checkout's top folder."""
    def git(*args):
        return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    top = git("rev-parse", "--show-toplevel")
    git("config", "filter.nbstripout.clean", filter_command())
    git("config", "filter.nbstripout.smudge", "cat")
    git("config", "diff.ipynb.textconv", filter_command() + " -t")
    info = os.path.join(git("rev-parse", "--absolute-git-dir"), "info", "attributes")
    os.makedirs(os.path.dirname(info), exist_ok=True)
    have = open(info, encoding="utf-8").read().splitlines() if os.path.exists(info) else []
    with open(info, "a", encoding="utf-8") as f:
        for line in ATTRIBUTES:
            if line not in have:
                f.write(line + "\n")
    write_hook_config(prefix)
    return top


def write_hook_config(prefix: str) -> str:
    """Set ContentsManager.post_save_hook in {prefix}/etc/jupyter/jupyter_server_config.json,
    keeping whatever else the file holds. Not a file in jupyter_server_config.d: the server
    reads those for its own ServerApp settings (extensions) and drops other sections, so a
    hook written there never ran (issue 25). Returns the file's path."""
    folder = os.path.join(prefix, "etc", "jupyter")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "jupyter_server_config.json")
    config = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    config.setdefault("ContentsManager", {})["post_save_hook"] = HOOK
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    stale = os.path.join(folder, "jupyter_server_config.d", "distlab.json")
    if os.path.exists(stale):  # what earlier versions wrote, and the server never read
        os.remove(stale)
    return path


# The hook by its importable name: under `python -m distlab.lab.git_outputs` (the README's
# command) __name__ is "__main__", which the server cannot import (issue 25: every saved
# notebook showed as modified); __spec__.name is the module's own name either way.
HOOK = f"{__spec__.name}.post_save"


def post_save(model=None, os_path: str = "", contents_manager=None, **_) -> bool:
    """JupyterLab's post-save hook (see the module docstring). True if it re-added the file."""
    if not os_path.endswith(".ipynb"):
        return False
    folder, name = os.path.split(os_path)

    def git(*args):
        return subprocess.run(["git", "-C", folder or ".", *args], capture_output=True,
                              timeout=30).returncode
    try:
        tracked = git("ls-files", "--error-unmatch", "--", name) == 0
        # through the filter the file equals what the index holds: only outputs changed
        if tracked and git("diff", "--quiet", "--", name) == 0:
            return git("add", "--", name) == 0
    except (OSError, subprocess.TimeoutExpired):
        pass  # no git, or a slow one: the save itself has happened, and that is what matters
    return False


def main() -> int:
    # DISTLAB_JUPYTER_PREFIX: where the hook's config goes instead of this environment (a
    # test's temporary folder, read by a server started with JUPYTER_CONFIG_PATH)
    prefix = os.environ.get("DISTLAB_JUPYTER_PREFIX", sys.prefix)
    try:
        top = install(prefix=prefix)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"not a git checkout (or no git): outputs cannot dirty anything here ({e})")
        return 0
    print(f"{top}: git now compares the notebooks without their outputs (nbstripout filter)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
